"""The CPU quantized linear kernel against a float64 product of the same values.

The oracle is numpy's float64 product with the layer's values unpacked in numpy (checked
against ``mx.dequantize``, and the product against MLX's own ``mx.quantized_matmul``): the
kernel must agree with both to float rounding for every shape it serves (output rows not a
multiple of its 16-row tile, 1 to 40 input rows, 4 and 8 bits, groups of 16 to 128,
symmetric and asymmetric codes), through the graph node and through the evaluating ctypes
path; its row views must be its columns bit for bit, and it must refuse what it does not
serve.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CpuQuantizedLinear

KERNEL = CpuQuantizedLinear()
needs_kernel = pytest.mark.skipif(
    KERNEL.library.handle is None, reason=f"kernel not built: {KERNEL.library.reason}"
)


def quantized(
    rows: int, width: int, group: int, bits: int, seed: int, *, symmetric: bool = False
) -> tuple[mx.array, mx.array, mx.array]:
    """Random codes, scales and biases of MLX's affine layout (any group size).

    Symmetric: every bias is ``-2^(bits-1)`` times its scale (a GGUF's ``Q8_0`` / ``Q4_0``).
    """
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(rows, width * bits // 32), dtype=np.uint64)
    scales = (rng.standard_normal((rows, width // group)) * 0.01).astype(np.float32)
    if symmetric:
        biases = -float(1 << (bits - 1)) * scales
    else:
        biases = (rng.standard_normal((rows, width // group)) * 0.05).astype(np.float32)
    return mx.array(words.astype(np.uint32)), mx.array(scales), mx.array(biases)


def dequantized(
    codes: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
) -> np.ndarray:
    """The layer's float32 values, unpacked in numpy (element k of a row in bits k * bits ..)."""
    words = np.array(codes).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, None, :]
    q = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    s = np.repeat(np.array(scales), group, axis=1)
    b = np.repeat(np.array(biases), group, axis=1)
    values: np.ndarray = (q.astype(np.float32) * s + b).astype(np.float32)
    return values


def float64_product(
    x: mx.array, codes: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exact product of ``x`` with the dequantized layer, and a float32 rounding bound."""
    dense = dequantized(codes, scales, biases, group, bits).astype(np.float64)
    xs = np.array(x).reshape(-1, dense.shape[1]).astype(np.float64)
    return xs @ dense.T, 1e-5 * (np.abs(xs) @ np.abs(dense).T + 1e-3)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    out_rows=st.integers(1, 70),
    groups=st.integers(1, 4),
    group=st.sampled_from([16, 32, 64, 128]),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 40),
    symmetric=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_kernel_equals_a_float64_product_of_the_same_values(
    out_rows: int,
    groups: int,
    group: int,
    bits: int,
    rows: int,
    symmetric: bool,
    scale: float,
    seed: int,
) -> None:
    width = groups * group
    codes, scales, biases = quantized(out_rows, width, group, bits, seed, symmetric=symmetric)
    project = KERNEL.prepare(codes, scales, biases, group_size=group, bits=bits)
    assert project is not None
    assert project.biased == (not symmetric or bits == 4)
    x = mx.random.normal((rows, width), key=mx.random.key(seed + 1)) * scale
    got = project(x)
    assert got.shape == (rows, out_rows) and got.dtype == mx.float32
    exact, bound = float64_product(x, codes, scales, biases, group, bits)
    assert np.all(np.abs(np.array(got) - exact) <= bound)
    if group >= 32:  # MLX's own quantization serves groups of 32 and more
        mine = dequantized(codes, scales, biases, group, bits)
        theirs = mx.dequantize(codes, scales, biases, group_size=group, bits=bits)
        assert np.allclose(mine, np.array(theirs), rtol=1e-6, atol=1e-7)
        mlx = mx.quantized_matmul(
            x, codes, scales, biases, transpose=True, group_size=group, bits=bits
        )
        assert bool(mx.allclose(got, mlx, rtol=1e-4, atol=1e-4 * scale))
    # Each row's outputs are the same bits whatever rows share the call.
    alone = mx.concatenate([project(x[i : i + 1]) for i in range(rows)])
    assert mx.array_equal(got, alone)
    # The evaluating ctypes path (no graph calls) computes the same bits.
    project._graph = ()  # type: ignore[assignment]
    assert mx.array_equal(project(x), got)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    tiles=st.integers(1, 5),
    extra=st.integers(0, 15),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_row_views_are_the_projection_s_columns_bit_for_bit(
    tiles: int, extra: int, bits: int, seed: int, data: st.DataObject
) -> None:
    out_rows = 16 * tiles + extra
    codes, scales, biases = quantized(out_rows, 64, 32, bits, seed)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=bits)
    assert project is not None
    start = 16 * data.draw(st.integers(0, (out_rows - 1) // 16))
    stop = data.draw(st.integers(start + 1, out_rows))
    view = project.rows(start, stop)
    x = mx.random.normal((3, 64), key=mx.random.key(seed + 2))
    assert mx.array_equal(view(x), project(x)[:, start:stop])
    assert view.vocab == stop - start and view.nbytes <= project.nbytes
    if stop - start > 16:  # a view of a view reads the same buffers
        assert mx.array_equal(view.rows(16, stop - start)(x), project(x)[:, start + 16 : stop])
    view._graph = ()  # type: ignore[assignment]
    assert mx.array_equal(view(x), project(x)[:, start:stop])


@needs_kernel
def test_rows_of_any_leading_shape_and_layout_project_as_their_contiguous_copy() -> None:
    codes, scales, biases = quantized(24, 64, 32, 8, seed=5)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    x = mx.random.normal((2, 3, 64), key=mx.random.key(6))
    flat = project(x.reshape(6, 64))
    assert mx.array_equal(project(x), flat.reshape(2, 3, 24))
    strided = mx.random.normal((64, 5), key=mx.random.key(7)).T  # a transposed view
    assert mx.array_equal(project(strided), project(mx.contiguous(strided)))
    assert project(mx.zeros((2, 0, 64))).shape == (2, 0, 24)


@needs_kernel
def test_zeros_infinities_and_nans_propagate_as_in_a_float_product() -> None:
    codes, scales, biases = quantized(20, 64, 32, 4, seed=9)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=4)
    assert project is not None
    assert mx.array_equal(project(mx.zeros((2, 64))), mx.zeros((2, 20)))
    x = mx.zeros((2, 64))
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    got = np.array(project(x))
    assert np.all(np.isnan(got[0]))
    assert not np.any(np.isfinite(got[1]))


@needs_kernel
def test_what_it_does_not_serve_is_refused() -> None:
    codes, scales, biases = quantized(16, 64, 32, 8, seed=1)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    assert KERNEL.prepare(codes, scales, biases, group_size=32, bits=3) is None
    assert KERNEL.prepare(codes, scales, biases, group_size=48, bits=8) is None
    assert KERNEL.prepare(codes.astype(mx.int32), scales, biases, group_size=32, bits=8) is None
    assert KERNEL.prepare(codes, scales[:, :1], biases, group_size=32, bits=8) is None
    with pytest.raises(ValueError, match="float32 rows of 64 values"):
        project(mx.zeros((2, 32)))
    with pytest.raises(ValueError, match="float32 rows of 64 values"):
        project(mx.zeros((2, 64), dtype=mx.float16))
    with pytest.raises(ValueError, match="starting at a multiple of 16"):
        project.rows(3, 10)
    with pytest.raises(ValueError, match="non-empty range"):
        project.rows(0, 17)
