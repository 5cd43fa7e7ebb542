"""set_kv / get_kv refuse slot arrays that would write outside the pool's live pages.

Regression: ``set_kv(0, mx.array([-1]), k, v)`` wrote the buffer's last slot, which can
belong to another request's live page. Pool-issued slot arrays are trusted by identity (the
decode path must not read slots back from the device); any other array is read once.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_pool import HybridKVPool
from kv_pool._inspect import batch_slots
from kv_pool._storage import KVStorage
from kv_protocol import CacheLayout, LayerKind, LayerSpec, RequestStateError, ShapeMismatchError


def layout() -> CacheLayout:
    """Layer 0 sliding (window 4), layer 1 full; 2 heads x 4 dims, fp32."""
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=4, n_kv_heads=2, head_dim=4),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4),
        ]
    )


def filled_pool() -> HybridKVPool:
    """Page size 2, 6 pages (slots 0..11, null page = slots 0, 1); request 0 holds 3 tokens."""
    pool = HybridKVPool(layout(), num_pages=6, page_size=2)
    pool.add_request(0)
    slots = pool.reserve(0, 3).slots
    for layer in (0, 1):
        kv = mx.arange(3 * 2 * 4, dtype=mx.float32).reshape(3, 2, 4) + 100 * layer
        pool.set_kv(layer, slots[pool.sub_pool_of(layer)], kv, -kv)
    return pool


def snapshot(pool: HybridKVPool) -> list[np.ndarray]:
    return [
        np.array(f(layer)) for layer in (0, 1) for f in (pool.get_key_buffer, pool.get_value_buffer)
    ]


def kv(t: int) -> mx.array:
    return mx.full((t, 2, 4), 7.0)


BAD_VALUES = [
    ([-1], "slot -1 is out of range"),
    ([12], "slot 12 is out of range"),
    ([4, 40], "slot 40 is out of range"),
    ([0], "slot 0 is in the null page 0"),
    ([3, 1], "slot 1 is in the null page 0"),
    ([4, 5, 4], "slot 4 appears more than once"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES)
@pytest.mark.parametrize("layer", [0, 1])
def test_bad_slot_values_are_refused_and_nothing_changes(
    values: list[int], message: str, layer: int
) -> None:
    pool = filled_pool()
    before = snapshot(pool)
    slots = mx.array(values, dtype=mx.int32)
    with pytest.raises(RequestStateError, match=message) as info:
        pool.set_kv(layer, slots, kv(len(values)), kv(len(values)))
    assert "must be in 2..11" in str(info.value) or "distinct" in str(info.value)
    for got, want in zip(snapshot(pool), before, strict=True):
        np.testing.assert_array_equal(got, want)
    if "more than once" not in message:
        with pytest.raises(RequestStateError, match=message):
            pool.get_kv(layer, slots)


BAD_SHAPES: list[tuple[Any, str]] = [
    (mx.array([4, 5], dtype=mx.int64), "int32, got .*int64"),
    (mx.array([4.0, 5.0]), "int32, got .*float32"),
    (mx.array([[4, 5]], dtype=mx.int32), "1-D"),
    ([4, 5], "1-D mx.array"),
]


@pytest.mark.parametrize(("slots", "message"), BAD_SHAPES)
def test_bad_slot_arrays_are_refused_and_nothing_changes(slots: Any, message: str) -> None:
    pool = filled_pool()
    before = snapshot(pool)
    with pytest.raises(ShapeMismatchError, match=message):
        pool.set_kv(1, slots, kv(2), kv(2))
    with pytest.raises(ShapeMismatchError, match=message):
        pool.get_kv(1, slots)
    for got, want in zip(snapshot(pool), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_length_mismatch_is_a_shape_error() -> None:
    pool = filled_pool()
    with pytest.raises(ShapeMismatchError, match=r"\(T, n_kv_heads, head_dim\) = \(2, 2, 4\)"):
        pool.set_kv(1, mx.array([4, 5], dtype=mx.int32), kv(3), kv(3))


def test_reads_may_repeat_a_slot() -> None:
    pool = filled_pool()
    k, _ = pool.get_kv(1, mx.array([2, 2], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(k[0]), np.array(k[1]))


def test_issued_slots_skip_the_host_check(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = HybridKVPool(layout(), num_pages=8, page_size=2)
    checked: list[Any] = []
    real = KVStorage._check_slot_values

    def counting(self: KVStorage, *args: Any, **kwargs: Any) -> list[int]:
        checked.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVStorage, "_check_slot_values", counting)
    pool.add_request(0)
    pool.add_request(1)
    for step in range(3):
        reserved = pool.reserve(0, 2).slots
        batch = pool.try_reserve_batch({1: 1})
        assert batch is not None
        for layer in (0, 1):
            name = pool.sub_pool_of(layer)
            pool.set_kv(layer, reserved[name], kv(2), kv(2))
            pool.get_kv(layer, pool.token_slots(0, layer, 2 * step, 2 * step + 2))
            pool.set_kv(layer, batch_slots(pool, [0, 1], name, [2 * step, step]), kv(2), kv(2))
            pool.set_kv(layer, pool.token_slots(1, layer, step, step + 1), kv(1), kv(1))
            assert batch.slots[name].shape == (1,)
    assert checked == []
    # A foreign array is read once; a checked array is then trusted like an issued one.
    foreign = mx.array([4, 5], dtype=mx.int32)
    for _ in range(3):
        pool.set_kv(1, foreign, kv(2), kv(2))
    assert len(checked) == 1
    # ... but only in the sub-pool it was checked for.
    pool.set_kv(0, foreign, kv(2), kv(2))
    assert len(checked) == 2


def test_issued_slots_still_write_where_reserved() -> None:
    pool = filled_pool()
    pool.add_request(1)
    got = pool.try_reserve_batch({0: 1, 1: 1})
    assert got is not None
    pool.set_kv(1, got.slots["full"], kv(2) * 0 + 5.0, kv(2))
    k, _ = pool.get_kv(1, pool.token_slots(1, 1, 0, 1))
    assert np.all(np.array(k) == 5.0)
    k, _ = pool.get_kv(1, pool.token_slots(0, 1, 3, 4))
    assert np.all(np.array(k) == 5.0)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(-20, 30), min_size=1, max_size=5))
def test_any_slot_array_writes_exactly_its_slots_or_nothing(values: list[int]) -> None:
    pool = filled_pool()
    before = snapshot(pool)
    ok = all(2 <= v < 12 for v in values) and len(set(values)) == len(values)
    slots = mx.array(values, dtype=mx.int32)
    if not ok:
        with pytest.raises(RequestStateError):
            pool.set_kv(1, slots, kv(len(values)), kv(len(values)))
        after = snapshot(pool)
    else:
        pool.set_kv(1, slots, kv(len(values)), kv(len(values)))
        after = snapshot(pool)
        before[2][:, values] = 7.0
        before[3][:, values] = 7.0
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)
