"""The CPU quantized head kernel against MLX's own quantized product and a float64 reference.

The oracles are ``mx.quantized_matmul`` (MLX's product of the same codes) and numpy's float64
product with ``mx.dequantize``'s values; the kernel must agree with both to float rounding
for every shape it serves (vocabulary rows not a multiple of its tile, 1 to 9 input rows,
4 and 8 bits, groups of 32, 64 and 128), refuse what it does not serve, and keep MLX's
product where it is not built.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CPU_KERNELS_ENV, CpuQuantizedHead, _cpu_library, select_kernels
from kv_metal_kernels._quantized_head_source import QUANTIZED_HEAD_SOURCE

KERNEL = CpuQuantizedHead()
needs_kernel = pytest.mark.skipif(
    KERNEL.library.handle is None, reason=f"kernel not built: {KERNEL.library.reason}"
)


def quantized(vocab: int, hidden: int, group: int, bits: int, seed: int) -> tuple[mx.array, ...]:
    key = mx.random.key(seed)
    weight = mx.random.normal((vocab, hidden), key=key) * 0.05
    return mx.quantize(weight, group_size=group, bits=bits)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(1, 70),
    groups=st.integers(1, 4),
    group=st.sampled_from([32, 64, 128]),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 19),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_kernel_equals_mlx_and_a_float64_product(
    vocab: int, groups: int, group: int, bits: int, rows: int, seed: int
) -> None:
    hidden = groups * group
    codes, scales, biases = quantized(vocab, hidden, group, bits, seed)
    project = KERNEL.prepare(codes, scales, biases, group_size=group, bits=bits)
    assert project is not None
    x = mx.random.normal((rows, hidden), key=mx.random.key(seed + 1))
    got = project(x)
    assert got.shape == (rows, vocab) and got.dtype == mx.float32
    mlx = mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=group, bits=bits)
    dense = np.array(mx.dequantize(codes, scales, biases, group_size=group, bits=bits))
    exact = np.array(x).astype(np.float64) @ dense.astype(np.float64).T
    bound = 1e-5 * (np.abs(np.array(x)) @ np.abs(dense).T + 1e-3)
    assert np.all(np.abs(np.array(got) - exact) <= bound)
    assert bool(mx.allclose(got, mlx, rtol=1e-4, atol=1e-5))
    # Each row's outputs are the same bits whatever rows share the call (and its tiling).
    alone = mx.concatenate([project(x[i : i + 1]) for i in range(rows)])
    assert mx.array_equal(got, alone)


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
    assert mx.array_equal(project(x[:, 1:]), flat.reshape(2, 3, 24)[:, 1:])
    assert project(mx.zeros((2, 0, 64))).shape == (2, 0, 24)


@needs_kernel
def test_a_large_head_keeps_its_argmax() -> None:
    """Gemma 3 270M's head shape at 8 bits: the greedy rows are MLX's."""
    codes, scales, biases = quantized(262144, 640, 32, 8, seed=3)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    x = mx.random.normal((5, 640), key=mx.random.key(4))
    mlx = mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=32, bits=8)
    got = project(x)
    assert bool(mx.array_equal(got.argmax(-1), mlx.argmax(-1)))
    assert bool(mx.allclose(got, mlx, rtol=1e-4, atol=1e-4))


@needs_kernel
def test_heads_it_does_not_serve_are_refused() -> None:
    codes, scales, biases = quantized(8, 64, 32, 8, seed=1)
    for bits in (2, 3, 5, 6):
        c, s, b = quantized(8, 64, 32, bits, seed=1)
        assert KERNEL.prepare(c, s, b, group_size=32, bits=bits) is None
    assert KERNEL.prepare(codes, scales[:, :1], biases, group_size=32, bits=8) is None
    assert KERNEL.prepare(codes.astype(mx.int32), scales, biases, group_size=32, bits=8) is None
    assert KERNEL.prepare(codes, scales, biases, group_size=24, bits=8) is None
    assert KERNEL.prepare(codes, scales, biases, group_size=0, bits=8) is None


@needs_kernel
def test_rows_it_cannot_read_are_refused_by_name() -> None:
    codes, scales, biases = quantized(8, 64, 32, 8, seed=1)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    for bad in (mx.zeros((2, 64), dtype=mx.bfloat16), mx.zeros((2, 32)), mx.zeros((64,))):
        with pytest.raises(ValueError, match="float32 rows of 64 values"):
            project(bad)
    assert project(mx.zeros((0, 64))).shape == (0, 8)


def test_turned_off_or_misnamed_it_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_KERNELS_ENV, "off")
    off = _cpu_library._build("kv_test_off", QUANTIZED_HEAD_SOURCE)
    assert off.handle is None and off.reason == f"{CPU_KERNELS_ENV}=off"
    monkeypatch.setenv(CPU_KERNELS_ENV, "fast")
    wrong = _cpu_library._build("kv_test_wrong", QUANTIZED_HEAD_SOURCE)
    assert wrong.handle is None and "neither 'auto' nor 'off'" in wrong.reason
    monkeypatch.setenv(CPU_KERNELS_ENV, "auto")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    missing = _cpu_library._build("kv_test_missing", QUANTIZED_HEAD_SOURCE)
    assert missing.handle is None and missing.reason == "no C compiler on PATH"


@needs_kernel
def test_source_that_does_not_compile_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = _cpu_library._build("kv_test_broken", "this is not C;")
    assert broken.handle is None and "could not build it" in broken.reason


def test_the_kernel_set_carries_it_on_the_cpu_only() -> None:
    assert mx.default_device().type == mx.cpu
    assert isinstance(select_kernels().quantized_head, CpuQuantizedHead)
    assert select_kernels(quantized_head=False).quantized_head is None


@needs_kernel
def test_the_native_products_count_their_seconds_on_the_evaluation_clock() -> None:
    from kv_metal_kernels import CpuPagedAttention
    from kv_protocol import EVALUATION_CLOCK

    codes, scales, biases = quantized(64, 64, 32, 8, seed=2)
    project = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    project._graph = ()  # type: ignore[attr-defined]  # the evaluating calls (KV_CPU_GRAPH=off)
    EVALUATION_CLOCK.take()
    x = mx.random.normal((3, 64)) * 2.0  # unevaluated: its evaluation is counted too
    project(x)
    assert EVALUATION_CLOCK.take() > 0.0 and EVALUATION_CLOCK.take() == 0.0
    attention = CpuPagedAttention()
    if attention.library.handle is None:
        return
    attention._graph = ()
    attention(
        mx.random.normal((1, 2, 1, 64)),
        mx.random.normal((1, 48, 64)),  # 3 pages of 16, page 0 the null page
        mx.random.normal((1, 48, 64)),
        mx.array([[1, 2]], dtype=mx.int32),
        mx.array([20], dtype=mx.int32),
        page_size=16,
        scale=0.125,
    )
    assert EVALUATION_CLOCK.take() > 0.0


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    vocab=st.integers(1, 60),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 9),
    cut=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    evaluating=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_rows_view_projects_its_columns_of_the_whole_head(
    vocab: int,
    bits: int,
    rows: int,
    cut: tuple[float, float],
    evaluating: bool,
    seed: int,
) -> None:
    codes, scales, biases = quantized(vocab, 64, 32, bits, seed)
    whole = KERNEL.prepare(codes, scales, biases, group_size=32, bits=bits)
    assert whole is not None
    start = min(int(cut[0] * vocab), vocab - 1)
    stop = start + 1 + int(cut[1] * (vocab - start - 1))
    view = whole.rows(start, stop)
    if evaluating:  # the ctypes path (KV_CPU_GRAPH=off) reads the same offsets
        view._graph = ()  # type: ignore[assignment]
    x = mx.random.normal((rows, 64), key=mx.random.key(seed + 1))
    got = view(x)
    assert got.shape == (rows, stop - start)
    # The same bits as the whole head's columns and as a head of those rows alone.
    assert mx.array_equal(got, whole(x)[:, start:stop])
    alone = KERNEL.prepare(
        codes[start:stop], scales[start:stop], biases[start:stop], group_size=32, bits=bits
    )
    assert alone is not None and mx.array_equal(got, alone(x))
    # Nothing copied: the view counts its rows' share of the buffers it reads.
    assert view.nbytes * vocab == whole.nbytes * (stop - start)
    # A view of a view, and its greedy pick (the screen laid out from the view's rows).
    inner = view.rows(0, stop - start)
    assert mx.array_equal(inner(x), got)
    picked = view.greedy(x)
    if picked is not None:
        assert mx.array_equal(picked, mx.argmax(got, axis=-1).astype(mx.uint32))


@needs_kernel
def test_a_rows_view_outside_the_head_is_refused() -> None:
    codes, scales, biases = quantized(10, 64, 32, 8, seed=3)
    whole = KERNEL.prepare(codes, scales, biases, group_size=32, bits=8)
    assert whole is not None
    for start, stop in ((-1, 3), (4, 4), (5, 11), (7, 2)):
        with pytest.raises(ValueError, match=r"rows must be a non-empty range within 0 \.\. 10"):
            whole.rows(start, stop)
