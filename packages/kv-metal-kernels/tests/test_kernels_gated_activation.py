"""``CpuGatedActivation`` against ``kv_protocol.gated_activation`` composed of MLX's operations.

The definition is MLX's own operations on float32 (``kv_protocol.gated_activation``, not
compiled); the kernel must give its bits for every input, the tails, zeros, infinities and
NaNs included, and decline what it does not serve.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CpuGatedActivation, select_kernels
from kv_protocol import GATED_ACTIVATIONS, GatedActivationKernel, gated_activation

KERNEL = CpuGatedActivation()
pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.cpu or not KERNEL.available,
    reason=f"the CPU activation node is not available: {KERNEL.reason or 'not on the CPU'}",
)


def test_it_is_the_protocol_and_the_cpu_kernel_set_carries_it() -> None:
    assert isinstance(KERNEL, GatedActivationKernel)
    assert isinstance(select_kernels().gated_activation, CpuGatedActivation)
    assert select_kernels(gated_activation=False).gated_activation is None


@settings(max_examples=80, deadline=None)
@given(
    activation=st.sampled_from(GATED_ACTIVATIONS),
    shape=st.sampled_from([(1,), (5,), (1, 1, 2048), (3, 1, 640), (2, 7, 33), (70_000,)]),
    scale=st.sampled_from([1e-3, 0.5, 3.0, 20.0, 400.0, 1e6]),
    lazy=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_node_is_the_definition_bit_for_bit(
    activation: str, shape: tuple[int, ...], scale: float, lazy: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    gate = mx.array((rng.normal(size=shape) * scale).astype(np.float32))
    up = mx.array(rng.normal(size=shape).astype(np.float32))
    if lazy:
        gate, up = gate * 1.25, up - 0.5  # unevaluated inputs, as the projections' nodes are
    got = KERNEL(gate, up, activation=activation)
    assert got is not None and got.shape == gate.shape and got.dtype == mx.float32
    want = gated_activation(gate, up, activation)
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_special_values_are_the_definitions(activation: str) -> None:
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 88.7, -88.7, 1e30, -1e30]
    gate = mx.array(values, dtype=mx.float32)
    up = mx.array([1.0, -2.0, 0.5, 3.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 2.0], dtype=mx.float32)
    got = np.array(KERNEL(gate, up, activation=activation))
    want = np.array(gated_activation(gate, up, activation))
    np.testing.assert_array_equal(got, want)


def test_strided_inputs_give_the_same_bits() -> None:
    rng = np.random.default_rng(5)
    both = mx.array(rng.normal(size=(4, 1, 2 * 96)).astype(np.float32) * 4)
    gate, up = both[..., :96], both[..., 96:]
    got = KERNEL(gate, up, activation="gelu_approx")
    assert got is not None
    want = gated_activation(gate, up, "gelu_approx")
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_calls_it_does_not_serve_are_declined() -> None:
    gate, up = mx.ones((2, 8)), mx.ones((2, 8))
    assert KERNEL(gate, up, activation="silu") is not None
    declined = [
        KERNEL(gate, up, activation="relu"),
        KERNEL(gate.astype(mx.bfloat16), up, activation="silu"),
        KERNEL(gate, up.astype(mx.float16), activation="silu"),
        KERNEL(gate, mx.ones((2, 4)), activation="silu"),
        KERNEL(mx.ones((0,)), mx.ones((0,)), activation="silu"),
    ]
    assert declined == [None] * len(declined)


def test_the_node_is_lazy(tmp_path: object) -> None:
    out = KERNEL(mx.ones((3,)) * 2.0, mx.ones((3,)), activation="silu")
    assert out is not None
    path = f"{tmp_path}/graph.dot"
    mx.export_to_dot(path, out)
    with open(path) as dot:
        assert "KvGatedActivation" in dot.read()
