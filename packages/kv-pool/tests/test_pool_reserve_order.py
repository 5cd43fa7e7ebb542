"""try_reserve_batch when one request's release would make another's room.

One reservation per step decides for the whole batch: what a sliding sub-pool releases for one
request is room for another's new pages, so every release is applied before any allocation
when the requests' own order would run dry. Regression: an earlier room check counted one
request's releases for another and a reservation request by request then ran out of pages.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_pool import HybridKVPool
from kv_pool._inspect import allocator, num_free_pages, page_table, sub_pool_names
from kv_protocol import CacheLayout, LayerKind, LayerSpec, PoolExhaustedError


def tl(a: mx.array) -> Any:
    return a.tolist()


def layout(window: int) -> CacheLayout:
    """Sliding layers 0 and 2, full layers 1 and 3."""
    specs = []
    for i in range(4):
        if i % 2 == 0:
            specs.append(
                LayerSpec(
                    layer_id=i, kind=LayerKind.SLIDING, window=window, n_kv_heads=1, head_dim=2
                )
            )
        else:
            specs.append(LayerSpec(layer_id=i, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2))
    return CacheLayout(specs)


def crossing_pair() -> HybridKVPool:
    """Window 4, pages of 2, no free sliding page. Request 0 holds 4 tokens: its next token
    opens a new page and releases none. Request 1 holds 5: its next token releases page 0 and
    needs no new one."""
    pool = HybridKVPool(layout(4), num_pages={"sliding-w4": 6, "full": 32}, page_size=2)
    for rid, n in ((0, 4), (1, 5)):
        pool.add_request(rid)
        pool.reserve(rid, n)
    assert num_free_pages(pool, "sliding-w4") == 0
    return pool


def test_another_requests_release_is_room_in_one_batch() -> None:
    pool = crossing_pair()
    # Request 0 alone finds no page; request 1's release in the same batch makes it room.
    with pytest.raises(PoolExhaustedError):
        pool.reserve(0, 1)
    assert pool.try_reserve_batch({0: 1}) is None
    got = pool.try_reserve_batch({0: 1, 1: 1})
    assert got is not None and got.lengths == (5, 6)
    assert num_free_pages(pool, "sliding-w4") == 0


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_a_batch_releases_before_it_allocates(order: list[int]) -> None:
    pool = crossing_pair()
    twin = crossing_pair()
    got = pool.try_reserve_batch(dict.fromkeys(order, 1))
    assert got is not None
    want = {rid: twin.reserve(rid, 1) for rid in (1, 0)}
    for name in sub_pool_names(pool):
        assert tl(got.slots[name]) == [s for rid in order for s in tl(want[rid].slots[name])]
        for rid in (0, 1):
            assert tl(page_table(pool, rid, name)) == tl(page_table(twin, rid, name))
    assert num_free_pages(pool, "sliding-w4") == 0
    assert [pool.seq_len(r) for r in (0, 1)] == [5, 6]


def _room(pool: HybridKVPool, lengths: list[int], wanted: dict[int, int], window: int) -> bool:
    """Plain arithmetic: new pages against free pages plus those the batch releases."""
    for spec in pool.sub_pools:
        size, sliding = spec.page_size, spec.window is not None
        new = released = 0
        for rid, n in wanted.items():
            table: list[int] = tl(page_table(pool, rid, spec.name))
            new += -(-(lengths[rid] + n) // size) - len(table)
            if sliding:
                first = max(0, lengths[rid] - window + 1)
                released += sum(1 for p in table[: first // size] if p)
        if new > num_free_pages(pool, spec.name) + released:
            return False
    return True


@given(
    window=st.integers(1, 6),
    page_size=st.integers(1, 4),
    lengths=st.lists(st.integers(0, 20), min_size=2, max_size=5),
    demands=st.lists(st.sampled_from([1, 1, 1, 0, 2, 5]), min_size=5, max_size=5),
    spare=st.integers(0, 2),
    order_seed=st.integers(0, 2**16),
)
def test_a_batch_fits_exactly_when_its_pages_are_there(
    window: int,
    page_size: int,
    lengths: list[int],
    demands: list[int],
    spare: int,
    order_seed: int,
) -> None:
    probe = HybridKVPool(layout(window), num_pages=1000, page_size=page_size)
    for rid, n in enumerate(lengths):
        probe.add_request(rid)
        probe.reserve(rid, n)
    # A roomy full sub-pool; a sliding one whose current pages leave `spare` free pages.
    used = allocator(probe, f"sliding-w{window}").num_used
    counts = {"full": 1000, f"sliding-w{window}": max(2, used + 1 + spare)}

    def build() -> HybridKVPool:
        pool = HybridKVPool(layout(window), num_pages=counts, page_size=page_size)
        for rid, n in enumerate(lengths):
            pool.add_request(rid)
            pool.reserve(rid, n)
        return pool

    def tables(pool: HybridKVPool) -> list[Any]:
        return [tl(page_table(pool, r, n)) for r in range(len(lengths)) for n in counts]

    order = list(range(len(lengths)))
    random.Random(order_seed).shuffle(order)
    wanted = {rid: demands[rid] for rid in order}
    pool = build()
    room = _room(pool, lengths, wanted, window)
    # One by one in some order: when that fits, one batch fits too, with the same pages.
    alone = build()
    fits_alone = True
    try:
        for rid in order:
            alone.reserve(rid, wanted[rid])
    except PoolExhaustedError:
        fits_alone = False
    got = pool.try_reserve_batch(wanted)
    assert (got is not None) == room
    if fits_alone:
        assert got is not None
        for name in counts:
            assert num_free_pages(pool, name) == num_free_pages(alone, name)
    if got is None:
        assert tables(pool) == tables(build())
        assert [pool.seq_len(r) for r in range(len(lengths))] == lengths
    else:
        assert [pool.seq_len(r) for r in order] == [lengths[r] + wanted[r] for r in order]
        pool.rollback(got)
        assert [pool.seq_len(r) for r in range(len(lengths))] == lengths
