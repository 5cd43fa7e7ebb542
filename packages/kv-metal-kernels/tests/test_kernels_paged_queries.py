"""Several consecutive queries per request (a speculative verification) against a dense oracle.

``ReferencePagedAttention.attend_queries`` gathers each request's pages once for all its
queries; query ``l`` of request ``b`` sits at position ``seq_lens[b] - L + l`` and must see
exactly the keys a decode query at that position sees. The oracle is a float64 softmax over
those positions, read through the page table by hand.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_paged_attention import DTYPES, TOL, Batch, f32, make_batch, run

from kv_metal_kernels import CpuPagedAttention, NativePagedAttention, ReferencePagedAttention
from kv_metal_kernels import _paged_reference as paged_reference
from kv_protocol import KVQuantization, PagedQueryAttention, ShapeMismatchError

KERNELS: tuple[ReferencePagedAttention | CpuPagedAttention, ...] = (
    ReferencePagedAttention(),
    ReferencePagedAttention(buckets=0),
    ReferencePagedAttention(unfused_softmax=True),
    ReferencePagedAttention(unfused_softmax=False),
    CpuPagedAttention(),  # the reference's call where its C kernel does not build
)


def with_queries(rng: np.random.Generator, batch: Batch, queries: int, window: int | None) -> Batch:
    """``batch`` with ``queries`` queries per request, its window, pages before it released."""
    b, hq, _, d = batch.q.shape
    q = rng.standard_normal((b, hq, queries, d)).astype(np.float32)
    table = np.array(batch.page_table)
    if window is not None:
        for i, n in enumerate(np.array(batch.seq_lens).tolist()):
            # The earliest query (position n - queries) sees from n - queries - window + 1.
            first = max(n - queries - window + 1, 0)
            for col in range(table.shape[1]):
                if (col + 1) * batch.page_size <= first:
                    table[i, col] = 0
    return replace(
        batch,
        q=mx.array(q).astype(batch.q.dtype),
        page_table=mx.array(table),
        window=window,
    )


@st.composite
def query_batches(draw: st.DrawFn) -> Batch:
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    batch = make_batch(
        rng,
        lens=draw(st.lists(st.integers(1, 60), min_size=1, max_size=5)),
        hkv=draw(st.sampled_from([1, 2])),
        ratio=draw(st.sampled_from([1, 2, 4])),
        d=draw(st.sampled_from([64, 80])),
        page_size=draw(st.sampled_from([1, 4, 16])),
        window=None,
        with_sinks=draw(st.booleans()),
        dtype_name=draw(st.sampled_from(sorted(DTYPES))),
        extra_cols=draw(st.integers(0, 2)),
    )
    queries = draw(st.integers(1, 6))
    return with_queries(rng, batch, queries, draw(st.none() | st.integers(1, 30)))


def dense_queries_oracle(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Float64 outputs of every query, and which queries are real (position >= 0)."""
    q = np.array(batch.q.astype(mx.float32), np.float64)
    k = np.array(batch.k_pool.astype(mx.float32), np.float64)
    v = np.array(batch.v_pool.astype(mx.float32), np.float64)
    table = np.array(batch.page_table)
    sinks = None if batch.sinks is None else np.array(batch.sinks.astype(mx.float32), np.float64)
    b, hq, n_queries, d = q.shape
    ratio = hq // k.shape[0]
    out = np.zeros((b, hq, n_queries, d))
    real = np.zeros((b, hq, n_queries, d), bool)
    ps = batch.page_size
    for i, n in enumerate(np.array(batch.seq_lens).tolist()):
        for query in range(n_queries):
            position = n - n_queries + query
            if position < 0:
                continue
            real[i, :, query] = True
            first = 0 if batch.window is None else max(position - batch.window + 1, 0)
            slots = [int(table[i, p // ps]) * ps + p % ps for p in range(first, position + 1)]
            for h in range(hq):
                scores = batch.scale * k[h // ratio, slots] @ q[i, h, query]
                top = scores.max() if sinks is None else max(scores.max(), sinks[h])
                weights = np.exp(scores - top)
                denom = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                out[i, h, query] = weights @ v[h // ratio, slots] / denom
    return out, real


def attend(kernel: ReferencePagedAttention | CpuPagedAttention, batch: Batch) -> mx.array:
    return kernel.attend_queries(
        batch.q,
        batch.k_pool,
        batch.v_pool,
        batch.page_table,
        batch.seq_lens,
        page_size=batch.page_size,
        scale=batch.scale,
        window=batch.window,
        sinks=batch.sinks,
    )


@settings(max_examples=60, deadline=None)
@given(query_batches())
def test_queries_match_the_dense_softmax_at_their_own_positions(batch: Batch) -> None:
    expected, real = dense_queries_oracle(batch)
    tol = TOL[batch.dtype_name]
    for kernel in KERNELS:
        out = attend(kernel, batch)
        assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
        np.testing.assert_allclose(f32(out)[real], expected[real], atol=tol, rtol=tol)


def test_one_query_is_the_decode_call() -> None:
    rng = np.random.default_rng(5)
    batch = make_batch(
        rng,
        lens=[3, 40, 17, 64],
        hkv=2,
        ratio=4,
        d=64,
        page_size=16,
        window=20,
        with_sinks=True,
        dtype_name="float32",
    )
    for kernel in KERNELS:
        np.testing.assert_array_equal(f32(attend(kernel, batch)), f32(run(kernel, batch)))


def test_queries_equal_one_row_per_query() -> None:
    """The rows a verification would otherwise take, each with its own length, agree."""
    rng = np.random.default_rng(11)
    base = make_batch(
        rng,
        lens=[9, 300, 41, 128],
        hkv=1,
        ratio=4,
        d=128,
        page_size=16,
        window=None,
        with_sinks=False,
        dtype_name="float32",
    )
    for window in (None, 32):
        batch = with_queries(rng, base, 5, window)
        grid = attend(ReferencePagedAttention(), batch)
        lens = np.array(batch.seq_lens).tolist()
        rows = replace(
            batch,
            q=batch.q.transpose(0, 2, 1, 3).reshape(-1, batch.q.shape[1], 1, batch.q.shape[3]),
            page_table=mx.repeat(batch.page_table, 5, axis=0),
            seq_lens=mx.array([n - 5 + 1 + i for n in lens for i in range(5)], dtype=mx.int32),
        )
        flat = run(ReferencePagedAttention(), rows).reshape(4, 5, *batch.q.shape[1:2], -1)
        np.testing.assert_allclose(f32(grid), f32(flat.transpose(0, 2, 1, 3)), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pages_read_as_their_dequantized_values(bits: int) -> None:
    rng = np.random.default_rng(bits)
    batch = with_queries(
        rng,
        make_batch(
            rng,
            lens=[12, 70, 33],
            hkv=2,
            ratio=2,
            d=64,
            page_size=16,
            window=None,
            with_sinks=False,
            dtype_name="float32",
        ),
        4,
        24,
    )
    quant = KVQuantization(bits=bits, group_size=32)
    k, v = quant.quantize(batch.k_pool), quant.quantize(batch.v_pool)
    stored = replace(batch, k_pool=cast(mx.array, k), v_pool=cast(mx.array, v))
    dense = replace(batch, k_pool=k.dequantize(), v_pool=v.dequantize())
    expected, real = dense_queries_oracle(dense)
    for kernel in (ReferencePagedAttention(), CpuPagedAttention()):
        out = attend(kernel, stored)
        np.testing.assert_allclose(f32(out)[real], expected[real], atol=2e-5, rtol=2e-5)


def test_query_shapes_are_checked() -> None:
    rng = np.random.default_rng(0)
    batch = make_batch(
        rng,
        lens=[5, 9],
        hkv=1,
        ratio=2,
        d=64,
        page_size=4,
        window=None,
        with_sinks=False,
        dtype_name="float32",
    )
    kernel = ReferencePagedAttention()
    with pytest.raises(ShapeMismatchError, match="at least one query"):
        attend(kernel, replace(batch, q=mx.zeros((2, 2, 0, 64))))
    with pytest.raises(ShapeMismatchError, match="queries, head_dim"):
        attend(kernel, replace(batch, q=mx.zeros((2, 2, 64))))
    with pytest.raises(ShapeMismatchError, match=r"\(batch, q_heads, 1, head_dim\)"):
        run(kernel, replace(batch, q=mx.zeros((2, 2, 3, 64))))


def test_which_kernels_take_several_queries() -> None:
    assert isinstance(ReferencePagedAttention(), PagedQueryAttention)
    assert isinstance(CpuPagedAttention(), PagedQueryAttention)
    # The native kernels read pages in place: one row per query costs them no extra gather.
    assert not hasattr(NativePagedAttention, "attend_queries")


def test_sliding_queries_of_short_and_long_rows_in_groups() -> None:
    """Several queries per row on a sliding layer, short rows grouped apart from long ones."""
    rng = np.random.default_rng(21)
    lens = [7, 12, 30, 700, 18, 140, 9, 650, 11, 160, 25, 900, 16, 170, 13, 820]
    base = make_batch(
        rng,
        lens=lens,
        hkv=1,
        ratio=4,
        d=128,
        page_size=16,
        window=None,
        with_sinks=True,
        dtype_name="float32",
    )
    batch = with_queries(rng, base, 4, 256)
    plan = paged_reference._plan_buckets(
        batch.seq_lens, 16, batch.page_table.shape[1], 256, 4, row_work=4 * 4 * 128, queries=4
    )
    assert plan.inverse is not None and len(plan.groups) >= 2
    expected, real = dense_queries_oracle(batch)
    grouped = attend(ReferencePagedAttention(buckets=4), batch)
    single = attend(ReferencePagedAttention(buckets=0), batch)
    np.testing.assert_allclose(f32(grouped), f32(single), atol=1e-6)
    np.testing.assert_allclose(f32(grouped)[real], expected[real], atol=2e-5, rtol=2e-5)
