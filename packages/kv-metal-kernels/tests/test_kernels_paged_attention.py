"""Paged decode attention against a dense per-request softmax oracle, native against reference."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import (
    NATIVE_BACKENDS,
    CpuPagedAttention,
    NativePagedAttention,
    ReferencePagedAttention,
    backend_available,
    paged_decode_attention,
)
from kv_metal_kernels import _paged_reference as paged_reference
from kv_metal_kernels._native import merge_partials, split_plan
from kv_metal_kernels._paged_reference import window_page_count
from kv_protocol import (
    KernelUnavailableError,
    PagedDecodeAttention,
    RequestStateError,
    ShapeMismatchError,
)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}
GARBAGE = 300.0  # what unreferenced pages, the null page and released pages hold


@dataclass
class Batch:
    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    page_table: mx.array
    seq_lens: mx.array
    page_size: int
    scale: float
    window: int | None
    sinks: mx.array | None
    dtype_name: str


def make_batch(
    rng: np.random.Generator,
    *,
    lens: list[int],
    hkv: int,
    ratio: int,
    d: int,
    page_size: int,
    window: int | None,
    with_sinks: bool,
    dtype_name: str,
    extra_cols: int = 1,
) -> Batch:
    b = len(lens)
    need = [-(-n // page_size) for n in lens]
    max_pages = max(need) + extra_cols
    num_pages = sum(need) + 3
    k = np.full((hkv, num_pages, page_size, d), GARBAGE, np.float32)
    v = np.full((hkv, num_pages, page_size, d), -GARBAGE, np.float32)
    table = np.zeros((b, max_pages), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for i, n in enumerate(lens):
        first_visible = 0 if window is None else max(n - window, 0)
        for col in range(need[i]):
            page = int(free.pop())
            table[i, col] = page
            k[:, page] = rng.standard_normal((hkv, page_size, d))
            v[:, page] = rng.standard_normal((hkv, page_size, d))
            # A sliding layer's pool has released pages wholly before the window.
            if (col + 1) * page_size <= first_visible:
                table[i, col] = 0
    dtype = DTYPES[dtype_name]
    hq = hkv * ratio
    sinks = mx.array(rng.standard_normal(hq).astype(np.float32)) if with_sinks else None
    return Batch(
        q=mx.array(rng.standard_normal((b, hq, 1, d)).astype(np.float32)).astype(dtype),
        k_pool=mx.array(k.reshape(hkv, num_pages * page_size, d)).astype(dtype),
        v_pool=mx.array(v.reshape(hkv, num_pages * page_size, d)).astype(dtype),
        page_table=mx.array(table),
        seq_lens=mx.array(np.array(lens, np.int32)),
        page_size=page_size,
        scale=float(d) ** -0.5,
        window=window,
        sinks=None if sinks is None else sinks.astype(dtype),
        dtype_name=dtype_name,
    )


@st.composite
def batches(draw: st.DrawFn, max_len: int = 70, max_b: int = 6) -> Batch:
    hkv = draw(st.sampled_from([1, 2, 4]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_b))
    return make_batch(
        np.random.default_rng(draw(st.integers(0, 2**31 - 1))),
        lens=lens,
        hkv=hkv,
        ratio=ratio,
        d=draw(st.sampled_from([64, 80, 128])),
        page_size=draw(st.sampled_from([1, 4, 16])),
        window=draw(st.none() | st.integers(1, 40)),
        with_sinks=draw(st.booleans()),
        dtype_name=draw(st.sampled_from(sorted(DTYPES))),
        extra_cols=draw(st.integers(0, 3)),
    )


def dense_oracle(batch: Batch) -> np.ndarray:
    """Per request, per head: softmax over exactly its visible tokens, in float64."""
    q = np.array(batch.q.astype(mx.float32), np.float64)
    k = np.array(batch.k_pool.astype(mx.float32), np.float64)
    v = np.array(batch.v_pool.astype(mx.float32), np.float64)
    table = np.array(batch.page_table)
    sinks = None if batch.sinks is None else np.array(batch.sinks.astype(mx.float32), np.float64)
    b, hq, _, d = q.shape
    ratio = hq // k.shape[0]
    out = np.zeros((b, hq, 1, d))
    ps = batch.page_size
    for i, n in enumerate(np.array(batch.seq_lens).tolist()):
        first = 0 if batch.window is None else max(n - batch.window, 0)
        slots = [int(table[i, p // ps]) * ps + p % ps for p in range(first, n)]
        for h in range(hq):
            keys = k[h // ratio, slots]
            scores = batch.scale * keys @ q[i, h, 0]
            top = scores.max() if sinks is None else max(scores.max(), sinks[h])
            weights = np.exp(scores - top)
            denom = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[i, h, 0] = weights @ v[h // ratio, slots] / denom
    return out


def run(kernel: PagedDecodeAttention, batch: Batch) -> mx.array:
    return kernel(
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


def f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


@settings(max_examples=60)
@given(batches())
def test_reference_matches_dense_softmax(batch: Batch) -> None:
    kernels = (
        ReferencePagedAttention(),
        ReferencePagedAttention(buckets=0),
        ReferencePagedAttention(unfused_softmax=True),
        ReferencePagedAttention(unfused_softmax=False),
    )
    for kernel in kernels:
        out = run(kernel, batch)
        assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
        tol = TOL[batch.dtype_name]
        np.testing.assert_allclose(f32(out), dense_oracle(batch), atol=tol, rtol=tol)


needs_cpu_kernel = pytest.mark.skipif(
    CpuPagedAttention().library.handle is None or mx.default_device().type != mx.cpu,
    reason="the CPU paged attention kernel does not build here",
)


@needs_cpu_kernel
@settings(max_examples=60, deadline=None)
@given(batches(max_len=90))
def test_cpu_kernel_matches_dense_softmax_and_the_reference(batch: Batch) -> None:
    """float32 through the C kernel; float16 / bfloat16 handed to the reference."""
    out = run(CpuPagedAttention(), batch)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    tol = TOL[batch.dtype_name]
    np.testing.assert_allclose(f32(out), dense_oracle(batch), atol=tol, rtol=tol)
    reference = run(ReferencePagedAttention(), batch)
    if batch.dtype_name == "float32":
        np.testing.assert_allclose(f32(out), f32(reference), atol=2e-6, rtol=2e-6)
    else:
        assert mx.array_equal(out, reference)


@needs_cpu_kernel
@settings(max_examples=25, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 4]),
    ratio=st.sampled_from([1, 4, 8]),
    window=st.none() | st.integers(1, 40),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cpu_kernel_rows_together_equal_rows_alone_bit_for_bit(
    hkv: int, ratio: int, window: int | None, sinks: bool, seed: int
) -> None:
    """Many rows (a kv head's query heads read each key once together) against one row at
    a time (one query head per work item where the items are few): the same bits."""
    rng = np.random.default_rng(seed)
    lens = [int(n) for n in rng.integers(1, 120, size=8)]
    batch = make_batch(
        rng,
        lens=lens,
        hkv=hkv,
        ratio=ratio,
        d=64,
        page_size=16,
        window=window,
        with_sinks=sinks,
        dtype_name="float32",
    )
    kernel = CpuPagedAttention()
    together = run(kernel, batch)
    for row in range(len(lens)):
        alone = kernel(
            batch.q[row : row + 1],
            batch.k_pool,
            batch.v_pool,
            batch.page_table[row : row + 1],
            batch.seq_lens[row : row + 1],
            page_size=batch.page_size,
            scale=batch.scale,
            window=batch.window,
            sinks=batch.sinks,
        )
        assert mx.array_equal(alone, together[row : row + 1]).item()


@needs_cpu_kernel
def test_cpu_kernel_checks_index_values_before_reading() -> None:
    args = _args()
    kernel = CpuPagedAttention()
    args["page_table"] = mx.array([[4, 0, 0], [1, 0, 0]], dtype=mx.int32)  # page 4 of 0 .. 3
    with pytest.raises(RequestStateError, match=r"entries must lie in 0 \.\. 3"):
        kernel(**args)  # type: ignore[arg-type]
    args["page_table"] = mx.array([[1, 0, 0], [2, 0, 0]], dtype=mx.int32)
    args["seq_lens"] = mx.array([1, 25], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="needs more pages"):
        kernel(**args)  # type: ignore[arg-type]
    args["seq_lens"] = mx.array([0, 2], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="seq_lens must be >= 1"):
        CpuPagedAttention(validate=True)(**args)  # type: ignore[arg-type]
    assert isinstance(kernel, PagedDecodeAttention) and kernel.name == "cpu"


def test_bucketed_calls_equal_one_call_on_a_ragged_batch() -> None:
    rng = np.random.default_rng(3)
    lens = [5, 300, 17, 290, 33, 250, 9, 260, 120, 8, 270, 40]
    batch = make_batch(
        rng,
        lens=lens,
        hkv=2,
        ratio=4,
        d=64,
        page_size=16,
        window=None,
        with_sinks=True,
        dtype_name="float32",
    )
    bucketed = run(ReferencePagedAttention(buckets=4), batch)
    single = run(ReferencePagedAttention(buckets=0), batch)
    np.testing.assert_allclose(f32(bucketed), f32(single), atol=1e-6)
    np.testing.assert_allclose(f32(bucketed), dense_oracle(batch), atol=2e-5)


def test_sliding_layer_groups_rows_shorter_than_the_window_apart() -> None:
    """Short rows of a sliding layer are attended apart from rows that read the whole span.

    Before, a sliding layer was always one call in which every row gathered the window's
    span of pages; now rows shorter than the window form groups that read only their own.
    """
    rng = np.random.default_rng(11)
    lens = [6, 9, 14, 1000, 20, 130, 17, 870, 12, 150, 8, 1130, 25, 160, 10, 1250]
    batch = make_batch(
        rng,
        lens=lens,
        hkv=1,
        ratio=4,
        d=128,
        page_size=16,
        window=512,
        with_sinks=False,
        dtype_name="float32",
    )
    plan = paged_reference._plan_buckets(
        batch.seq_lens, 16, batch.page_table.shape[1], 512, 4, row_work=4 * 128
    )
    assert plan.inverse is not None and len(plan.groups) >= 2
    span = window_page_count(512, 16)
    read = sum(len(np.array(g.rows)) * min(g.n_cols, span) for g in plan.groups)
    assert read <= 0.75 * len(lens) * span
    bucketed = run(ReferencePagedAttention(buckets=4), batch)
    single = run(ReferencePagedAttention(buckets=0), batch)
    np.testing.assert_allclose(f32(bucketed), f32(single), atol=1e-6)
    np.testing.assert_allclose(f32(bucketed), dense_oracle(batch), atol=2e-5)


def test_sliding_layer_reads_only_the_window_pages() -> None:
    """Pages before the window are released (null page 0 holds garbage) and not read."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng,
        lens=[1000, 37, 129],
        hkv=1,
        ratio=2,
        d=64,
        page_size=16,
        window=128,
        with_sinks=False,
        dtype_name="float32",
    )
    table = np.array(batch.page_table)
    assert (table[0, : (1000 - 128) // 16] == 0).all()
    out = run(ReferencePagedAttention(), batch)
    np.testing.assert_allclose(f32(out), dense_oracle(batch), atol=2e-5)
    assert window_page_count(128, 16) == 9


def test_functional_form_and_auto_backend() -> None:
    batch = make_batch(
        np.random.default_rng(5),
        lens=[3, 20],
        hkv=2,
        ratio=2,
        d=64,
        page_size=4,
        window=8,
        with_sinks=True,
        dtype_name="float32",
    )
    out = paged_decode_attention(
        batch.q,
        batch.k_pool,
        batch.v_pool,
        batch.page_table,
        batch.seq_lens,
        page_size=batch.page_size,
        scale=batch.scale,
        window=batch.window,
        sinks=batch.sinks,
        backend="auto",
    )
    np.testing.assert_allclose(f32(out), dense_oracle(batch), atol=5e-4)


def _args() -> dict[str, object]:
    return {
        "q": mx.zeros((2, 4, 1, 64)),
        "k_pool": mx.zeros((2, 32, 64)),
        "v_pool": mx.zeros((2, 32, 64)),
        "page_table": mx.zeros((2, 3), dtype=mx.int32),
        "seq_lens": mx.array([1, 2], dtype=mx.int32),
        "page_size": 8,
        "scale": 0.125,
    }


BAD = [
    ("q", mx.zeros((2, 4, 2, 64)), "for decode"),
    ("k_pool", mx.zeros((2, 32, 32)), "does not match q head_dim"),
    ("v_pool", mx.zeros((2, 16, 64)), "same shape"),
    ("q", mx.zeros((2, 3, 1, 64)), "multiple of kv heads"),
    ("q", mx.zeros((2, 4, 1, 64), dtype=mx.float16), "share one dtype"),
    ("page_table", mx.zeros((3, 3), dtype=mx.int32), "page_table must be"),
    ("page_table", mx.zeros((2, 3), dtype=mx.int64), "page_table must be int32"),
    ("seq_lens", mx.array([1, 2, 3], dtype=mx.int32), "one entry per request"),
    ("seq_lens", mx.array([1.0, 2.0]), "seq_lens must be int32"),
    ("page_size", 5, "whole number of pages"),
    ("page_size", 0, "page_size must be an int >= 1"),
    ("window", 0, "window must be None or an int >= 1"),
    ("sinks", mx.zeros((2,)), "one logit per query head"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD)
def test_bad_inputs_raise(name: str, value: object, message: str) -> None:
    args = _args()
    args[name] = value
    if name == "k_pool":
        args["v_pool"] = value
    for kernel in (ReferencePagedAttention(), CpuPagedAttention()):
        with pytest.raises(ShapeMismatchError, match=message):
            kernel(**args)  # type: ignore[arg-type]


def test_validate_mode_checks_index_values() -> None:
    kernel = ReferencePagedAttention(validate=True)
    args = _args()
    args["seq_lens"] = mx.array([0, 2], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="seq_lens must be >= 1"):
        kernel(**args)  # type: ignore[arg-type]
    args["seq_lens"] = mx.array([1, 25], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="needs more pages"):
        kernel(**args)  # type: ignore[arg-type]
    args["seq_lens"] = mx.array([1, 2], dtype=mx.int32)
    args["page_table"] = mx.array([[4, 0, 0], [1, 0, 0]], dtype=mx.int32)
    with pytest.raises(RequestStateError, match=r"entries must lie in 0 \.\. 3"):
        kernel(**args)  # type: ignore[arg-type]


def test_reference_satisfies_the_protocol() -> None:
    assert isinstance(ReferencePagedAttention(), PagedDecodeAttention)
    with pytest.raises(ShapeMismatchError):
        ReferencePagedAttention(buckets=-1)
    with pytest.raises(ShapeMismatchError, match="unfused_softmax"):
        ReferencePagedAttention(unfused_softmax=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_native_attention_unavailable_is_a_clear_error(backend: str) -> None:
    if backend_available(backend):
        pytest.skip(f"{backend} is available on this machine")
    with pytest.raises(KernelUnavailableError, match="is not available"):
        NativePagedAttention(backend)


def native_params() -> list[object]:
    """One parameter per native backend, skipped with the reason where this machine lacks it."""
    return [
        pytest.param(
            b,
            marks=pytest.mark.skipif(
                not backend_available(b), reason=f"no {b} back-end in this MLX build / machine"
            ),
        )
        for b in NATIVE_BACKENDS
    ]


@pytest.mark.parametrize("backend", native_params())
@settings(max_examples=50)
@given(batch=batches(max_len=300, max_b=8))
def test_native_matches_reference_and_dense(backend: str, batch: Batch) -> None:
    got = run(NativePagedAttention(backend), batch)
    want = run(ReferencePagedAttention(), batch)
    tol = TOL[batch.dtype_name]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(f32(got), f32(want), atol=2 * tol, rtol=2 * tol)
    np.testing.assert_allclose(f32(got), dense_oracle(batch), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("backend", native_params())
@pytest.mark.parametrize("d", [64, 128, 256])
def test_native_long_context_gqa(backend: str, d: int) -> None:
    rng = np.random.default_rng(d)
    batch = make_batch(
        rng,
        lens=[4096, 1, 2500, 777],
        hkv=8,
        ratio=8 if d == 64 else 4,
        d=d,
        page_size=16,
        window=None,
        with_sinks=d == 64,
        dtype_name="bfloat16",
    )
    got = run(NativePagedAttention(backend), batch)
    want = run(ReferencePagedAttention(), batch)
    np.testing.assert_allclose(f32(got), f32(want), atol=3e-2, rtol=3e-2)
    batch.window = 128
    got = run(NativePagedAttention(backend), batch)
    want = run(ReferencePagedAttention(), batch)
    np.testing.assert_allclose(f32(got), f32(want), atol=3e-2, rtol=3e-2)


def test_split_plan_covers_every_key() -> None:
    for blocks in (1, 8, 64, 4096):
        for bound in (1, 100, 128, 4096, 100_000):
            splits, chunk = split_plan(blocks, bound)
            assert splits >= 1 and splits * chunk >= bound
            assert splits == 1 or chunk >= 128
    assert split_plan(8, 16384)[0] > 1  # few blocks, long context: split
    assert split_plan(4096, 16384)[0] == 1  # a full launch already


@given(st.integers(1, 5), st.integers(1, 4), st.booleans(), st.integers(0, 2**31 - 1))
def test_merge_partials_equals_one_softmax(splits: int, hq: int, sinks: bool, seed: int) -> None:
    """Cutting the keys into ranges and merging their states is one softmax over all keys."""
    rng = np.random.default_rng(seed)
    b, d, n = 2, 8, 13
    scores = rng.standard_normal((b, hq, n)) * 3
    values = rng.standard_normal((b, hq, n, d))
    sink = rng.standard_normal(hq) if sinks else None
    bounds = np.linspace(0, n, splits + 1).astype(int)
    part_m = np.full((b, splits, hq), -np.inf)
    part_l = np.zeros((b, splits, hq))
    part_acc = np.zeros((b, splits, hq, d))
    for s in range(splits):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            top = scores[..., lo:hi].max(axis=-1)
            w = np.exp(scores[..., lo:hi] - top[..., None])
            part_m[:, s], part_l[:, s] = top, w.sum(axis=-1)
            part_acc[:, s] = np.einsum("bhn,bhnd->bhd", w, values[:, :, lo:hi])
    got = merge_partials(
        mx.array(part_m.astype(np.float32)),
        mx.array(part_l.astype(np.float32)),
        mx.array(part_acc.astype(np.float32)),
        None if sink is None else mx.array(sink.astype(np.float32)),
    )
    logits = (
        scores
        if sink is None
        else np.concatenate([scores, np.broadcast_to(sink[None, :, None], (b, hq, 1))], axis=-1)
    )
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    want = np.einsum("bhn,bhnd->bhd", p[..., :n], values)
    np.testing.assert_allclose(np.array(got), want, atol=1e-5)
