"""can_reserve and reserve_batch when one request's release would make another's room.

Regression: ``can_reserve`` used to count the pages a sliding sub-pool releases for one
request as room for *another* request's new pages. A caller that then reserved request by
request (the decode engine: a prefill chunk now, the decode tokens a step later) hit
``PoolExhaustedError`` after ``can_reserve`` said yes; ``reserve_batch`` applied each request's
release and allocation in turn and so could fail the same way after its own room check passed.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_pool import HybridKVPool
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
    assert pool.num_free_pages("sliding-w4") == 0
    return pool


def test_another_requests_release_is_no_room_for_can_reserve() -> None:
    pool = crossing_pair()
    # Request 0 reserving first would find no page, whatever request 1 releases later.
    assert not pool.can_reserve({0: 1, 1: 1})
    with pytest.raises(PoolExhaustedError):
        pool.reserve(0, 1)
    assert pool.can_reserve({1: 1}) and not pool.can_reserve({0: 1})
    pool.reserve(1, 1)
    assert pool.can_reserve({0: 1})
    pool.reserve(0, 1)


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_reserve_batch_releases_before_it_allocates(order: list[int]) -> None:
    pool = crossing_pair()
    twin = crossing_pair()
    got = pool.reserve_batch(order, 1)
    want = {rid: twin.reserve(rid, 1) for rid in (1, 0)}
    for name in pool.sub_pool_names:
        assert tl(got[name]) == [tl(want[rid][name]) for rid in order]
        for rid in (0, 1):
            assert tl(pool.page_table(rid, name)) == tl(twin.page_table(rid, name))
    assert pool.num_free_pages("sliding-w4") == 0
    assert [pool.seq_len(r) for r in (0, 1)] == [5, 6]


@given(
    window=st.integers(1, 6),
    page_size=st.integers(1, 4),
    lengths=st.lists(st.integers(0, 20), min_size=2, max_size=5),
    demands=st.lists(st.sampled_from([1, 1, 1, 0, 2, 5]), min_size=5, max_size=5),
    spare=st.integers(0, 2),
    order_seed=st.integers(0, 2**16),
)
def test_can_reserve_means_any_order_fits(
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
    used = probe.allocator(f"sliding-w{window}").num_used
    counts = {"full": 1000, f"sliding-w{window}": max(2, used + 1 + spare)}

    def build() -> HybridKVPool:
        pool = HybridKVPool(layout(window), num_pages=counts, page_size=page_size)
        for rid, n in enumerate(lengths):
            pool.add_request(rid)
            pool.reserve(rid, n)
        return pool

    pool = build()
    wanted = {rid: demands[rid] for rid in range(len(lengths))}
    if not pool.can_reserve(wanted):
        return
    order = list(wanted)
    random.Random(order_seed).shuffle(order)
    for rid in order:
        pool.reserve(rid, wanted[rid])
    if len(set(demands[: len(lengths)])) == 1:
        batch = build()
        batch.reserve_batch(order, demands[0])
        for name in pool.sub_pool_names:
            assert batch.num_free_pages(name) == pool.num_free_pages(name)
