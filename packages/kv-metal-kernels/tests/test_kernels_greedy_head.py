"""The quantized head's greedy screen against ``mx.argmax`` of the same kernel's logits.

``QuantizedHeadProjection.greedy`` rounds the rows to 8 bits, screens the vocabulary with
integer products and a bound on each logit's error, and computes only the rows that could
win in float32. The oracle is the projection's own logits (the float32 kernel, itself
checked against MLX's quantized product and float64) and MLX's argmax of them: the same
token in every row for any head shape it serves, near-ties (vocabulary rows a few codes
apart), exact ties (duplicate rows: the first wins), rows of any scale, zero rows and rows
with infinities or NaN (MLX's rule: the first NaN), through the graph node and through the
evaluating call.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CpuQuantizedHead

KERNEL = CpuQuantizedHead()
_handle = KERNEL.library.handle
SCREENS = _handle is not None and bool(_handle.kv_qhead_screen_supported())
needs_screen = pytest.mark.skipif(
    not SCREENS,
    reason="the greedy screen needs the kernel built with AVX-512 VNNI"
    if _handle is not None
    else f"kernel not built: {KERNEL.library.reason}",
)


def head(
    vocab: int,
    hidden: int,
    group: int,
    bits: int,
    seed: int,
    twins: int,
    zero: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """A random affine head (MLX's layout) whose last ``twins`` rows repeat earlier rows,
    one code apart or equal; with ``zero`` a symmetric one (every bias exactly ``-zero``
    times its scale, as a GGUF's Q8_0 / Q4_0 blocks)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 1 << bits, (vocab, hidden), dtype=np.uint8)
    scales = (rng.random((vocab, hidden // group)) * 0.01 + 1e-4).astype(np.float32)
    if zero is None:
        biases = (-scales * (1 << (bits - 1)) + rng.standard_normal(scales.shape) * 1e-3).astype(
            np.float32
        )
    else:
        # Scales of 14 significant bits: -zero * scale is exact in float32 for any zero.
        scales = (np.round(scales * 2.0**21) / 2.0**21).astype(np.float32)
        biases = (-np.float32(zero) * scales).astype(np.float32)
    if twins:
        source = rng.integers(0, max(vocab - twins, 1), twins)
        rows = np.arange(vocab - twins, vocab)
        values[rows], scales[rows], biases[rows] = values[source], scales[source], biases[source]
        nudge = rows[rng.random(twins) < 0.5]
        values[nudge, 0] ^= 1  # the first code one step away: a near-tie
    packed = values
    if bits == 4:  # element k in bits 4k.. of a little-endian word: pairs share a byte
        packed = (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)
    codes = np.ascontiguousarray(packed).view(np.uint32)
    return mx.array(codes), mx.array(scales), mx.array(biases)


def argmax_of_logits(project: object, x: mx.array) -> mx.array:
    logits = project(x)  # type: ignore[operator]
    return mx.argmax(logits, axis=-1)


@needs_screen
@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 300),
    groups=st.integers(1, 4),
    group=st.sampled_from([16, 32, 64, 128, 256]),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 19),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e4]),
    outlier=st.booleans(),
    twins=st.integers(0, 40),
    zero=st.one_of(st.none(), st.sampled_from([0, 1, 7, 8, 100, 128, 255])),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_screen_picks_the_argmax_of_the_logits(
    vocab: int,
    groups: int,
    group: int,
    bits: int,
    rows: int,
    scale: float,
    outlier: bool,
    twins: int,
    zero: int | None,
    seed: int,
) -> None:
    hidden = groups * group
    if zero is not None:
        zero %= 1 << bits
    codes, scales, biases = head(vocab, hidden, group, bits, seed, min(twins, vocab - 1), zero)
    project = KERNEL.prepare(codes, scales, biases, group_size=group, bits=bits)
    assert project is not None and project.screens
    rng = np.random.default_rng(seed + 1)
    values = rng.standard_normal((rows, hidden)).astype(np.float32) * scale
    if outlier:
        values[:, rng.integers(0, hidden)] *= 60.0  # Gemma's few large features
    x = mx.array(values)
    got = project.greedy(x)
    assert got is not None and got.shape == (rows,) and got.dtype == mx.uint32
    assert mx.array_equal(got, argmax_of_logits(project, x))
    # A symmetric head's screen takes the integer form of the bias term (its zero point).
    layout = project._screen
    assert layout is not None and layout.zero == (-1 if zero is None else zero)


@needs_screen
def test_exact_ties_go_to_the_first_row() -> None:
    codes, scales, biases = head(64, 64, 32, 8, seed=2, twins=0)
    c, s, b = (np.array(a) for a in (codes, scales, biases))
    order = [5, 40, 17, 63]
    for row in order[1:]:
        c[row], s[row], b[row] = c[order[0]], s[order[0]], b[order[0]]
    project = KERNEL.prepare(mx.array(c), mx.array(s), mx.array(b), group_size=32, bits=8)
    assert project is not None
    dense = mx.dequantize(mx.array(c), mx.array(s), mx.array(b), group_size=32, bits=8)
    x = dense[5:6] * 10.0  # the row that best matches the duplicated weights
    got = project.greedy(x)
    assert got is not None and got.tolist() == [5]
    assert argmax_of_logits(project, x).tolist() == [5]


@needs_screen
def test_rows_it_cannot_bound_are_computed_whole() -> None:
    codes, scales, biases = head(100, 64, 32, 8, seed=3, twins=0)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[0] = 0.0  # every logit zero: the first row
    x[1, 3] = np.inf
    x[2, 7] = np.nan
    x[3] *= 1e32  # past the bound's range
    x[4, :] = -np.inf
    got = project.greedy(mx.array(x))
    assert got is not None
    assert mx.array_equal(got, argmax_of_logits(project, mx.array(x)))


@needs_screen
def test_leading_shapes_layouts_and_the_evaluating_call_agree() -> None:
    codes, scales, biases = head(333, 128, 64, 4, seed=5, twins=20)
    project = KERNEL.prepare(codes, scales, biases, group_size=64, bits=4)
    assert project is not None
    x = mx.random.normal((2, 3, 128), key=mx.random.key(6)) * 4
    expected = argmax_of_logits(project, x)
    got = project.greedy(x)
    assert got is not None and got.shape == (2, 3)
    assert mx.array_equal(got, expected)
    strided = mx.random.normal((128, 5), key=mx.random.key(7)).T
    picked = project.greedy(strided)
    assert picked is not None and mx.array_equal(picked, argmax_of_logits(project, strided))
    empty = project.greedy(mx.zeros((0, 128)))
    assert empty is not None and empty.shape == (0,)
    project._greedy_graph = ()  # the evaluating call (KV_CPU_GRAPH=off)
    evaluated = project.greedy(x)
    assert evaluated is not None and mx.array_equal(evaluated, expected)


@needs_screen
def test_a_gemma_sized_head_screens_to_the_same_tokens() -> None:
    """Gemma 3 270M's head shape at 8 bits, rows shaped like its hidden states."""
    codes, scales, biases = head(262144, 640, 32, 8, seed=8, twins=0)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    rng = np.random.default_rng(9)
    x = rng.standard_normal((17, 640)).astype(np.float32) * 3
    x[:, 11] *= 20
    got = project.greedy(mx.array(x))
    assert got is not None
    assert mx.array_equal(got, argmax_of_logits(project, mx.array(x)))
    assert project.nbytes > 2 * 262144 * 640  # the screen's copy counts


def test_rows_of_the_wrong_width_or_type_are_refused_by_name() -> None:
    if KERNEL.library.handle is None:
        pytest.skip(f"kernel not built: {KERNEL.library.reason}")
    codes, scales, biases = head(16, 64, 32, 8, seed=1, twins=0)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    if not project.screens:
        assert project.greedy(mx.zeros((1, 64))) is None
        return
    with pytest.raises(ValueError, match="float32 rows of 64 values"):
        project.greedy(mx.zeros((1, 32)))
    with pytest.raises(ValueError, match="float32 rows of 64 values"):
        project.greedy(mx.zeros((1, 64), dtype=mx.float16))


@pytest.mark.parametrize(("group", "bits"), [(32, 4), (64, 8), (128, 4)])
def test_the_heads_here_are_in_mlx_layout(group: int, bits: int) -> None:
    codes, scales, biases = head(40, 256, group, bits, seed=11, twins=5)
    dense = np.array(mx.dequantize(codes, scales, biases, group_size=group, bits=bits))
    rng = np.random.default_rng(11)
    values = rng.integers(0, 1 << bits, (40, 256), dtype=np.uint8).astype(np.float32)
    expected = values[0] * np.repeat(np.array(scales)[0], group) + np.repeat(
        np.array(biases)[0], group
    )
    assert np.allclose(dense[0], expected, rtol=1e-6, atol=1e-7)
