"""WindowedAttentionKVCache vs a contiguous cache's trailing slice and mlx-lm's rotating cache."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

from kv_caches import ContiguousAttentionKVCache, WindowedAttentionKVCache, make_attention_mask
from kv_protocol import CacheStateError, DecodeKVCache, KVCache, ShapeMismatchError

H, D = 2, 4
FULL_CONTEXT_ERROR = (
    "WindowedAttentionKVCache holds only the trailing window and cannot serve a full-context "
    "attention mask"
)


def random_kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)


def dense_mask(mask: Any, n_queries: int, n_keys: int) -> np.ndarray:
    """Any mask spec as the boolean keep-array SDPA would apply (bottom-right causal)."""
    if mask is None:
        return np.ones((n_queries, n_keys), dtype=bool)
    if isinstance(mask, str):
        assert mask == "causal"
        q = np.arange(n_keys - n_queries, n_keys)[:, None]
        return np.asarray(q >= np.arange(n_keys)[None])
    arr = np.array(mask)
    assert arr.shape[-1] == n_keys
    return np.broadcast_to(arr, (n_queries, n_keys))


@settings(max_examples=40)
@given(
    window=st.integers(1, 10),
    chunks=st.lists(st.integers(1, 25), min_size=1, max_size=12),
)
def test_returns_trailing_slice_of_contiguous(window: int, chunks: list[int]) -> None:
    windowed = WindowedAttentionKVCache(window)
    contiguous = ContiguousAttentionKVCache(max_seq_len=8)
    for step, n in enumerate(chunks):
        offset = contiguous.offset
        mask = windowed.make_mask(n, window_size=window)
        reference_mask = make_attention_mask(n, offset, window_size=window)
        k, v = random_kv(n, step)
        wk, wv = windowed.update_and_fetch(k, v)
        ck, cv = contiguous.update_and_fetch(k, v)
        start = max(0, offset - window + 1)
        assert wk.shape[2] == offset + n - start
        assert mx.array_equal(wk, ck[:, :, start:]).item()
        assert mx.array_equal(wv, cv[:, :, start:]).item()
        assert windowed.offset == contiguous.offset == offset + n
        # The mask admits exactly what the full band admits over the returned keys.
        assert isinstance(reference_mask, mx.array)
        np.testing.assert_array_equal(
            dense_mask(mask, n, wk.shape[2]), np.array(reference_mask)[:, start:]
        )
        # Every key outside the returned slice is outside every query's band.
        assert not np.array(reference_mask)[:, :start].any()
        assert windowed.capacity <= max(2 * window, window - 1 + n)
        assert windowed.held <= windowed.capacity


@settings(max_examples=40)
@given(
    window=st.integers(2, 9),
    chunks=st.lists(st.integers(1, 20), min_size=1, max_size=14),
)
def test_attention_matches_mlx_lm_rotating_cache(window: int, chunks: list[int]) -> None:
    ours, theirs = WindowedAttentionKVCache(window), RotatingKVCache(max_size=window)
    for step, n in enumerate(chunks):
        our_mask = ours.make_mask(n, window_size=window)
        their_mask = theirs.make_mask(n, window_size=window)
        k, v = random_kv(n, 1000 + step)
        q = mx.random.normal((1, 2 * H, n, D), key=mx.random.key(step))
        ok, ov = ours.update_and_fetch(k, v)
        tk, tv = theirs.update_and_fetch(k, v)
        a = mx.fast.scaled_dot_product_attention(q, ok, ov, scale=0.5, mask=our_mask)
        b = mx.fast.scaled_dot_product_attention(q, tk, tv, scale=0.5, mask=their_mask)
        assert mx.allclose(a, b, atol=1e-5).item()
        assert ours.offset == theirs.offset


@given(window=st.integers(1, 8), steps=st.integers(1, 40), prefill=st.integers(0, 20))
def test_decode_path_matches_contiguous(window: int, steps: int, prefill: int) -> None:
    ours, contiguous = WindowedAttentionKVCache(window), ContiguousAttentionKVCache(max_seq_len=4)
    if prefill:
        k, v = random_kv(prefill, 7)
        ours.update_and_fetch(k, v)
        contiguous.update_and_fetch(k, v)
    for step in range(steps):
        k, v = random_kv(1, step)
        ours.write_token(k, v)
        contiguous.write_token(k, v)
        wk, wv = ours.get_kv()
        ck, cv = contiguous.get_kv(window)
        assert mx.array_equal(wk, ck).item() and mx.array_equal(wv, cv).item()
        assert ours.capacity <= max(2 * window, window - 1 + prefill)


def test_storage_bounded_over_ten_windows() -> None:
    window = 16
    cache = WindowedAttentionKVCache(window)
    sizes = []
    for step in range(10 * window):
        cache.write_token(*random_kv(1, step))
        mx.eval(cache.state)
        sizes.append(cache.nbytes)
    bound = 2 * window * H * D * 4 * 2
    assert max(sizes) <= bound
    # Compaction happens about once per window of tokens, not per token.
    assert cache.allocations <= 10 * window // (window + 1) + 2
    assert cache.offset == 10 * window and cache.held <= 2 * window


def test_long_prefill_then_decode_shrinks_storage() -> None:
    cache = WindowedAttentionKVCache(4)
    keys, _ = cache.update_and_fetch(*random_kv(100, 0))
    assert keys.shape[2] == 100 and cache.capacity == 100
    keys, _ = cache.update_and_fetch(*random_kv(1, 1))
    assert keys.shape[2] == 4 and cache.capacity == 8


def test_full_context_mask_after_drop_raises() -> None:
    cache = WindowedAttentionKVCache(4)
    cache.update_and_fetch(*random_kv(3, 0))
    assert cache.make_mask(2) == "causal"  # nothing dropped yet: full context is served
    cache.update_and_fetch(*random_kv(1, 1))
    assert cache.has_dropped_history is False
    for n in (1, 3):
        with pytest.raises(RuntimeError) as info:
            cache.make_mask(n)
        assert str(info.value) == FULL_CONTEXT_ERROR
        assert isinstance(info.value, CacheStateError)
    with pytest.raises(CacheStateError, match="wider window_size=5"):
        cache.make_mask(1, window_size=5)
    assert cache.make_mask(1, window_size=4) is None
    narrower = cache.make_mask(1, window_size=2)
    assert isinstance(narrower, mx.array) and narrower.tolist() == [[False, False, True, True]]


def test_oversized_first_chunk_drops_history_for_the_next_query() -> None:
    cache = WindowedAttentionKVCache(4)
    cache.update_and_fetch(*random_kv(10, 0))
    with pytest.raises(CacheStateError):
        cache.make_mask(1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_window_must_be_positive(bad: Any) -> None:
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        WindowedAttentionKVCache(bad)


def test_protocols_errors_and_trim() -> None:
    cache = WindowedAttentionKVCache(4)
    assert isinstance(cache, KVCache) and isinstance(cache, DecodeKVCache)
    assert cache.empty() and cache.state == () and cache.nbytes == 0
    with pytest.raises(CacheStateError, match="holds no data"):
        cache.get_kv()
    cache.update_and_fetch(*random_kv(6, 0))
    with pytest.raises(ShapeMismatchError):
        cache.update_and_fetch(mx.zeros((1, H, 1, D + 1)), mx.zeros((1, H, 1, D + 1)))
    for step in range(3):
        cache.write_token(*random_kv(1, step))
    # The 9th token compacted the buffers to the 3 visible old tokens plus itself.
    assert (cache.offset, cache.held) == (9, 4)
    with pytest.raises(CacheStateError, match="cannot trim 10 tokens"):
        cache.trim(10)
    assert cache.trim(1) == 1 and cache.offset == 8
    # A query at 7 would need positions 4..6, but position 4 is gone.
    with pytest.raises(CacheStateError, match="no longer stored"):
        cache.trim(1)
    assert cache.offset == 8
    with pytest.raises(CacheStateError, match="holds only the last"):
        cache.get_kv(6)


def test_chained_lazy_graphs_across_compaction() -> None:
    window, steps = 4, 20
    cache = WindowedAttentionKVCache(window)
    all_k, all_v, outs, queries = [], [], [], []
    for step in range(steps):  # nothing is evaluated: each graph spans compactions
        k, v = random_kv(1, step)
        q = mx.random.normal((1, H, 1, D), key=mx.random.key(100 + step))
        mask = cache.make_mask(1, window_size=window)
        ck, cv = cache.update_and_fetch(k, v)
        outs.append(mx.fast.scaled_dot_product_attention(q, ck, cv, scale=1.0, mask=mask))
        all_k.append(k)
        all_v.append(v)
        queries.append(q)
    assert cache.allocations >= 3
    keys, values = mx.concatenate(all_k, axis=2), mx.concatenate(all_v, axis=2)
    for step, out in enumerate(outs):
        band = make_attention_mask(1, step, window_size=window)
        ref = mx.fast.scaled_dot_product_attention(
            queries[step], keys[:, :, : step + 1], values[:, :, : step + 1], scale=1.0, mask=band
        )
        assert mx.allclose(out, ref, atol=1e-5).item()


def test_state_roundtrip_keeps_absolute_offset() -> None:
    src = WindowedAttentionKVCache(3)
    src.update_and_fetch(*random_kv(9, 0))
    src.write_token(*random_kv(1, 1))
    copy = WindowedAttentionKVCache(3)
    copy.state = src.state
    assert copy.offset == 10 and copy.held == src.held
    k, v = random_kv(2, 2)
    assert mx.array_equal(copy.update_and_fetch(k, v)[0], src.update_and_fetch(k, v)[0]).item()
    with pytest.raises(CacheStateError, match="fewer than"):
        copy.state = (mx.zeros((1, H, 1, D)), mx.zeros((1, H, 1, D)), 10)
    assert copy.offset == 12
    src.reset()
    assert src.offset == 0 and src.empty() and src.capacity == 0
