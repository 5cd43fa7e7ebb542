"""ContiguousAttentionKVCache against a plain Python list model and mlx-lm's KVCache."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache as MlxLmKVCache

from kv_caches import ContiguousAttentionKVCache
from kv_protocol import CacheStateError, DecodeKVCache, KVCache, LayoutError, ShapeMismatchError

H, D = 2, 4


def chunk(start: int, n: int, *, scale: float = 1.0) -> tuple[mx.array, mx.array]:
    """Distinct values per position so any misplaced token shows."""
    base = np.arange(start, start + n, dtype=np.float32)[None, None, :, None]
    k = np.broadcast_to(base * scale + np.arange(H * D).reshape(1, H, 1, D) / 100, (1, H, n, D))
    return mx.array(k), mx.array(-k)


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x)


op = st.one_of(
    st.tuples(st.just("chunk"), st.integers(1, 9)),
    st.tuples(st.just("token"), st.just(1)),
    st.tuples(st.just("trim"), st.integers(0, 6)),
    st.tuples(st.just("get"), st.integers(1, 12)),
)


@given(ops=st.lists(op, min_size=1, max_size=25), initial=st.integers(1, 6), eager=st.booleans())
def test_matches_list_model(ops: list[tuple[str, int]], initial: int, eager: bool) -> None:
    cache = (
        ContiguousAttentionKVCache(H, D, max_seq_len=initial)
        if eager
        else ContiguousAttentionKVCache(max_seq_len=initial)
    )
    model_k: list[np.ndarray] = []  # one (H, D) row per token
    counter = 0
    for kind, n in ops:
        if kind in ("chunk", "token"):
            k, v = chunk(counter, n, scale=1.0 + counter)
            counter += n
            if kind == "chunk":
                out_k, out_v = cache.update_and_fetch(k, v)
            else:
                cache.write_token(k, v)
                out_k, out_v = cache.get_kv()
            model_k.extend(as_np(k)[0].transpose(1, 0, 2))
            expect = np.stack(model_k, axis=1)[None]
            np.testing.assert_array_equal(as_np(out_k), expect)
            np.testing.assert_array_equal(as_np(out_v), -expect)
        elif kind == "trim":
            if n > len(model_k):
                with pytest.raises(CacheStateError):
                    cache.trim(n)
            else:
                assert cache.trim(n) == n
                del model_k[len(model_k) - n :]
        elif model_k:
            out_k, _ = cache.get_kv(n)
            expect = np.stack(model_k[-n:], axis=1)[None]
            np.testing.assert_array_equal(as_np(out_k), expect)
        assert cache.offset == len(model_k) == cache.size()
        assert cache.capacity >= cache.offset
        if cache.capacity:
            # Doubling: allocations stay logarithmic in the capacity reached.
            assert cache.allocations <= 1 + math.ceil(math.log2(max(cache.capacity / initial, 1)))


@given(chunks=st.lists(st.integers(1, 20), min_size=1, max_size=10))
def test_matches_mlx_lm_kvcache(chunks: list[int]) -> None:
    ours, theirs = ContiguousAttentionKVCache(max_seq_len=16), MlxLmKVCache()
    start = 0
    for n in chunks:
        assert ours.make_mask(n) == theirs.make_mask(n, return_array=False, window_size=None)
        k, v = chunk(start, n)
        start += n
        ok, ov = ours.update_and_fetch(k, v)
        tk, tv = theirs.update_and_fetch(k, v)
        assert mx.array_equal(ok, tk).item() and mx.array_equal(ov, tv).item()
        assert ours.offset == theirs.offset


def test_protocols_and_eager_allocation() -> None:
    cache = ContiguousAttentionKVCache(H, D, max_seq_len=32)
    assert isinstance(cache, KVCache) and isinstance(cache, DecodeKVCache)
    assert cache.capacity == 32 and cache.allocations == 1
    assert cache.nbytes == 2 * H * 32 * D * 4
    assert cache.empty() and cache.dtype == mx.float32
    lazy = ContiguousAttentionKVCache()
    assert lazy.capacity == 0 and lazy.nbytes == 0 and lazy.state == ()
    lazy.update_and_fetch(*chunk(0, 3))
    assert lazy.capacity == 4096 and lazy.dtype == mx.float32


def test_growth_reallocates_logarithmically() -> None:
    cache = ContiguousAttentionKVCache(max_seq_len=4)
    for i in range(1000):
        cache.write_token(*chunk(i, 1))
        if i % 100 == 0:
            mx.eval(cache.state)
    assert cache.offset == 1000
    # 4 -> 8 -> ... -> 1024: one allocation per doubling, not per token.
    assert cache.allocations == 1 + math.ceil(math.log2(1000 / 4))
    assert cache.capacity == 1024
    keys, _ = cache.get_kv()
    np.testing.assert_array_equal(as_np(keys)[0, 0, :, 0], np.arange(1000, dtype=np.float32))


def test_growth_and_rewrites_never_change_pending_graphs() -> None:
    cache = ContiguousAttentionKVCache(max_seq_len=4)
    k, v = cache.update_and_fetch(*chunk(0, 3))
    pending = k * 2 + v  # lazy: not evaluated yet
    cache.trim(2)
    cache.update_and_fetch(*chunk(100, 10))  # overwrites positions 1.. and grows
    expect = as_np(chunk(0, 3)[0]) * 2 + as_np(chunk(0, 3)[1])
    np.testing.assert_array_equal(as_np(pending), expect)
    now, _ = cache.get_kv()
    assert now.shape[2] == 11 and now[0, 0, 1, 0].item() == 100


def test_bad_writes_raise_and_change_nothing() -> None:
    cache = ContiguousAttentionKVCache(H, D, max_seq_len=8)
    cache.update_and_fetch(*chunk(0, 2))
    before = as_np(cache.get_kv()[0])
    bad = [
        (mx.zeros((1, H, 1, D + 1)), mx.zeros((1, H, 1, D + 1))),
        (mx.zeros((1, H + 1, 1, D)), mx.zeros((1, H + 1, 1, D))),
        (mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D))),
        (mx.zeros((H, 1, D)), mx.zeros((H, 1, D))),
        (mx.zeros((1, H, 1, D), dtype=mx.float16), mx.zeros((1, H, 1, D), dtype=mx.float16)),
        (mx.zeros((1, H, 2, D)), mx.zeros((1, H, 3, D))),
        (mx.zeros((1, H, 0, D)), mx.zeros((1, H, 0, D))),
    ]
    for k, v in bad:
        with pytest.raises(ShapeMismatchError):
            cache.update_and_fetch(k, v)
    with pytest.raises(ShapeMismatchError, match="one token"):
        cache.write_token(*chunk(5, 2))
    for n in (-1, 3):
        with pytest.raises(CacheStateError, match=f"cannot trim {n} tokens from offset 2"):
            cache.trim(n)
    assert cache.offset == 2
    np.testing.assert_array_equal(as_np(cache.get_kv()[0]), before)


def test_constructor_errors() -> None:
    with pytest.raises(LayoutError, match="both n_kv_heads and head_dim"):
        ContiguousAttentionKVCache(n_kv_heads=2)
    with pytest.raises(LayoutError, match="max_seq_len"):
        ContiguousAttentionKVCache(max_seq_len=0)
    with pytest.raises(LayoutError, match="head_dim"):
        ContiguousAttentionKVCache(2, 0)
    with pytest.raises(CacheStateError, match="holds no data"):
        ContiguousAttentionKVCache().get_kv()


def test_pinned_dtype_and_state_roundtrip() -> None:
    cache = ContiguousAttentionKVCache(dtype=mx.float16)
    with pytest.raises(ShapeMismatchError, match="expected dtype"):
        cache.update_and_fetch(*chunk(0, 2))
    assert cache.empty() and cache.capacity == 0
    src = ContiguousAttentionKVCache(max_seq_len=4)
    src.update_and_fetch(*chunk(0, 6))
    mx.eval(src.state)
    copy = ContiguousAttentionKVCache(max_seq_len=4)
    copy.state = src.state
    assert copy.offset == 6
    assert mx.array_equal(copy.get_kv()[0], src.get_kv()[0]).item()
    src.reset()
    assert src.offset == 0 and src.empty() and src.capacity == 6
    k, _ = src.update_and_fetch(*chunk(50, 1))
    assert k.shape[2] == 1 and k[0, 0, 0, 0].item() == 50
