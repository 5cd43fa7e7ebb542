"""Quantized pages in HybridKVPool: stored form, reads, sizing in real bytes, refusals, forks.

The oracle for every read is ``mx.dequantize(mx.quantize(x))`` of what was last written at
that position (quantization is per token and head, so a position's stored form depends on
its own row only); the oracle for every byte count is the ``nbytes`` of the arrays the pool
really holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_pool import HybridKVPool, required_bytes
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVBuffer,
    KVQuantization,
    LayerKind,
    LayerSpec,
    LayoutError,
    QuantizedKV,
    stored_arrays,
)

HEADS, DIM = 2, 64


def layout(dtype: mx.Dtype = mx.float32, window: int = 6) -> CacheLayout:
    """gpt-oss-like: sliding layers 0 and 2, full layers 1 and 3."""
    return CacheLayout(
        [
            LayerSpec(
                layer_id=i,
                kind=LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL,
                window=window if i % 2 == 0 else None,
                n_kv_heads=HEADS,
                head_dim=DIM,
                dtype=dtype,
            )
            for i in range(4)
        ]
    )


def fake_quantized(x: mx.array, quant: KVQuantization | None) -> np.ndarray:
    if quant is not None:
        w, s, b = mx.quantize(x, group_size=quant.group_size, bits=quant.bits)
        x = mx.dequantize(w, s, b, group_size=quant.group_size, bits=quant.bits)
    return np.array(x.astype(mx.float32))


def stored_nbytes(buffer: KVBuffer) -> int:
    return buffer.nbytes


def test_buffers_are_quantized_in_the_chosen_sub_pools_only() -> None:
    q8 = KVQuantization(bits=8, group_size=32)
    pool = HybridKVPool(layout(), num_pages=8, page_size=4, kv_quantization={"full": q8})
    assert pool.kv_quantization(1) == q8 and pool.kv_quantization(3) == q8
    assert pool.kv_quantization(0) is None and pool.kv_quantization(2) is None
    assert isinstance(pool.get_key_buffer(1), QuantizedKV)
    assert isinstance(pool.get_value_buffer(3), QuantizedKV)
    assert isinstance(pool.get_key_buffer(0), mx.array)
    assert pool.get_key_buffer(1).shape == pool.get_key_buffer(0).shape == (HEADS, 32, DIM)
    report = {s.name: s.kv_bits for s in pool.memory_report().sub_pools}
    assert report == {"sliding-w6": None, "full": 8}
    every = HybridKVPool(layout(), num_pages=8, page_size=4, kv_quantization=q8)
    assert all(every.kv_quantization(i) == q8 for i in range(4))


@settings(max_examples=25)
@given(
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64]),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    page_size=st.sampled_from([1, 3, 4]),
    writes=st.lists(
        st.tuples(st.integers(1, 5), st.integers(0, 2**31 - 1)), min_size=1, max_size=6
    ),
)
def test_reads_return_the_dequantized_form_of_the_last_write(
    bits: int,
    group: int,
    dtype: mx.Dtype,
    page_size: int,
    writes: list[tuple[int, int]],
) -> None:
    """Write tokens in chunks (some rewritten), then read every live position of each layer."""
    quant = KVQuantization(bits=bits, group_size=group)
    lay = layout(dtype, window=64)  # the window keeps every written position readable
    pool = HybridKVPool(lay, num_pages=40, page_size=page_size, kv_quantization=quant)
    pool.add_request(0)
    expected: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {i: {} for i in range(4)}
    length = 0
    for n, seed in writes:
        rng = np.random.default_rng(seed)
        # Rewrite the last token now and then (a trimmed speculative token, say).
        start = max(0, length - 1) if seed % 3 == 0 and length else length
        if start + n > length:
            pool.reserve(0, start + n - length)
        length = max(length, start + n)
        for layer in range(4):
            k = mx.array(rng.standard_normal((n, HEADS, DIM)).astype(np.float32)).astype(dtype)
            v = mx.array(rng.standard_normal((n, HEADS, DIM)).astype(np.float32)).astype(dtype)
            pool.set_kv(layer, pool.token_slots(0, layer, start, start + n), k, v)
            fk, fv = fake_quantized(k, quant), fake_quantized(v, quant)
            for t in range(n):
                expected[layer][start + t] = (fk[t], fv[t])
    for layer in range(4):
        keys, values = pool.get_kv(layer, pool.token_slots(0, layer, 0, length))
        assert keys.dtype == values.dtype == dtype and keys.shape == (length, HEADS, DIM)
        want_k = np.stack([expected[layer][p][0] for p in range(length)])
        want_v = np.stack([expected[layer][p][1] for p in range(length)])
        np.testing.assert_array_equal(np.array(keys.astype(mx.float32)), want_k)
        np.testing.assert_array_equal(np.array(values.astype(mx.float32)), want_v)


@pytest.mark.parametrize(
    ("bits", "group", "ratio"), [(8, 32, 1.78), (8, 64, 1.88), (4, 32, 3.2), (4, 64, 3.56)]
)
def test_a_budget_holds_the_real_byte_ratio_more_tokens(
    bits: int, group: int, ratio: float
) -> None:
    lay = layout(mx.float16)
    budget = 4 * 2**20
    quant = KVQuantization(bits=bits, group_size=group)
    plain, packed = (
        HybridKVPool.from_budget(
            lay, budget, max_context=1024, concurrency=8, page_size=16, kv_quantization=q
        )
        for q in (None, quant)
    )
    for pool in (plain, packed):
        report = pool.memory_report()
        assert report.bytes_total <= budget
        # Real bytes: what the buffers hold once evaluated equals what the report counts.
        buffers = [pool.get_key_buffer(i) for i in range(4)] + [
            pool.get_value_buffer(i) for i in range(4)
        ]
        mx.eval([stored_arrays(b) for b in buffers])
        assert sum(stored_nbytes(b) for b in buffers) == report.bytes_total
    tokens = {
        name: sum(s.num_pages * s.page_size for s in pool.memory_report().sub_pools)
        for name, pool in (("plain", plain), ("packed", packed))
    }
    assert tokens["packed"] / tokens["plain"] == pytest.approx(ratio, rel=0.02)
    required = [
        required_bytes(lay, max_context=1024, concurrency=8, page_size=16, kv_quantization=q)
        for q in (None, quant)
    ]
    assert required[1] * ratio == pytest.approx(required[0], rel=0.02)


def test_bad_quantization_arguments_are_refused_before_anything_is_built() -> None:
    q = KVQuantization(bits=8, group_size=128)
    with pytest.raises(LayoutError, match="head_dim 64 is not a multiple of kv_group_size 128"):
        HybridKVPool(layout(), num_pages=4, kv_quantization=q)
    with pytest.raises(LayoutError, match=r"names \['fulll'\], which are neither sub-pools"):
        HybridKVPool(layout(), num_pages=4, kv_quantization={"fulll": KVQuantization(bits=8)})
    with pytest.raises(LayoutError, match="kv_quantization must be"):
        HybridKVPool(layout(), num_pages=4, kv_quantization=8)  # type: ignore[arg-type]


def test_replace_buffers_is_refused_on_a_quantized_layer_and_changes_nothing() -> None:
    pool = HybridKVPool(
        layout(),
        num_pages=4,
        page_size=4,
        kv_quantization={"full": None, "sliding": KVQuantization(bits=4, group_size=32)},
    )
    before = pool.get_key_buffer(0)
    plain = mx.zeros((HEADS, 16, DIM))
    with pytest.raises(CacheStateError, match="4-bit quantized pages, which only set_kv writes"):
        pool.replace_buffers(0, plain, plain)
    assert pool.get_key_buffer(0) is before
    pool.replace_buffers(1, plain, plain)  # the plain sub-pool still takes kernel buffers
    assert pool.get_key_buffer(1) is plain


def test_a_fork_copies_the_stored_tail_page_unchanged() -> None:
    quant = KVQuantization(bits=4, group_size=64)
    pool = HybridKVPool(layout(window=64), num_pages=16, page_size=4, kv_quantization=quant)
    pool.add_request(0)
    pool.reserve(0, 6)
    rng = np.random.default_rng(1)
    for layer in range(4):
        kv = mx.array(rng.standard_normal((6, HEADS, DIM)).astype(np.float32))
        pool.set_kv(layer, pool.token_slots(0, layer, 0, 6), kv, -kv)
    pool.fork_request(0, 1, 6)
    for layer in range(4):
        parent = pool.get_kv(layer, pool.token_slots(0, layer, 0, 6))
        child = pool.get_kv(layer, pool.token_slots(1, layer, 0, 6))
        for a, b in zip(parent, child, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
