"""``CpuNormRope`` against MLX's own ``mx.fast.rms_norm`` per head followed by ``mx.fast.rope``.

The kernel takes a decode step's projected rows, normalises each head's row and rotates it
in halves from the step's factors; the oracle is MLX's two fused operations on the same
rows, with each row's position as its offset: the same bits are required.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CpuNormRope, select_kernels
from kv_metal_kernels._graph_call import graph_calls
from kv_protocol import NormRopeKernel, RmsNormForm

KERNEL = CpuNormRope()
pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.cpu or not KERNEL.available,
    reason=f"the CPU norm + RoPE node is not available: {KERNEL.reason or 'not on the CPU'}",
)


@dataclass
class Norm:
    """An ``RmsNormForm``: a weight, an epsilon and whether it scales by ``1 + weight``."""

    weight: mx.array
    eps: float
    add_one: bool


def factors(offsets: mx.array, dim: int, base: float, scale: float) -> tuple[mx.array, mx.array]:
    """``([cos, cos], [-sin, sin])`` per row, read off ``mx.fast.rope`` of a ones/zeros probe."""
    half = dim // 2
    rows = offsets.shape[0]
    probe = mx.concatenate([mx.ones((rows, 1, 1, half)), mx.zeros((rows, 1, 1, half))], axis=-1)
    turned = mx.fast.rope(probe, dim, traditional=False, base=base, scale=scale, offset=offsets)
    cos, sin = turned[..., :half].reshape(rows, half), turned[..., half:].reshape(rows, half)
    return mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)


def oracle(
    rows: mx.array, heads: int, norm: Norm | None, offsets: mx.array, base: float, scale: float
) -> mx.array:
    """MLX's norm of each head's row, then MLX's RoPE at each row's own offset."""
    batch = rows.shape[0]
    dim = rows.shape[-1] // heads
    x = rows.reshape(batch, heads, 1, dim)
    if norm is not None:
        weight = 1.0 + norm.weight if norm.add_one else norm.weight
        x = mx.fast.rms_norm(x, weight, norm.eps)
    out = mx.fast.rope(x, dim, traditional=False, base=base, scale=scale, offset=offsets)
    return out.reshape(batch, heads, dim)


def test_it_is_the_protocol_and_the_cpu_kernel_set_carries_it() -> None:
    assert isinstance(KERNEL, NormRopeKernel)
    assert isinstance(Norm(mx.ones((4,)), 1e-6, False), RmsNormForm)
    assert isinstance(select_kernels().norm_rope, CpuNormRope)
    assert select_kernels(norm_rope=False).norm_rope is None


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 6),
    heads=st.integers(1, 8),
    dim=st.sampled_from([2, 8, 64, 128, 256]),
    norm=st.sampled_from(["none", "plain", "plus_one"]),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    base=st.sampled_from([10000.0, 1_000_000.0]),
    scale=st.sampled_from([1.0, 0.125]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    lazy=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_node_is_mlx_norm_then_rope_bit_for_bit(
    batch: int,
    heads: int,
    dim: int,
    norm: str,
    eps: float,
    base: float,
    scale: float,
    magnitude: float,
    lazy: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    rows = mx.array((rng.normal(size=(batch, 1, heads * dim)) * magnitude).astype(np.float32))
    if lazy:
        rows = rows * 1.5 - 0.25  # an unevaluated input, as a projection's node is
    weight = mx.array(rng.normal(size=(dim,)).astype(np.float32))
    form = None if norm == "none" else Norm(weight, eps, norm == "plus_one")
    offsets = mx.array(rng.integers(0, 40_000, size=batch).astype(np.int32))
    cos_both, sin_signed = factors(offsets, dim, base, scale)
    got = KERNEL(rows, heads=heads, cos_both=cos_both, sin_signed=sin_signed, norm=form)
    assert got is not None and got.shape == (batch, heads, dim) and got.dtype == mx.float32
    want = oracle(rows, heads, form, offsets, base, scale)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_a_strided_input_gives_the_same_bits() -> None:
    rng = np.random.default_rng(3)
    wide = mx.array(rng.normal(size=(3, 1, 2 * 4 * 16)).astype(np.float32))
    rows = wide[..., ::2]  # every other feature: not row-contiguous
    offsets = mx.array([0, 7, 300], dtype=mx.int32)
    cos_both, sin_signed = factors(offsets, 16, 10000.0, 1.0)
    form = Norm(mx.array(rng.normal(size=(16,)).astype(np.float32)), 1e-6, True)
    got = KERNEL(rows, heads=4, cos_both=cos_both, sin_signed=sin_signed, norm=form)
    assert got is not None
    want = oracle(mx.contiguous(rows), 4, form, offsets, 10000.0, 1.0)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_the_node_is_lazy(tmp_path: object) -> None:
    offsets = mx.array([5], dtype=mx.int32)
    cos_both, sin_signed = factors(offsets, 8, 10000.0, 1.0)
    got = KERNEL(
        mx.ones((1, 1, 16)) * 2.0, heads=2, cos_both=cos_both, sin_signed=sin_signed, norm=None
    )
    assert got is not None
    path = f"{tmp_path}/graph.dot"
    mx.export_to_dot(path, got)
    with open(path) as dot:
        assert "KvNormRope" in dot.read()


def test_calls_it_does_not_serve_are_declined() -> None:
    offsets = mx.array([1, 2], dtype=mx.int32)
    cos_both, sin_signed = factors(offsets, 8, 10000.0, 1.0)
    rows = mx.ones((2, 1, 16))
    norm = Norm(mx.ones((8,)), 1e-6, False)
    call = KERNEL.__call__
    assert call(rows, heads=2, cos_both=cos_both, sin_signed=sin_signed, norm=norm) is not None
    declined = [
        call(
            rows.astype(mx.bfloat16), heads=2, cos_both=cos_both, sin_signed=sin_signed, norm=norm
        ),
        call(rows, heads=3, cos_both=cos_both, sin_signed=sin_signed, norm=norm),  # 16 % 3
        call(
            mx.ones((2, 1, 6)),
            heads=2,
            cos_both=cos_both[:, :3],
            sin_signed=sin_signed[:, :3],
            norm=None,
        ),  # odd
        call(rows, heads=2, cos_both=cos_both[:1], sin_signed=sin_signed[:1], norm=norm),
        call(
            rows,
            heads=2,
            cos_both=cos_both,
            sin_signed=sin_signed,
            norm=Norm(mx.ones((16,)), 1e-6, False),
        ),
        call(
            rows,
            heads=2,
            cos_both=cos_both,
            sin_signed=sin_signed,
            norm=Norm(mx.ones((8,), dtype=mx.float16), 1e-6, False),
        ),
        call(rows, heads=0, cos_both=cos_both, sin_signed=sin_signed, norm=norm),
        call(mx.ones((16,)), heads=2, cos_both=cos_both, sin_signed=sin_signed, norm=norm),
    ]
    assert declined == [None] * len(declined)


def test_without_the_graph_calls_it_serves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert graph_calls().available
    off = CpuNormRope()
    monkeypatch.setattr(off, "_graph", ())
    offsets = mx.array([1], dtype=mx.int32)
    cos_both, sin_signed = factors(offsets, 8, 10000.0, 1.0)
    assert not off.available and off.reason
    assert (
        off(mx.ones((1, 1, 8)), heads=1, cos_both=cos_both, sin_signed=sin_signed, norm=None)
        is None
    )
