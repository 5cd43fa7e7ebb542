"""Paged decode attention over quantized pools: the dense softmax oracle on the dequantized pool.

The pools are stored in ``mx.quantize``'s affine form (:class:`kv_protocol.QuantizedKV`); the
oracle attends, in float64, over exactly what those pages dequantize to, so the test checks
the gather of the stored arrays, the dequantization after it, and the same masking, windows
and sinks as for plain pools.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_paged_attention import (
    TOL,
    Batch,
    dense_oracle,
    f32,
    make_batch,
    native_params,
    run,
)

from kv_metal_kernels import NativePagedAttention, ReferencePagedAttention
from kv_protocol import KVQuantization, QuantizedKV, ShapeMismatchError


def quantized(batch: Batch, quant: KVQuantization) -> tuple[Batch, Batch]:
    """The batch with quantized pools, and the same batch with the pools they dequantize to."""
    assert isinstance(batch.k_pool, mx.array) and isinstance(batch.v_pool, mx.array)
    k, v = quant.quantize(batch.k_pool), quant.quantize(batch.v_pool)
    stored = replace(batch, k_pool=k, v_pool=v)  # type: ignore[arg-type]
    dense = replace(batch, k_pool=k.dequantize(), v_pool=v.dequantize())
    return stored, dense


@st.composite
def quantized_batches(draw: st.DrawFn) -> tuple[Batch, Batch]:
    quant = KVQuantization(
        bits=draw(st.sampled_from([4, 8])), group_size=draw(st.sampled_from([32, 64]))
    )
    batch = make_batch(
        np.random.default_rng(draw(st.integers(0, 2**31 - 1))),
        lens=draw(st.lists(st.integers(1, 70), min_size=1, max_size=5)),
        hkv=draw(st.sampled_from([1, 2])),
        ratio=draw(st.sampled_from([1, 4])),
        d=draw(st.sampled_from([64, 128])),
        page_size=draw(st.sampled_from([1, 4, 16])),
        window=draw(st.none() | st.integers(1, 40)),
        with_sinks=draw(st.booleans()),
        dtype_name=draw(st.sampled_from(["float32", "bfloat16"])),
        extra_cols=draw(st.integers(0, 2)),
    )
    return quantized(batch, quant)


@settings(max_examples=40)
@given(quantized_batches())
def test_reference_on_quantized_pages_matches_softmax_over_dequantized_pages(
    pair: tuple[Batch, Batch],
) -> None:
    stored, dense = pair
    want = dense_oracle(dense)
    for kernel in (ReferencePagedAttention(), ReferencePagedAttention(buckets=0)):
        out = run(kernel, stored)
        assert out.shape == stored.q.shape and out.dtype == stored.q.dtype
        tol = TOL[stored.dtype_name]
        np.testing.assert_allclose(f32(out), want, atol=tol, rtol=tol)


def test_quantized_read_is_the_plain_read_of_the_dequantized_pool() -> None:
    """Same gathered values, same SDPA: quantized and dequantized pools give equal outputs."""
    batch = make_batch(
        np.random.default_rng(7),
        lens=[3, 40, 17],
        hkv=2,
        ratio=2,
        d=64,
        page_size=4,
        window=9,
        with_sinks=True,
        dtype_name="float32",
    )
    stored, dense = quantized(batch, KVQuantization(bits=4, group_size=32))
    kernel = ReferencePagedAttention(buckets=0)
    np.testing.assert_array_equal(f32(run(kernel, stored)), f32(run(kernel, dense)))
    # And the quantization is real: the plain pool gives another answer.
    assert not np.array_equal(f32(run(kernel, stored)), f32(run(kernel, batch)))


def test_mismatched_quantized_arrays_are_refused() -> None:
    batch = make_batch(
        np.random.default_rng(8),
        lens=[5],
        hkv=1,
        ratio=1,
        d=64,
        page_size=4,
        window=None,
        with_sinks=False,
        dtype_name="float32",
    )
    stored, _ = quantized(batch, KVQuantization(bits=8, group_size=64))
    k = stored.k_pool
    assert isinstance(k, QuantizedKV)
    broken = QuantizedKV(
        data=k.data, scales=k.scales[:, :-1], biases=k.biases, quantization=k.quantization
    )
    with pytest.raises(ShapeMismatchError, match="share their leading axes"):
        run(ReferencePagedAttention(), replace(stored, k_pool=broken))  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (4, 32)])
@pytest.mark.parametrize("backend", native_params())
def test_native_quantized_kernel_matches_softmax_over_dequantized_pages(
    backend: str, bits: int, group: int, window: int | None
) -> None:
    """The native kernel unpacks the pages itself; the oracle reads what they dequantize to."""
    batch = make_batch(
        np.random.default_rng(9),
        lens=[1, 33, 70, 300],
        hkv=2,
        ratio=4,
        d=128,
        page_size=16,
        window=window,
        with_sinks=True,
        dtype_name="float32",
    )
    stored, dense = quantized(batch, KVQuantization(bits=bits, group_size=group))
    got = run(NativePagedAttention(backend), stored)
    np.testing.assert_allclose(f32(got), dense_oracle(dense), atol=5e-5, rtol=5e-5)
    bf16, bf16_dense = quantized(
        replace(
            batch,
            q=batch.q.astype(mx.bfloat16),
            dtype_name="bfloat16",
            k_pool=batch.k_pool.astype(mx.bfloat16),
            v_pool=batch.v_pool.astype(mx.bfloat16),
            sinks=None if batch.sinks is None else batch.sinks.astype(mx.bfloat16),
        ),
        KVQuantization(bits=bits, group_size=group),
    )
    got16 = run(NativePagedAttention(backend), bf16)
    np.testing.assert_allclose(f32(got16), dense_oracle(bf16_dense), atol=3e-2, rtol=3e-2)
