"""Prefill attention: the CPU softmax composition against MLX's fused SDPA, every mask kind."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import DensePrefillAttention, select_kernels
from kv_metal_kernels._softmax_cpu import PREFILL_QUERY_BLOCK, block_key_spans
from kv_protocol import PrefillAttention, ShapeMismatchError

MASK_KINDS = ("none", "causal", "keep_ts", "keep_b1ts", "keep_bhts", "additive_ts", "additive_bhts")


def _mask(kind: str, rng: np.random.Generator, b: int, hq: int, t: int, s: int) -> object:
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    shape = {"ts": (t, s), "b1ts": (b, 1, t, s), "bhts": (b, hq, t, s)}[kind.split("_")[1]]
    keep = rng.random(shape) < 0.75
    keep[..., -1] = True  # every query sees at least one key
    if kind.startswith("keep"):
        return mx.array(keep)
    return mx.array(np.where(keep, rng.normal(size=shape) * 0.5, -np.inf).astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 32, 64]),
    t=st.integers(1, 24),
    extra=st.integers(0, 40),
    kind=st.sampled_from(MASK_KINDS),
    sinks=st.booleans(),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cpu_softmax_matches_mlx_fused_attention(
    b: int,
    hkv: int,
    group: int,
    d: int,
    t: int,
    extra: int,
    kind: str,
    sinks: bool,
    dtype: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    hq, s = hkv * group, t + extra
    mdtype = mx.float32 if dtype == "float32" else mx.bfloat16

    def arr(*shape: int) -> mx.array:
        return mx.array(rng.normal(size=shape).astype(np.float32)).astype(mdtype)

    q, keys, values = arr(b, hq, t, d), arr(b, hkv, s, d), arr(b, hkv, s, d)
    mask = _mask(kind, rng, b, hq, t, s)
    if isinstance(mask, mx.array) and mask.dtype == mx.float32:
        mask = mask.astype(mdtype)  # MLX's fused kernel takes an additive mask in q's dtype
    sink_logits = mx.array(rng.normal(size=hq).astype(np.float32)) if sinks else None
    scale = 1 / math.sqrt(d)
    args = {"scale": scale, "mask": mask, "sinks": sink_logits}
    got = DensePrefillAttention(unfused_softmax=True)(q, keys, values, **args)  # type: ignore[arg-type]
    want = DensePrefillAttention(unfused_softmax=False)(q, keys, values, **args)  # type: ignore[arg-type]
    assert got.shape == (b, hq, t, d) and got.dtype == mdtype
    tol = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol
    )


def test_causal_mask_is_aligned_to_the_last_key() -> None:
    """A 3-query chunk after 5 cached keys: query i sees keys 0 .. 5 + i (a float64 oracle)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=shape) for shape in ((1, 1, 3, 4), (1, 1, 8, 4), (1, 1, 8, 4)))
    got = DensePrefillAttention(unfused_softmax=True)(
        mx.array(q.astype(np.float32)),
        mx.array(k.astype(np.float32)),
        mx.array(v.astype(np.float32)),
        scale=0.5,
        mask="causal",
    )
    for i in range(3):
        scores = 0.5 * k[0, 0, : 6 + i] @ q[0, 0, i]
        weights = np.exp(scores - scores.max())
        want = weights @ v[0, 0, : 6 + i] / weights.sum()
        np.testing.assert_allclose(np.array(got[0, 0, i]), want, atol=1e-5)


def test_bad_inputs_are_refused_with_the_expected_shapes() -> None:
    kernel = DensePrefillAttention(unfused_softmax=True)
    q, kv = mx.zeros((1, 4, 3, 8)), mx.zeros((1, 2, 5, 8))
    with pytest.raises(ShapeMismatchError, match=r"\(T, S\) = \(3, 5\)"):
        kernel(q, kv, kv, scale=1.0, mask=mx.ones((3, 4), dtype=mx.bool_))
    with pytest.raises(ShapeMismatchError, match="does not broadcast"):
        kernel(q, kv, kv, scale=1.0, mask=mx.ones((1, 3, 3, 5), dtype=mx.bool_))
    with pytest.raises(ShapeMismatchError, match="'causal'"):
        kernel(q, kv, kv, scale=1.0, mask="sliding")  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="do not group"):
        kernel(mx.zeros((1, 3, 3, 8)), kv, kv, scale=1.0, mask=None)
    with pytest.raises(ShapeMismatchError, match="one shape"):
        kernel(q, kv, mx.zeros((1, 2, 4, 8)), scale=1.0, mask=None)
    with pytest.raises(ShapeMismatchError, match="unfused_softmax"):
        DensePrefillAttention(unfused_softmax="yes")  # type: ignore[arg-type]


def test_selected_kernels_carry_the_prefill_attention() -> None:
    kernels = select_kernels()
    assert isinstance(kernels.prefill_attention, PrefillAttention)
    assert kernels.prefill_attention.name == "dense"
    assert select_kernels(prefill_attention=False).prefill_attention is None


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("cached", [0, 77])
def test_long_chunks_are_attended_in_query_blocks(kind: str, cached: int) -> None:
    """A 300-token chunk (three query blocks, the last one partial) == MLX's fused attention."""
    rng = np.random.default_rng(7)
    b, hkv, group, d, t = 2, 2, 2, 16, 300
    s = t + cached
    q, keys, values = (
        mx.array(rng.normal(size=shape).astype(np.float32))
        for shape in ((b, hkv * group, t, d), (b, hkv, s, d), (b, hkv, s, d))
    )
    mask = _mask(kind, rng, b, hkv * group, t, s)
    sinks = mx.array(rng.normal(size=hkv * group).astype(np.float32))
    args = {"scale": d**-0.5, "mask": mask, "sinks": sinks}
    got = DensePrefillAttention(unfused_softmax=True)(q, keys, values, **args)  # type: ignore[arg-type]
    want = DensePrefillAttention(unfused_softmax=False)(q, keys, values, **args)  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)


def test_query_blocks_run_in_memory_that_does_not_grow_with_the_chunk() -> None:
    """Query blocks are chained one after another: 4x the queries, about the same peak."""
    rng = np.random.default_rng(3)
    keys, values = (
        mx.array(rng.normal(size=(1, 2, 2048, 64)).astype(np.float32)) for _ in range(2)
    )
    kernel = DensePrefillAttention(unfused_softmax=True)

    def peak(t: int) -> int:
        q = mx.array(rng.normal(size=(1, 8, t, 64)).astype(np.float32))
        mx.eval(q, keys, values)
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(kernel(q, keys, values, scale=0.125, mask=None))
        mx.synchronize()
        return mx.get_peak_memory() - before

    assert peak(2048) <= 1.25 * peak(512)


def band(t: int, s: int, window: int) -> np.ndarray:
    """A sliding window's keep-mask: query i (position s - t + i) keeps its trailing window."""
    position = np.arange(s - t, s)[:, None]
    key = np.arange(s)[None, :]
    return (key <= position) & (key > position - window)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(129, 400),
    cached=st.integers(0, 300),
    window=st.integers(1, 200),
    lead=st.sampled_from([(), (1, 1), (2, 1), (2, 4)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_band_masks_read_only_each_block_s_keys(
    t: int, cached: int, window: int, lead: tuple[int, ...], seed: int
) -> None:
    """Blocks of a sliding window's chunk read only their span of keys: MLX's fused result."""
    rng = np.random.default_rng(seed)
    b, hkv, group, d, s = 2, 2, 2, 16, t + cached
    keep = np.broadcast_to(band(t, s, window), (*lead, t, s))
    mask = mx.array(np.ascontiguousarray(keep))
    spans = block_key_spans(mask)
    for i, (low, high) in enumerate(spans):
        rows = band(t, s, window)[i * PREFILL_QUERY_BLOCK : (i + 1) * PREFILL_QUERY_BLOCK]
        kept = np.flatnonzero(rows.any(axis=0))
        assert (low, high) == (kept[0], kept[-1] + 1)
    q, keys, values = (
        mx.array(rng.normal(size=shape).astype(np.float32))
        for shape in ((b, hkv * group, t, d), (b, hkv, s, d), (b, hkv, s, d))
    )
    args = {"scale": d**-0.5, "mask": mask, "sinks": None}
    got = DensePrefillAttention(unfused_softmax=True)(q, keys, values, **args)  # type: ignore[arg-type]
    want = DensePrefillAttention(unfused_softmax=False)(q, keys, values, **args)  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 300),
    s=st.integers(1, 60),
    lead=st.sampled_from([(), (1,), (3, 2)]),
    density=st.sampled_from([0.0, 0.02, 0.3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_block_key_spans_cover_every_kept_key(
    t: int, s: int, lead: tuple[int, ...], density: float, seed: int
) -> None:
    keep = np.random.default_rng(seed).random((*lead, t, s)) < density
    spans = block_key_spans(mx.array(keep))
    merged: np.ndarray = np.asarray(keep.reshape(-1, t, s).any(axis=0))
    assert len(spans) == -(-t // PREFILL_QUERY_BLOCK)
    for i, (low, high) in enumerate(spans):
        kept = np.flatnonzero(
            merged[i * PREFILL_QUERY_BLOCK : (i + 1) * PREFILL_QUERY_BLOCK].any(0)
        )
        assert (low, high) == ((kept[0], kept[-1] + 1) if kept.size else (0, s))
