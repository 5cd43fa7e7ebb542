"""The recurrent-state snapshot cache against a plain-Python model of an LRU byte budget."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching._state_snapshots import StateSnapshot, StateSnapshotCache


class _Slots:
    """A recurrent layer's cache as mlx-lm keeps it: a list of state arrays."""

    def __init__(self, slots: list[Any]) -> None:
        self.cache = slots


def snapshot(floats: int, position: int = 0) -> StateSnapshot:
    return StateSnapshot([_Slots([mx.zeros((1, floats)), None])], position)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(1, 12)),
        st.tuples(st.just("get"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("discard"), st.integers(0, 7), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(budget_floats=st.integers(0, 30), ops=OPS)
def test_the_cache_is_an_lru_byte_budget(
    budget_floats: int, ops: list[tuple[str, int, int]]
) -> None:
    budget = 4 * budget_floats
    cache = StateSnapshotCache(budget)
    model: OrderedDict[int, int] = OrderedDict()  # key -> bytes, least recently used first
    stored = evicted = dropped = hits = 0
    for op, key, floats in ops:
        name = bytes([key])
        if op == "put":
            size = 4 * floats
            kept = cache.put(name, snapshot(floats))
            if key in model:
                model.move_to_end(key)
                assert kept
            elif size > budget:
                assert not kept
            else:
                while sum(model.values()) + size > budget:
                    model.popitem(last=False)
                    evicted += 1
                model[key] = size
                stored += 1
                assert kept
        elif op == "get":
            found = cache.get(name)
            assert (found is not None) == (key in model)
            if key in model:
                model.move_to_end(key)
                assert found is not None and found.nbytes == model[key]
                cache.note_hit(3)
                hits += 1
        else:
            cache.forget_block("full", name)
            if model.pop(key, None) is not None:
                dropped += 1
        stats = cache.stats()
        assert stats.bytes == cache.nbytes == sum(model.values()) <= budget
        assert stats.snapshots == len(cache) == len(model)
        assert [k for k in range(8) if bytes([k]) in cache] == sorted(model)
        assert (stats.stored, stats.evictions, stats.dropped, stats.hits) == (
            stored,
            evicted,
            dropped,
            hits,
        )
        assert stats.hit_tokens == 3 * hits
    cache.clear()
    assert cache.stats().bytes == 0 and len(cache) == 0


def test_a_detached_snapshot_does_not_keep_the_batch_alive() -> None:
    mx.clear_cache()
    base = mx.get_active_memory()
    batch = mx.random.normal((16, 1024, 256))
    mx.eval(batch)
    row = _Slots([batch[3:4]])
    kept = StateSnapshot([row], 5, detach=True)
    mx.eval(kept.arrays())
    del batch, row
    mx.clear_cache()
    # Only the one row's bytes stay (a view would keep all 16 rows: 16 MiB).
    assert mx.get_active_memory() - base < 8 * 2**20
    (back,) = kept.caches()
    assert back.cache[0].shape == (1, 1024, 256) and kept.nbytes == 1024 * 256 * 4
