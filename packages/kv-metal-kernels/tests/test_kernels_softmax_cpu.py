"""The CPU decode softmax: exp from vectorised arithmetic, attention against float64 oracles."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import ReferencePagedAttention
from kv_metal_kernels._softmax_cpu import exp_nonpositive, softmax_attention

NONPOSITIVE = st.floats(
    min_value=-200.0, max_value=0.0, allow_nan=False, allow_infinity=False, width=32
)


@settings(max_examples=50)
@given(st.lists(NONPOSITIVE, min_size=1, max_size=300))
def test_exp_nonpositive_matches_float64_exp(xs: list[float]) -> None:
    got = np.array(exp_nonpositive(mx.array(xs, dtype=mx.float32)), np.float64)
    want = np.exp(np.array(xs, np.float64))
    normal = want >= 2.0**-126
    # The documented relative error where the result is a normal float32 ...
    bound = 2.5e-7 + 7.5e-8 * np.abs(np.array(xs, np.float64))
    assert np.all(np.abs(got[normal] / want[normal] - 1) <= bound[normal])
    # ... and below that, flushed towards zero, never above the smallest normal.
    assert np.all(got[~normal] <= 2.0**-126)
    assert np.all(got >= 0)


def test_exp_nonpositive_edges() -> None:
    x = mx.array([0.0, -0.0, -math.inf, -87.0, -88.5, -1e30, -1e-30], dtype=mx.float32)
    got = np.array(exp_nonpositive(x), np.float64)
    assert got[0] == 1.0 and got[1] == 1.0  # exp(0) is exact
    assert got[2] == 0.0  # masked logits contribute exactly nothing
    assert math.isclose(got[3], math.exp(-87.0), rel_tol=2.5e-7 + 7.5e-8 * 87)
    assert got[4] <= 2.0**-126 and got[5] == 0.0
    assert got[6] == 1.0
    dense = mx.linspace(-5, 0, 100_001, dtype=mx.float32)
    want = np.exp(np.array(dense, np.float64))
    rel = np.abs(np.array(exp_nonpositive(dense), np.float64) / want - 1)
    assert rel.max() < 4.5e-7  # where softmax weights are at least 0.7% of the largest


def _oracle(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    keep: np.ndarray,
    scale: float,
    sinks: np.ndarray | None,
) -> np.ndarray:
    b, hq, _, d = q.shape
    group = hq // keys.shape[0]
    out = np.zeros((b, hq, 1, d))
    for i in range(b):
        cols = np.flatnonzero(keep[i])
        for h in range(hq):
            scores = scale * keys[h // group, i, cols] @ q[i, h, 0]
            top = scores.max() if sinks is None else max(scores.max(), sinks[h])
            weights = np.exp(scores - top)
            denom = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[i, h, 0] = weights @ values[h // group, i, cols] / denom
    return out


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 5),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 64]),
    length=st.integers(1, 70),
    sinks=st.booleans(),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_softmax_attention_matches_float64_oracle(
    b: int, hkv: int, group: int, d: int, length: int, sinks: bool, dtype: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    hq = hkv * group
    q = rng.normal(size=(b, hq, 1, d)) * 2
    keys = rng.normal(size=(hkv, b, length, d))
    values = rng.normal(size=(hkv, b, length, d))
    keep = rng.random((b, length)) < 0.7
    keep[np.arange(b), rng.integers(0, length, size=b)] = True  # every row sees a key
    sink_logits = rng.normal(size=hq) * 3 if sinks else None
    mdtype = mx.float32 if dtype == "float32" else mx.bfloat16
    # The oracle reads the same rounded inputs the kernel gets.
    q_m, k_m, v_m = (mx.array(a.astype(np.float32)).astype(mdtype) for a in (q, keys, values))
    s_m = None if sink_logits is None else mx.array(sink_logits.astype(np.float32))
    scale = 1 / math.sqrt(d)
    got = softmax_attention(q_m, k_m, v_m, mx.array(keep), scale=scale, sinks=s_m)
    assert got.shape == (b, hq, 1, d) and got.dtype == mdtype
    q64, k64, v64 = (np.array(a.astype(mx.float32), np.float64) for a in (q_m, k_m, v_m))
    want = _oracle(q64, k64, v64, keep, scale, sink_logits)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=tol, rtol=tol)


def test_pages_and_mask_are_per_table_when_layers_share_seq_lens() -> None:
    """Two sub-pools' tables with one ``seq_lens`` object: each layer reads its own pages."""
    rng = np.random.default_rng(5)
    page_size, d = 4, 16
    lens = mx.array([5, 11], dtype=mx.int32)
    pool = mx.array(rng.normal(size=(1, 64 * page_size, d)).astype(np.float32))
    q = mx.array(rng.normal(size=(2, 1, 1, d)).astype(np.float32))
    kernel = ReferencePagedAttention(unfused_softmax=True)
    fused = ReferencePagedAttention(unfused_softmax=False)
    tables = [
        mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int32),
        mx.array([[9, 8, 7], [12, 11, 10]], dtype=mx.int32),
    ]
    outs = []
    for table in tables * 2:
        got = kernel(q, pool, pool, table, lens, page_size=page_size, scale=0.25)
        want = fused(q, pool, pool, table, mx.array(lens), page_size=page_size, scale=0.25)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6, rtol=1e-6)
        outs.append(np.array(got))
    assert not np.allclose(outs[0], outs[1])  # the tables address different keys
