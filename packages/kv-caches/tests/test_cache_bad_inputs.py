"""Bad inputs raise the project's errors and leave every cache exactly as it was.

The stateful test drives two caches of one kind side by side: ``subject`` sees random valid
operations interleaved with invalid calls, ``reference`` sees only the valid ones. Every
invalid call must raise a ``KVCacheError`` and leave ``subject`` indistinguishable from
``reference`` (offset, size, capacity, nbytes, allocations, state, and what the next valid
call returns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_caches import (
    AttentionOffsetCache,
    ContiguousAttentionKVCache,
    QuantizedAttentionKVCache,
    WindowedAttentionKVCache,
    causal_band_mask,
    is_storage_backed,
    make_attention_mask,
    to_contiguous,
)
from kv_protocol import CacheStateError, KVCacheError, LayoutError, ShapeMismatchError

H, D = 2, 32

StorageCache = ContiguousAttentionKVCache | WindowedAttentionKVCache | QuantizedAttentionKVCache

FACTORIES: dict[str, Callable[[], StorageCache]] = {
    "contiguous-lazy": lambda: ContiguousAttentionKVCache(max_seq_len=4),
    "contiguous-eager": lambda: ContiguousAttentionKVCache(H, D, max_seq_len=4),
    "contiguous-pinned": lambda: ContiguousAttentionKVCache(max_seq_len=3, dtype=mx.float32),
    "windowed-1": lambda: WindowedAttentionKVCache(1),
    "windowed-3": lambda: WindowedAttentionKVCache(3),
    "windowed-6": lambda: WindowedAttentionKVCache(6),
    "quantized-4": lambda: QuantizedAttentionKVCache(bits=4, group_size=32, max_seq_len=4),
    "quantized-8": lambda: QuantizedAttentionKVCache(bits=8, group_size=32, max_seq_len=2),
}

# Counts that are not ints: floats (also integral ones), bools, strings, None, containers.
NOT_INTS: list[Any] = [1.0, 2.5, True, False, "1", None, [1], np.float64(1.0), mx.array(1.5)]


def chunk(
    n: int, seed: int, *, heads: int = H, dim: int = D, dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, heads, n, dim)).astype(np.float32)
    v = rng.standard_normal((1, heads, n, dim)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def flat(x: Any) -> list[Any]:
    """Every array (and int) of a nested tuple, in order."""
    if isinstance(x, tuple | list):
        return [leaf for item in x for leaf in flat(item)]
    return [x]


def assert_same_output(a: Any, b: Any) -> None:
    left, right = flat(a), flat(b)
    assert len(left) == len(right)
    for x, y in zip(left, right, strict=True):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array)
            assert x.shape == y.shape and x.dtype == y.dtype
            assert mx.array_equal(x, y).item()
        else:
            assert x == y


def assert_same_cache(subject: Any, reference: Any) -> None:
    assert subject.offset == reference.offset
    assert subject.size() == reference.size()
    assert subject.empty() == reference.empty()
    assert subject.nbytes == reference.nbytes
    assert subject.capacity == reference.capacity
    assert subject.allocations == reference.allocations
    assert_same_output(subject.state, reference.state)


def dtype_is_pinned(cache: StorageCache) -> bool:
    """True when the dtype of the next write is fixed already."""
    if isinstance(cache, ContiguousAttentionKVCache):
        return cache.dtype is not None  # pinned at construction or by the first write
    return cache.capacity > 0


def trim_is_valid(cache: StorageCache, n: int) -> bool:
    if not 0 <= n <= cache.offset:
        return False
    if isinstance(cache, WindowedAttentionKVCache):
        return cache.held - n >= min(cache.offset - n, cache.window - 1)
    return True


def bad_kv_calls(cache: StorageCache) -> list[tuple[str, Any, Any]]:
    """``(method, keys, values)`` that are invalid whatever the cache holds."""
    k, v = chunk(2, 0)
    calls: list[tuple[str, Any, Any]] = [
        ("update_and_fetch", k[0], v[0]),  # 3-D
        ("update_and_fetch", k[None], v[None]),  # 5-D
        ("update_and_fetch", k, v[:, :, :1]),  # S differs
        ("update_and_fetch", k[:, :, :0], v[:, :, :0]),  # no token
        ("update_and_fetch", k, v.astype(mx.float16)),  # dtypes differ
        ("update_and_fetch", np.array(k), np.array(v)),  # not mlx arrays
        ("update_and_fetch", None, None),
        ("update_and_fetch", "keys", "values"),
        ("update_and_fetch", [1.0], [2.0]),
        ("update_and_fetch", k[:, :0], v[:, :0]),  # zero heads
        ("update_and_fetch", k[:, :, :, :0], v[:, :, :, :0]),  # zero head_dim
    ]
    if not isinstance(cache, QuantizedAttentionKVCache):
        calls += [("write_token", k, v), ("write_token", None, None), ("write_token", k[0], v[0])]
    else:
        odd_k, odd_v = chunk(1, 0, dim=48)  # not a multiple of group_size
        calls += [
            ("update_and_fetch", odd_k, odd_v),
            ("update_and_fetch", *chunk(1, 0, dtype=mx.float64)),  # mx.quantize refuses it
            ("update_and_fetch", *chunk(1, 0, dtype=mx.int32)),
        ]
    if dtype_is_pinned(cache):
        calls.append(("update_and_fetch", *chunk(1, 0, dtype=mx.float16)))
    if cache.capacity > 0:  # the geometry of the held tokens is fixed
        calls += [
            ("update_and_fetch", *chunk(1, 0, heads=H + 1)),
            ("update_and_fetch", *chunk(1, 0, dim=2 * D)),
            ("update_and_fetch", chunk(1, 0)[0], chunk(1, 0, dim=2 * D)[1]),  # value dim
            ("update_and_fetch", mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D))),  # batch
        ]
    return calls


def bad_states(cache: StorageCache) -> list[Any]:
    k, v = chunk(3, 1)
    states: list[Any] = [
        0,
        1.5,
        "state",
        mx.zeros((2,)),
        mx.zeros((1, H, 2, D)),
        (k,),
        (k, v, 1, 2),
    ]
    if isinstance(cache, ContiguousAttentionKVCache):
        states += [(k[0], v[0]), (k, v[:, :, :1]), (None, None), (k, v.astype(mx.float16))]
    elif isinstance(cache, WindowedAttentionKVCache):
        states += [(k, v, 2), (k, v, 2.0), (k, v, True), (k, v, -1), (k, v, None), (k[0], v[0], 3)]
        if cache.window > 2:
            states.append((k[:, :, :1], v[:, :, :1], 10))  # fewer than the window needs
    else:
        packed = mx.quantize(k, group_size=32, bits=cache.bits)
        other = mx.quantize(v, group_size=32, bits=cache.bits)
        states += [
            (packed[:2], other),
            (packed, other[:2]),
            (packed, (other[0].astype(mx.int32), other[1], other[2])),  # values not uint32
            (packed, (other[0], other[1].astype(mx.float16), other[2])),  # dtypes differ
            (packed, (other[0], other[1][:, :, :1], other[2][:, :, :1])),  # S differs
            ((packed[0], packed[1].astype(mx.float64), packed[2].astype(mx.float64)), other),
            tuple(tuple(x[:, :, :0] for x in triple) for triple in (packed, other)),  # no token
            (k, v),
        ]
    return states


@settings(max_examples=120, deadline=None)
@given(kind=st.sampled_from(sorted(FACTORIES)), data=st.data())
def test_invalid_calls_leave_the_cache_unchanged(kind: str, data: st.DataObject) -> None:
    subject, reference = FACTORIES[kind](), FACTORIES[kind]()
    quantized = isinstance(subject, QuantizedAttentionKVCache)
    operations = ["append", "append", "token", "trim", "reset", "bad_kv", "bad_trim", "bad_mask"]
    operations += ["bad_state", "bad_get_kv"]
    for step in range(data.draw(st.integers(4, 20), label="steps")):
        op = data.draw(st.sampled_from(operations), label="op")
        if op == "append" or (op == "token" and quantized):
            n = data.draw(st.integers(1, 5), label="n")
            keys, values = chunk(n, step)
            assert_same_output(
                subject.update_and_fetch(keys, values), reference.update_and_fetch(keys, values)
            )
        elif op == "token":
            keys, values = chunk(1, step)
            subject.write_token(keys, values)  # type: ignore[union-attr]
            reference.write_token(keys, values)  # type: ignore[union-attr]
        elif op == "trim":
            n = data.draw(st.integers(0, reference.offset), label="trim")
            if not trim_is_valid(reference, n):
                with pytest.raises(CacheStateError):
                    subject.trim(n)
            else:
                as_numpy = data.draw(st.booleans(), label="numpy int")
                assert subject.trim(np_int(n) if as_numpy else n) == n
                assert reference.trim(n) == n
        elif op == "reset":
            subject.reset()
            reference.reset()
        elif op == "bad_kv":
            method, keys, values = data.draw(st.sampled_from(bad_kv_calls(reference)), label="kv")
            with pytest.raises(KVCacheError):
                getattr(subject, method)(keys, values)
        elif op == "bad_trim":
            bad = data.draw(st.sampled_from([*NOT_INTS, -1, reference.offset + 1]), label="bad")
            with pytest.raises(CacheStateError):
                subject.trim(bad)
        elif op == "bad_mask":
            args: dict[str, Any] = data.draw(
                st.sampled_from(
                    [
                        {"N": 2.0},
                        {"N": True},
                        {"N": 0},
                        {"N": "2"},
                        {"N": None},
                        {"N": 1, "window_size": 2.0},
                        {"N": 1, "window_size": 0},
                        {"N": 1, "window_size": True},
                        {"N": 1, "window_size": "4"},
                        {"N": 2, "return_array": "yes"},
                        {"N": 2, "return_array": mx.array([True, False])},
                    ]
                ),
                label="mask",
            )
            with pytest.raises(KVCacheError):
                subject.make_mask(**args)
        elif op == "bad_state":
            value = data.draw(st.sampled_from(bad_states(reference)), label="state")
            with pytest.raises(KVCacheError):
                subject.state = value
        elif op == "bad_get_kv" and not quantized and reference.capacity:
            not_windows = [x for x in NOT_INTS if x is not None]  # None: the default window
            window = data.draw(st.sampled_from([*not_windows, 0, -2]), label="window")
            with pytest.raises(KVCacheError):
                subject.get_kv(window)  # type: ignore[union-attr]
        assert_same_cache(subject, reference)
    # The next valid call returns the same keys and values.
    keys, values = chunk(2, 999)
    assert_same_output(
        subject.update_and_fetch(keys, values), reference.update_and_fetch(keys, values)
    )
    assert_same_cache(subject, reference)


def test_offset_cache_bad_inputs_leave_it_unchanged() -> None:
    cache = AttentionOffsetCache(4)
    for bad in [*NOT_INTS, -1]:
        with pytest.raises(ShapeMismatchError, match="offset must be an int >= 0"):
            AttentionOffsetCache(bad)
        with pytest.raises(ShapeMismatchError):
            cache.offset = bad
        assert cache.offset == 4
    for bad in [*NOT_INTS, -1, 5]:
        with pytest.raises(CacheStateError):
            cache.trim(bad)
        assert cache.offset == 4
    for state in [mx.zeros((2,)), (mx.zeros(1),), 1, "x"]:
        with pytest.raises(CacheStateError):
            cache.state = state
    empties: list[Any] = [(), [], None]
    for empty in empties:
        cache.state = empty
    with pytest.raises(CacheStateError):
        cache.update_and_fetch(*chunk(1, 0))
    assert cache.offset == 4 and cache.state == ()
    # numpy integers are ints.
    cache.offset = np_int(6)
    assert cache.offset == 6 and type(cache.offset) is int
    assert cache.trim(np_int(2, np.int32)) == 2 and cache.offset == 4


@pytest.mark.parametrize(
    ("build", "args", "kwargs", "error"),
    [
        (QuantizedAttentionKVCache, (), {"bits": 8.0}, LayoutError),
        (QuantizedAttentionKVCache, (), {"bits": 4.0}, LayoutError),
        (QuantizedAttentionKVCache, (), {"bits": None}, LayoutError),
        (QuantizedAttentionKVCache, (), {"bits": [8]}, LayoutError),
        (QuantizedAttentionKVCache, (), {"group_size": 64.0}, LayoutError),
        (QuantizedAttentionKVCache, (), {"group_size": True}, LayoutError),
        (QuantizedAttentionKVCache, (), {"group_size": "64"}, LayoutError),
        (QuantizedAttentionKVCache, (), {"max_seq_len": 4.0}, LayoutError),
        (QuantizedAttentionKVCache, (), {"max_seq_len": None}, LayoutError),
        (ContiguousAttentionKVCache, (), {"max_seq_len": 4.0}, LayoutError),
        (ContiguousAttentionKVCache, (), {"max_seq_len": True}, LayoutError),
        (ContiguousAttentionKVCache, (), {"max_seq_len": "4"}, LayoutError),
        (ContiguousAttentionKVCache, (), {"max_seq_len": None}, LayoutError),
        (ContiguousAttentionKVCache, (), {"max_seq_len": -3}, LayoutError),
        (ContiguousAttentionKVCache, (2.0, 4), {}, LayoutError),
        (ContiguousAttentionKVCache, (2, True), {}, LayoutError),
        (ContiguousAttentionKVCache, (2, "4"), {}, LayoutError),
        (ContiguousAttentionKVCache, (2, 4), {"dtype": "float32"}, LayoutError),
        (WindowedAttentionKVCache, (8.0,), {}, LayoutError),
        (WindowedAttentionKVCache, (True,), {}, LayoutError),
        (WindowedAttentionKVCache, (None,), {}, LayoutError),
        (WindowedAttentionKVCache, ("8",), {}, LayoutError),
        (WindowedAttentionKVCache, ([8],), {}, LayoutError),
        (AttentionOffsetCache, (2.0,), {}, ShapeMismatchError),
        (AttentionOffsetCache, (None,), {}, ShapeMismatchError),
        (make_attention_mask, (2.0, 0), {}, ShapeMismatchError),
        (make_attention_mask, (2, 1.0), {}, ShapeMismatchError),
        (make_attention_mask, (2, None), {}, ShapeMismatchError),
        (make_attention_mask, (2, 0), {"window_size": 4.0}, LayoutError),
        (make_attention_mask, (2, 0), {"return_array": 1}, LayoutError),
        (make_attention_mask, (True, 0), {}, ShapeMismatchError),
        (causal_band_mask, (2, "0"), {}, ShapeMismatchError),
        (to_contiguous, (ContiguousAttentionKVCache(),), {"max_seq_len": 2.0}, LayoutError),
        (to_contiguous, (WindowedAttentionKVCache(4),), {"max_seq_len": 0}, LayoutError),
        (to_contiguous, (QuantizedAttentionKVCache(),), {"max_seq_len": "8"}, LayoutError),
    ],
)
def test_bad_constructor_and_helper_arguments(
    build: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: type
) -> None:
    with pytest.raises(error) as info:
        build(*args, **kwargs)
    assert isinstance(info.value, KVCacheError)


def np_int(value: int, dtype: type = np.int64) -> Any:
    """``value`` as a numpy integer (typed ``Any``: the annotations say ``int``)."""
    return dtype(value)


def test_numpy_integers_are_ints() -> None:
    cache = QuantizedAttentionKVCache(bits=np_int(4), group_size=np_int(32, np.int32))
    assert cache.bits == 4 and type(cache.bits) is int and cache.group_size == 32
    windowed = WindowedAttentionKVCache(np_int(3))
    assert windowed.window == 3 and type(windowed.window) is int
    contiguous = ContiguousAttentionKVCache(np_int(H), np_int(D), max_seq_len=np_int(8, np.int16))
    assert contiguous.capacity == 8 and contiguous.max_seq_len == 8
    assert make_attention_mask(np_int(2), np_int(3)) == "causal"
    assert make_attention_mask(np_int(1), 0) is None
    assert to_contiguous(windowed, max_seq_len=np_int(5)).max_seq_len == 5
    assert is_storage_backed(cache) and not is_storage_backed("cache")


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_returned_arrays_never_change_after_trim_and_write(kind: str) -> None:
    """A later write into the buffers (after a trim) must not alter what was returned."""
    cache = FACTORIES[kind]()
    keys, values = chunk(cache.capacity or 4, 5)
    returned = cache.update_and_fetch(keys, values)
    state = cache.state
    mx.eval(returned, state)
    before = [np.array(x) for x in flat(returned) + flat(state) if isinstance(x, mx.array)]
    cache.trim(1)
    cache.update_and_fetch(*chunk(1, 6))
    after = [np.array(x) for x in flat(returned) + flat(state) if isinstance(x, mx.array)]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("dtype", [mx.float64, mx.int32, mx.bool_])
def test_quantized_refuses_dtypes_mx_quantize_cannot_take(dtype: mx.Dtype) -> None:
    """float64 would fail only when the graph is evaluated, after the cache had changed."""
    cache = QuantizedAttentionKVCache(bits=4, group_size=32)
    with pytest.raises(ShapeMismatchError, match="floating point"):
        cache.update_and_fetch(*chunk(2, 0, dtype=dtype))
    assert cache.empty() and cache.offset == 0 and cache.capacity == 0 and cache.state == ()
    assert cache.nbytes == 0 and cache.allocations == 0
