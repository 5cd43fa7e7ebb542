"""Hostile-caller regressions: stale slot arrays, trims, bad id and count types, huge pools."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx
import pytest

from kv_pool import HybridKVPool, PageAllocator
from kv_pool._inspect import (
    batch_slots,
    held_pages,
    num_free_pages,
    page_table,
    request_ids,
    sub_pool_names,
)
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    InvalidPageError,
    KVCacheError,
    LayerKind,
    LayerSpec,
    LayoutError,
    RequestStateError,
)

SLIDING = LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=4, n_kv_heads=1, head_dim=2)
FULL = LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2)


def layout() -> CacheLayout:
    return CacheLayout([SLIDING, FULL])


def kv(n: int, value: float) -> mx.array:
    return mx.full((n, 1, 2), value, dtype=mx.float32)


def snapshot(pool: HybridKVPool) -> Any:
    return (
        {
            r: (pool.seq_len(r), [held_pages(pool, r, n) for n in sub_pool_names(pool)])
            for r in request_ids(pool)
        },
        [num_free_pages(pool, n) for n in sub_pool_names(pool)],
    )


@pytest.mark.parametrize("source", ["reserve", "after_a_batch", "token_slots", "batch_slots"])
def test_stale_slots_cannot_overwrite_the_next_owner(source: str) -> None:
    pool = HybridKVPool(layout(), num_pages=3, page_size=4)
    pool.add_request(0)
    reserved = pool.reserve(0, 2).slots
    slots = {
        "reserve": reserved["full"],
        "after_a_batch": None,
        "token_slots": pool.token_slots(0, 1, 0, 2),
        "batch_slots": batch_slots(pool, [0], "full", [1]),
    }[source]
    if slots is None:
        batch = pool.try_reserve_batch({0: 1})
        assert batch is not None
        pool.set_kv(1, batch.slots["full"], kv(1, 1.0), kv(1, 1.0))
        slots = pool.token_slots(0, 1, 0, 3)
    pool.set_kv(1, slots, kv(slots.shape[0], 1.0), kv(slots.shape[0], 1.0))
    pool.free_request(0)
    # The only free page goes to request 1, which writes its own KV there.
    pool.add_request(1)
    mine = pool.reserve(1, 2).slots["full"]
    pool.set_kv(1, mine, kv(2, 7.0), kv(2, 7.0))
    with pytest.raises(CacheStateError, match="freed since"):
        pool.set_kv(1, slots, kv(slots.shape[0], 9.0), kv(slots.shape[0], 9.0))
    keys, _ = pool.get_kv(1, pool.token_slots(1, 1, 0, 2))
    assert keys.reshape(-1).tolist() == [7.0] * 4


def test_slots_stay_trusted_while_their_pages_keep_their_owner() -> None:
    pool = HybridKVPool(layout(), num_pages=8, page_size=2)
    for rid in (0, 1):
        pool.add_request(rid)
    slots = pool.reserve(0, 2).slots["full"]
    pool.reserve(1, 2)
    pool.free_request(1)  # another request's pages: no effect on request 0's slots
    pool.set_kv(1, slots, kv(2, 3.0), kv(2, 3.0))
    pool.trim_request(0, 2)
    with pytest.raises(CacheStateError):
        pool.set_kv(1, slots, kv(2, 3.0), kv(2, 3.0))


def test_sliding_release_ends_the_trust_of_old_slots() -> None:
    pool = HybridKVPool(layout(), num_pages=8, page_size=2)
    pool.add_request(0)
    old = pool.reserve(0, 2).slots["sliding-w4"]
    for _ in range(6):
        pool.reserve(0, 1)
    table: Any = page_table(pool, 0, "sliding-w4").tolist()
    assert table[0] == 0  # the first pages left the window
    with pytest.raises(CacheStateError):
        pool.set_kv(0, old, kv(2, 1.0), kv(2, 1.0))


def test_trim_rolls_back_a_reservation_and_refuses_released_windows() -> None:
    pool = HybridKVPool(layout(), num_pages=16, page_size=2)
    pool.add_request(0)
    pool.reserve(0, 9)
    before = snapshot(pool)
    pool.reserve(0, 3)  # releases sliding pages below position 6
    pool.trim_request(0, 3)
    assert pool.seq_len(0) == 9
    free_after = [num_free_pages(pool, n) for n in sub_pool_names(pool)]
    # the reservation's release stays done (nothing at 9 sees those pages); new pages went back
    assert free_after[1] == before[1][1]
    assert free_after[0] >= before[1][0]
    with pytest.raises(CacheStateError, match="released positions"):
        pool.trim_request(0, 6)
    for bad in (-1, 10, 1.0, True, "1", None):
        state = snapshot(pool)
        with pytest.raises(RequestStateError):
            pool.trim_request(0, bad)  # type: ignore[arg-type]
        assert snapshot(pool) == state


BAD_IDS: list[Any] = [0.0, 1.5, True, "0", None, [0], (0,)]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_request_ids_must_be_ints(bad: Any) -> None:
    real = HybridKVPool(layout(), num_pages=8, page_size=2)
    pool: Any = real
    pool.add_request(0)
    pool.reserve(0, 3)
    state = snapshot(pool)
    as_demands = {bad: 1} if isinstance(bad, Hashable) else bad
    calls: list[Callable[[], object]] = [
        lambda: pool.free_request(bad),
        lambda: pool.add_request(bad),
        lambda: pool.reserve(bad, 1),
        lambda: pool.seq_len(bad),
        lambda: pool.try_reserve_batch(as_demands),
        lambda: pool.try_reserve_batch({0: 1}, headroom=as_demands),
        lambda: pool.trim_request(bad, 0),
        lambda: page_table(pool, bad, "full"),
        lambda: pool.fork_request(0, bad, 1),
    ]
    for call in calls:
        with pytest.raises(KVCacheError):
            call()
        assert snapshot(pool) == state


def test_counts_and_containers_are_checked() -> None:
    real = HybridKVPool(layout(), num_pages=8, page_size=2)
    pool: Any = real
    pool.add_request(0)
    state = snapshot(pool)
    calls: list[Callable[[], object]] = [
        lambda: pool.reserve(0, 1.0),
        lambda: pool.reserve(0, -1),
        lambda: pool.reserve(0, True),
        lambda: pool.try_reserve_batch(0),
        lambda: pool.try_reserve_batch("0"),
        lambda: pool.try_reserve_batch([0]),
        lambda: pool.try_reserve_batch({0: 1.0}),
        lambda: pool.try_reserve_batch({0: -1}),
        lambda: pool.try_reserve_batch({0: 1}, headroom=[0]),
        lambda: pool.rollback("not a reservation"),
        lambda: pool.token_slots(0, 1, 0.0, 0),
    ]
    for call in calls:
        with pytest.raises(RequestStateError):
            call()
        assert snapshot(pool) == state


def test_allocator_inputs_are_checked() -> None:
    alloc = PageAllocator(4, name="t")
    pages = alloc.alloc(2)
    for bad in (5, "12", None, [1.0], [True]):
        with pytest.raises(InvalidPageError):
            alloc.free(bad)  # type: ignore[arg-type]
        assert alloc.num_free == 1
    for count in (1.0, -1, True, "1"):
        with pytest.raises(RequestStateError):
            alloc.alloc(count)  # type: ignore[arg-type]
    with pytest.raises(RequestStateError):
        PageAllocator(2.0)  # type: ignore[arg-type]
    alloc.free(tuple(pages))
    assert alloc.num_free == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_pages": 2**31 // 16 + 1, "page_size": 16}, "at most 2147483647"),
        ({"num_pages": 2**40, "page_size": 1}, "int32"),
        ({"num_pages": 8.0, "page_size": 2}, "num_pages"),
        ({"num_pages": 8, "page_size": 2.0}, "page_size"),
    ],
)
def test_pool_size_limits(kwargs: Any, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        HybridKVPool(layout(), **kwargs)


def test_from_budget_refuses_a_pool_past_the_slot_limit() -> None:
    with pytest.raises(LayoutError, match="slots per layer buffer"):
        HybridKVPool.from_budget(layout(), 2**45, max_context=64, concurrency=1, page_size=16)
    assert HybridKVPool.from_budget(layout(), 2**20, max_context=64, concurrency=1)


def test_trim_never_leaves_a_request_writing_into_a_page_it_shares() -> None:
    pool = HybridKVPool(layout(), num_pages=16, page_size=2)
    pool.add_request(0)
    slots = pool.reserve(0, 4).slots["full"]
    pool.set_kv(1, slots, kv(4, 1.0), kv(4, 1.0))
    pool.fork_request(0, 1, 4)  # shares both full pages
    state = snapshot(pool)
    with pytest.raises(CacheStateError, match="shared with another request"):
        pool.trim_request(0, 1)
    assert snapshot(pool) == state
    pool.trim_request(0, 2)  # back to a page boundary: the next write takes a fresh page
    fresh = pool.reserve(0, 1).slots["full"]
    pool.set_kv(1, fresh, kv(1, 9.0), kv(1, 9.0))
    child, _ = pool.get_kv(1, pool.token_slots(1, 1, 0, 4))
    assert child.reshape(-1).tolist() == [1.0] * 8
