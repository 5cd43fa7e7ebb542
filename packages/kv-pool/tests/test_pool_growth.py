"""Buffers that grow with use: the pool's behaviour is the preallocated pool's, memory is not.

The state machines of ``test_pool_state_machine`` and ``test_pool_prefix_cache`` run again on
pools whose buffers start at one slab, with a rule that shrinks them in between: every page
table, refcount, prefix hit and read-back value must come out as the models say, while the
buffers always cover every page held or cached and never outgrow the slabs those need (after
a shrink) or the cap.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_pool_prefix_cache import PrefixCacheMachine, PrefixCacheUnderPressure, layout
from test_pool_state_machine import LAYERS, LAYOUT, NAMES, NUM, PAGE, PoolMachine

from kv_pool import HybridKVPool, PageAllocator
from kv_pool._inspect import allocator
from kv_protocol import (
    CacheLayout,
    KVQuantization,
    LayerKind,
    LayerSpec,
    LayoutError,
    stored_arrays,
)

SLABS = {"sliding-w5-1x2": 2, "full-1x2": 3, "sliding-w3-2x2": 1, "full-2x4": 5}


def committed_pages(pool: HybridKVPool, name: str) -> int:
    """Pages the sub-pool's buffers hold, read from the buffers themselves."""
    spec = next(s for s in pool.sub_pools if s.name == name)
    slots = {int(pool.get_key_buffer(layer).shape[1]) for layer in spec.layer_ids}
    slots |= {int(pool.get_value_buffer(layer).shape[1]) for layer in spec.layer_ids}
    assert len(slots) == 1
    (n,) = slots
    assert n % spec.page_size == 0
    return n // spec.page_size


def highest_needed(pool: HybridKVPool, name: str, *, cached: bool = True) -> int:
    """The highest page held (or cached) in a sub-pool, 0 for none."""
    alloc = allocator(pool, name)
    top = 0
    for page in range(1, alloc.num_pages):
        held = alloc.refcount(page) > 0
        kept = cached and alloc.block_of(page) is not None
        if held or kept:
            top = page
    return top


def cover(pages: int, slab: int, cap: int) -> int:
    return min(math.ceil(pages / slab) * slab, cap)


def check_cover(pool: HybridKVPool, slabs: dict[str, int]) -> None:
    report = {s.name: s for s in pool.memory_report().sub_pools}
    for name, slab in slabs.items():
        n = committed_pages(pool, name)
        cap = report[name].num_pages
        assert report[name].pages_committed == n
        assert highest_needed(pool, name) < n <= cap
        assert n == cap or n % slab == 0


def check_shrunk(pool: HybridKVPool, slabs: dict[str, int], *, cached: bool) -> None:
    for name, slab in slabs.items():
        cap = allocator(pool, name).num_pages
        want = max(cover(highest_needed(pool, name, cached=cached) + 1, slab, cap), min(slab, cap))
        assert committed_pages(pool, name) == want


class GrowingPoolMachine(PoolMachine):
    """The pool state machine on growing buffers, with shrinks among its steps."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridKVPool(LAYOUT, num_pages=NUM, page_size=PAGE, slab_pages=SLABS)

    @rule()
    def shrink(self) -> None:
        before = self.pool.memory_report()
        given_back = self.pool.shrink()
        after = self.pool.memory_report()
        assert given_back == before.bytes_committed - after.bytes_committed >= 0
        check_shrunk(self.pool, SLABS, cached=False)

    @invariant()
    def buffers_cover_the_pages(self) -> None:
        check_cover(self.pool, SLABS)


GrowingPoolMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
test_growing_buffers_follow_the_pool_model = GrowingPoolMachine.TestCase

PREFIX_SLABS = {"sliding-w5": 3, "full": 2}


class GrowingPrefixMachine(PrefixCacheMachine):
    """Exact prefix hits on growing buffers: a shrink keeps every cached block."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridKVPool(
            layout(),
            num_pages=self.num_pages,
            page_size={"sliding-w5": 2, "full": 4},
            prefix_caching=True,
            slab_pages=PREFIX_SLABS,
        )
        cache = self.pool.prefix_cache
        assert cache is not None
        self.cache = cache
        cache.add_eviction_listener(self._forgot)

    @rule()
    def shrink(self) -> None:
        self.pool.shrink()
        check_shrunk(self.pool, PREFIX_SLABS, cached=True)

    @invariant()
    def buffers_cover_the_pages(self) -> None:
        check_cover(self.pool, PREFIX_SLABS)


class GrowingPrefixUnderPressure(PrefixCacheUnderPressure):
    """A small growing pool whose shrinks may also drop the cached blocks past the held pages."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridKVPool(
            layout(),
            num_pages=self.num_pages,
            page_size={"sliding-w5": 2, "full": 4},
            prefix_caching=True,
            slab_pages=PREFIX_SLABS,
        )
        cache = self.pool.prefix_cache
        assert cache is not None
        self.cache = cache
        cache.add_eviction_listener(self._forgot)

    @rule(drop=st.booleans())
    def shrink(self, drop: bool) -> None:
        self.pool.shrink(drop_cached=drop)
        check_shrunk(self.pool, PREFIX_SLABS, cached=not drop)

    @invariant()
    def buffers_cover_the_pages(self) -> None:
        check_cover(self.pool, PREFIX_SLABS)


for machine in (GrowingPrefixMachine, GrowingPrefixUnderPressure):
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_growing_prefix_hits_stay_exact = GrowingPrefixMachine.TestCase
test_growing_prefix_hits_stay_right_when_shrinks_drop_blocks = GrowingPrefixUnderPressure.TestCase


def one_full_layer(bits: int | None = None) -> HybridKVPool:
    spec = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=64)
    quant = None if bits is None else KVQuantization(bits=bits, group_size=64)
    return HybridKVPool(
        CacheLayout([spec]), num_pages=41, page_size=4, slab_pages=8, kv_quantization=quant
    )


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_buffers_grow_by_slabs_and_keep_what_was_written(bits: int | None) -> None:
    pool = one_full_layer(bits)
    assert committed_pages(pool, "full") == 8
    rows: list[mx.array] = []
    for rid in range(4):
        pool.add_request(rid)
        pool.reserve(rid, 40)  # 10 pages each
        k = mx.random.normal((40, 2, 64), key=mx.random.key(rid))
        pool.set_kv(0, pool.token_slots(rid, 0, 0, 40), k, -k)
        rows.append(pool.get_kv(0, pool.token_slots(rid, 0, 0, 40))[0])
        # null page + 10 pages a request, in slabs of 8, at most the 41 pages
        assert committed_pages(pool, "full") == cover(1 + 10 * (rid + 1), 8, 41)
    for rid in range(4):
        k, v = pool.get_kv(0, pool.token_slots(rid, 0, 0, 40))
        assert mx.array_equal(k, rows[rid]).item() and mx.array_equal(v, -rows[rid]).item()
    for buffer in (pool.get_key_buffer(0), pool.get_value_buffer(0)):
        for array in stored_arrays(buffer):
            assert array.shape[1] == 41 * 4
    report = pool.memory_report()
    assert report.bytes_committed == report.bytes_total


def test_shrink_gives_back_the_tail_and_keeps_running_requests() -> None:
    pool = one_full_layer()
    for rid in range(3):
        pool.add_request(rid)
        pool.reserve(rid, 40)
    k = mx.arange(40 * 2 * 64, dtype=mx.float32).reshape(40, 2, 64)
    pool.set_kv(0, pool.token_slots(0, 0, 0, 40), k, k)
    assert committed_pages(pool, "full") == 32
    pool.free_request(1)
    pool.free_request(2)
    per_page = pool.sub_pools[0].bytes_per_page
    assert pool.shrink() == (32 - 16) * per_page  # request 0 holds pages 1..10
    assert committed_pages(pool, "full") == 16
    got, _ = pool.get_kv(0, pool.token_slots(0, 0, 0, 40))
    assert mx.array_equal(got, k).item()
    assert pool.shrink() == 0
    pool.free_request(0)
    assert pool.shrink() == 8 * per_page  # one slab stays
    assert committed_pages(pool, "full") == 8


def test_lowest_free_pages_are_handed_out_first() -> None:
    alloc = PageAllocator(10)
    first = alloc.alloc(6)
    assert first == [1, 2, 3, 4, 5, 6]
    alloc.free([5, 2])
    assert alloc.alloc(3) == [2, 5, 7]
    assert alloc.high_water == 7
    alloc.free([7, 6])
    assert alloc.high_water == 7 and alloc.settle_high_water() == 5


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=40))
def test_held_pages_are_the_lowest_possible_after_frees(ops: list[tuple[bool, int]]) -> None:
    """Every alloc takes the lowest free ids: against a plain sorted-set model."""
    alloc = PageAllocator(16)
    free = set(range(1, 16))
    held: list[int] = []
    for take, n in ops:
        if take and n <= len(free):
            got = alloc.alloc(n)
            assert got == sorted(free)[:n]
            free -= set(got)
            held += got
        elif held:
            page = held.pop(n % len(held))
            alloc.free([page])
            free.add(page)
        assert alloc.high_water >= max(held, default=0)


def test_bad_slab_sizes_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="slab_pages of sub-pool 'full-1x2'"):
        HybridKVPool(LAYOUT, num_pages=NUM, page_size=PAGE, slab_pages={**SLABS, "full-1x2": 0})
    with pytest.raises(LayoutError, match="missing"):
        HybridKVPool(LAYOUT, num_pages=NUM, page_size=PAGE, slab_pages={"full-1x2": 2})


def test_preallocated_pools_do_not_shrink() -> None:
    pool = HybridKVPool(LAYOUT, num_pages=NUM, page_size=PAGE)
    assert pool.shrink() == 0 and pool.shrink(drop_cached=True) == 0
    for name in NAMES:
        assert committed_pages(pool, name) == NUM[name]
    assert all(s.pages_committed is None for s in pool.memory_report().sub_pools)
    assert LAYERS
