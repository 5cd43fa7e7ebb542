"""QuantizedAttentionKVCache against mlx-lm's QuantizedKVCache."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from kv_caches import QuantizedAttentionKVCache, is_storage_backed, to_contiguous
from kv_protocol import CacheStateError, KVCache, LayoutError, ShapeMismatchError

H = 2


def random_kv(n: int, dim: int, seed: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, H, n, dim), key=k1), mx.random.normal((1, H, n, dim), key=k2)


@settings(max_examples=20)
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64]),
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_matches_mlx_lm_quantized_cache(bits: int, group_size: int, chunks: list[int]) -> None:
    dim = 64
    ours = QuantizedAttentionKVCache(bits=bits, group_size=group_size, max_seq_len=16)
    theirs = QuantizedKVCache(group_size=group_size, bits=bits)
    for step, n in enumerate(chunks):
        k, v = random_kv(n, dim, step)
        q = mx.random.normal((1, 2 * H, n, dim), key=mx.random.key(99 + step))
        mask: Any = ours.make_mask(n)
        assert mask == theirs.make_mask(n, return_array=False, window_size=None)
        ok, ov = ours.update_and_fetch(k, v)
        tk, tv = theirs.update_and_fetch(k, v)
        for a, b in zip(ok + ov, tk + tv, strict=True):
            assert mx.array_equal(a, b).item()
        # mlx-lm's attention takes the quantized path because the cache exposes bits (it
        # scales its query argument in place, so each call gets its own copy).
        out = scaled_dot_product_attention(q * 1, ok, ov, ours, scale=0.125, mask=mask)
        ref = scaled_dot_product_attention(q * 1, tk, tv, theirs, scale=0.125, mask=mask)
        assert mx.allclose(out, ref, atol=1e-5).item()
    assert ours.offset == theirs.offset == sum(chunks)
    assert ours.allocations <= 1 + max(1, sum(chunks) // 16).bit_length()


@pytest.mark.parametrize("bits", [2, 3, 16, True, "4"])
def test_unsupported_bits(bits: Any) -> None:
    with pytest.raises(LayoutError, match=r"bits must be one of \(4, 8\)"):
        QuantizedAttentionKVCache(bits=bits)


@pytest.mark.parametrize("group_size", [16, 48, 256, 0])
def test_unsupported_group_size(group_size: int) -> None:
    with pytest.raises(LayoutError, match=r"group_size must be one of \(32, 64, 128\)"):
        QuantizedAttentionKVCache(group_size=group_size)


def test_head_dims_that_do_not_pack() -> None:
    cache = QuantizedAttentionKVCache(bits=4, group_size=64)
    with pytest.raises(ShapeMismatchError, match="head dimension 32 must be divisible by group"):
        cache.update_and_fetch(*random_kv(2, 32, 0))
    assert cache.empty() and cache.offset == 0 and cache.capacity == 0
    cache.update_and_fetch(*random_kv(2, 128, 0))
    with pytest.raises(ShapeMismatchError):
        cache.update_and_fetch(*random_kv(2, 64, 0))
    with pytest.raises(ShapeMismatchError, match="floating point"):
        QuantizedAttentionKVCache().update_and_fetch(
            mx.zeros((1, H, 1, 64), dtype=mx.int32), mx.zeros((1, H, 1, 64), dtype=mx.int32)
        )
    assert cache.offset == 2


def test_protocol_state_trim_and_conversion() -> None:
    cache = QuantizedAttentionKVCache(bits=8, group_size=32, max_seq_len=4)
    assert isinstance(cache, KVCache) and is_storage_backed(cache)
    assert cache.bits == 8 and cache.group_size == 32 and cache.state == ()
    k, v = random_kv(10, 32, 1)
    cache.update_and_fetch(k, v)
    copy = QuantizedAttentionKVCache(bits=8, group_size=32)
    copy.state = cache.state
    assert copy.offset == 10
    for a, b in zip(copy.state[0], cache.state[0], strict=True):
        assert mx.array_equal(a, b).item()
    dense = to_contiguous(cache)
    assert dense.offset == 10
    # 8-bit affine error is small relative to unit-normal data.
    assert mx.max(mx.abs(dense.get_kv()[0] - k)).item() < 0.05
    assert cache.trim(4) == 4 and cache.offset == 6
    with pytest.raises(CacheStateError):
        cache.trim(7)
    assert cache.nbytes > 0
    with pytest.raises(CacheStateError):
        copy.state = (1, 2)
