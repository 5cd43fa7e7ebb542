"""One sub-pool's page tables under its lifetime rule, with no tensors involved.

The oracle is the definition of a window: after reservations that took a request through
lengths ``L_0 < L_1 < ... < L_n``, it holds exactly the logical pages from the one holding
``first_visible(L_{n-1})`` (what the queries of the last reservation still see) up to the page
of position ``L_n - 1``; every other page it ever had is back on the free list.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_pool._page_tables import SubPoolPages
from kv_protocol import CacheStateError, KVLifetime, PoolExhaustedError, RequestStateError


def reserve(pages: SubPoolPages, rid: int, length: int, n: int) -> None:
    plan = pages.plan(rid, length, n)
    pages.check_room(plan.n_new, plan.reclaim)
    pages.release(rid, plan)
    pages.grow(rid, plan)


@given(
    window=st.one_of(st.none(), st.integers(1, 24)),
    page_size=st.integers(1, 8),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=12),
)
def test_held_pages_follow_the_window(
    window: int | None, page_size: int, chunks: list[int]
) -> None:
    life = KVLifetime(window)
    pages = SubPoolPages("sub", page_size=page_size, num_pages=400, lifetime=life)
    pages.add(0)
    length = previous = 0
    for n in chunks:
        reserve(pages, 0, length, n)
        previous, length = length, length + n
    table = pages.table(0)
    first = life.first_live_page(previous, page_size)
    assert table.first_live == first
    assert len(table.pages) == -(-length // page_size)
    assert all(p == 0 for p in table.pages[:first])
    held = table.held()
    assert len(set(held)) == len(held) and 0 not in held
    assert pages.allocator.num_used == len(held)
    pages.free(0)
    assert pages.allocator.num_used == 0


def test_a_shortage_changes_nothing() -> None:
    pages = SubPoolPages("sub", page_size=2, num_pages=4, lifetime=KVLifetime())
    pages.add(0)
    reserve(pages, 0, 0, 4)
    plan = pages.plan(0, 4, 3)
    with pytest.raises(PoolExhaustedError):
        pages.check_room(plan.n_new, plan.reclaim)
    assert pages.table(0).held() == [1, 2] and pages.allocator.num_free == 1


def test_trim_refuses_to_drop_what_the_new_length_still_sees() -> None:
    pages = SubPoolPages("sw", page_size=2, num_pages=16, lifetime=KVLifetime(3))
    pages.add(0)
    for length in range(10):
        reserve(pages, 0, length, 1)
    first_live = pages.table(0).first_live
    assert first_live > 0
    # Back to 9 tokens: the query at 9 sees 7..9, still held.
    keep = pages.trim_keep(0, 10, 1)
    pages.trim(0, keep)
    # Back to 2 tokens: the query at 2 sees 0..2, released long ago.
    with pytest.raises(CacheStateError, match="still sees"):
        pages.trim_keep(0, 9, 7)


def test_fork_shares_whole_pages_and_copies_the_tail() -> None:
    pages = SubPoolPages("full", page_size=4, num_pages=16, lifetime=KVLifetime())
    pages.add(0)
    reserve(pages, 0, 0, 10)
    plan = pages.fork_plan(0, 10)
    assert plan.first == 0 and plan.shared == pages.table(0).held()[:2]
    assert plan.tail_page == pages.table(0).held()[2]
    tail = pages.fork(1, plan)
    assert tail not in pages.table(0).held()
    assert pages.table(1).held() == [*plan.shared, tail]
    assert all(pages.allocator.refcount(p) == 2 for p in plan.shared)
    # The parent cannot trim into a page it shares with the child.
    with pytest.raises(CacheStateError, match="shared with another request"):
        pages.trim_keep(0, 10, 3)
    sliding = SubPoolPages("sw", page_size=2, num_pages=32, lifetime=KVLifetime(2))
    sliding.add(0)
    for length in range(12):
        reserve(sliding, 0, length, 1)
    with pytest.raises(RequestStateError, match="still needs"):
        sliding.fork_plan(0, 4)
