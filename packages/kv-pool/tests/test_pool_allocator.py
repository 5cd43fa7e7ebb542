from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_pool import PageAllocator
from kv_protocol import InvalidPageError, KVCacheError, PoolExhaustedError
from kv_protocol import PageAllocator as PageAllocatorProtocol


def _state(a: PageAllocator) -> tuple[int, list[int]]:
    return a.num_free, [a.refcount(p) for p in range(a.num_pages)]


def test_satisfies_protocol() -> None:
    alloc: PageAllocatorProtocol = PageAllocator(4)
    assert isinstance(alloc, PageAllocatorProtocol)


def test_alloc_never_hands_out_null_page_and_is_atomic() -> None:
    a = PageAllocator(5, name="full")
    assert a.num_pages == 5 and a.num_free == 4 and a.num_used == 0
    pages = a.alloc(3)
    assert sorted(pages) == [1, 2, 3] and 0 not in pages
    assert all(a.refcount(p) == 1 for p in pages)
    before = _state(a)
    with pytest.raises(PoolExhaustedError) as info:
        a.alloc(2)
    assert info.value.sub_pool == "full"
    assert info.value.pages_requested == 2 and info.value.pages_free == 1
    assert "sub-pool 'full' is exhausted: 2 pages requested, 1 free" in str(info.value)
    assert isinstance(info.value, MemoryError)
    assert _state(a) == before
    assert a.alloc(0) == []


@pytest.mark.parametrize(
    ("pages", "fragment"),
    [
        ([0], "null page"),
        ([5], "not owned"),
        ([-1], "not owned"),
        ([4], "is free"),
        ([1, 4], "is free"),
        ([1, 1], "has only 1 owner"),
    ],
)
def test_bad_free_changes_nothing(pages: list[int], fragment: str) -> None:
    a = PageAllocator(5)
    a.alloc(2)  # pages 1, 2
    before = _state(a)
    with pytest.raises(InvalidPageError, match=fragment) as info:
        a.free(pages)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVCacheError)
    assert _state(a) == before


def test_shared_page_returns_after_last_owner() -> None:
    a = PageAllocator(3)
    (page,) = a.alloc(1)
    a.incref([page])
    assert a.refcount(page) == 2
    a.free([page])
    assert a.refcount(page) == 1 and a.num_free == 1
    a.free([page])
    assert a.refcount(page) == 0 and a.num_free == 2
    assert a.pages_allocated_total == 1 and a.pages_released_total == 1
    with pytest.raises(InvalidPageError):
        a.free([page])
    with pytest.raises(InvalidPageError):
        a.incref([page])


def test_bad_constructor_and_args() -> None:
    with pytest.raises(KVCacheError):
        PageAllocator(0)
    a = PageAllocator(3)
    with pytest.raises(KVCacheError):
        a.alloc(-1)
    with pytest.raises(InvalidPageError):
        a.refcount(3)


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 4), st.integers(0, 9)),
    max_size=40,
)


@given(OPS)
def test_matches_counter_model(ops: list[tuple[str, int, int]]) -> None:
    a = PageAllocator(8)
    owners: Counter[int] = Counter()
    for op, n, pick in ops:
        held = sorted(owners)
        if op == "alloc":
            if n > 7 - len(owners):
                with pytest.raises(PoolExhaustedError):
                    a.alloc(n)
            else:
                got = a.alloc(n)
                assert not set(got) & set(owners) and 0 not in got
                owners.update(got)
        else:
            # a page id that is held, free, or out of range
            page = held[pick % len(held)] if held and pick < 6 else pick
            pages = [page] * max(n, 1)
            legal = 0 < page < 8 and owners[page] > 0
            if op == "free":
                legal = legal and len(pages) <= owners[page]
            before = _state(a)
            if not legal:
                with pytest.raises(InvalidPageError):
                    getattr(a, op)(pages)
                assert _state(a) == before
                continue
            getattr(a, op)(pages)
            if op == "incref":
                owners[page] += len(pages)
            else:
                owners[page] -= len(pages)
                if owners[page] == 0:
                    del owners[page]
        assert a.num_free == 7 - len(owners)
        assert all(a.refcount(p) == owners[p] for p in range(1, 8))
        assert a.refcount(0) == 0
