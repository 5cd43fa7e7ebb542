"""Vectorised gated-MLP activations and the sliced vocabulary head, against independent oracles.

The sigmoid is checked against float64 numpy; :class:`FastGatedMLP` against mlx-lm's own
MLP modules (Gemma 3's tanh GELU, Llama's SiLU); ``project_rows`` against the plain product.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from kv_batching._fast_mlp import (
    FAST_MLP_MIN_WIDTH,
    FastGatedMLP,
    fast_mlps,
    patch_model_mlps,
    unpatch_model_mlps,
)
from kv_batching._model_forward import HEAD_SLICED_MAX_ROWS, project_rows
from kv_protocol import gated_activation, sigmoid


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-200.0, max_value=200.0, width=32, allow_subnormal=False),
        min_size=1,
        max_size=64,
    )
)
def test_sigmoid_matches_float64(xs: list[float]) -> None:
    got = np.array(sigmoid(mx.array(xs, dtype=mx.float32)), np.float64)
    x = np.array(xs, np.float64)
    want = np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(x) / (1 + np.exp(x)))
    # exp_nonpositive's bound (2.5e-7 + 7.5e-8 |x|) plus a few roundings; tiny tails flush.
    tolerance = 4e-7 + 7.5e-8 * np.abs(x)
    close = np.abs(got - want) <= tolerance * want + 1e-37
    assert close.all(), (x[~close], got[~close], want[~close])


def test_sigmoid_edges() -> None:
    x = mx.array([math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 88.0, -80.0, -104.0])
    got = np.array(sigmoid(x)).tolist()
    assert got[:6] == [1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    assert got[6] == 1.0 and 0 < got[7] < 1e-34 and got[8] == 0.0
    assert np.isnan(np.array(sigmoid(mx.array([math.nan])))).all()


def _mlp(module: str, width: int, seed: int, *, bias: bool = False) -> nn.Module:
    models = importlib.import_module(f"mlx_lm.models.{module}")
    if module == "llama":
        args = models.ModelArgs.from_dict(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "intermediate_size": width,
                "num_attention_heads": 4,
                "rms_norm_eps": 1e-6,
                "vocab_size": 32,
                "mlp_bias": bias,
            }
        )
        mlp: nn.Module = models.MLP(args)
    else:
        mlp = models.MLP(64, width)
    mx.random.seed(seed)
    mlp.update(
        {
            name: {key: mx.random.normal(value.shape) * 0.2 for key, value in child.items()}
            for name, child in mlp.children().items()
        }
    )
    mx.eval(mlp.parameters())
    return mlp


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.mlp = mlp


class _Model(nn.Module):
    """Just decoder layers holding MLPs, enough for ``find_layers``."""

    def __init__(self, mlps: list[nn.Module]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layers = [_Layer(m) for m in mlps]


class _ReluMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.gate_proj = nn.Linear(64, width, bias=False)
        self.up_proj = nn.Linear(64, width, bias=False)
        self.down_proj = nn.Linear(width, 64, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.relu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize(
    ("module", "activation", "variant"),
    [
        ("gemma3_text", "gelu_approx", "plain"),
        ("llama", "silu", "plain"),
        ("llama", "silu", "bias"),
        ("gemma3_text", "gelu_approx", "8-bit"),
    ],
)
def test_swapped_mlp_equals_mlx_lm_module(module: str, activation: str, variant: str) -> None:
    mlp = _mlp(module, FAST_MLP_MIN_WIDTH, seed=3, bias=variant == "bias")
    if variant == "8-bit":
        nn.quantize(mlp, group_size=64, bits=8)
    model = _Model([mlp])
    x = mx.random.normal((2, 7, 64), key=mx.random.key(1)) * 2
    want = mlp(x)
    assert patch_model_mlps(model) == 1
    swapped = model.layers[0].mlp
    assert isinstance(swapped, FastGatedMLP) and swapped.activation == activation
    # Outside the scope it is exactly the module's own call; inside, the same to rounding.
    assert mx.array_equal(swapped(x), want)
    with fast_mlps(swapped):
        got = swapped(x)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-5)
    # A bf16 module computes in bf16: its own call, unchanged.
    mlp16 = _mlp(module, FAST_MLP_MIN_WIDTH, seed=3)
    mlp16.set_dtype(mx.bfloat16)
    x16 = x.astype(mx.bfloat16)
    bf16 = FastGatedMLP(mlp16, activation)
    with fast_mlps(bf16):
        assert mx.array_equal(bf16(x16), mlp16(x16))
    # The weights are counted once, and unpatching restores the very module.
    weights = {"plain": 3, "bias": 6, "8-bit": 9}[variant]
    assert len(_flat(model.parameters())) == weights  # type: ignore[no-untyped-call]
    assert unpatch_model_mlps(model) == 1 and model.layers[0].mlp is mlp


class _OwnWayLinear(nn.Linear):
    """An ``nn.Linear`` that computes up to ``max_rows`` rows its own way (counted here).

    Its own way adds a recognisable offset, so a test sees which product a row got.
    """

    def __init__(self, inner: nn.Linear, max_rows: int, calls: list[int]) -> None:
        nn.Module.__init__(self)
        self.weight = inner.weight
        self.max_rows = max_rows
        self.calls = calls

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows <= self.max_rows:
            self.calls.append(rows)
            return x @ self.weight.T + 1000.0
        return super().__call__(x)


@pytest.mark.parametrize("rows", [1, 4, 5, 12])
def test_a_linear_with_its_own_few_row_product_is_called_for_few_rows(rows: int) -> None:
    """``max_rows`` on an ``nn.Linear`` subclass: its own call up to it, the fused form above."""
    mlp = _mlp("gemma3_text", FAST_MLP_MIN_WIDTH, seed=5)
    plain = {name: getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")}
    x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
    want_plain = mlp(x)
    calls: list[int] = []
    for name, layer in plain.items():
        setattr(mlp, name, _OwnWayLinear(layer, 4, calls))
    want_own = mlp(x)
    model = _Model([mlp])
    assert patch_model_mlps(model) == 1  # probed at 6 rows: the generic gated form
    calls.clear()
    with fast_mlps(model):
        got = model.layers[0].mlp(x)
    want = want_own if rows <= 4 else want_plain
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-3)
    assert calls == ([rows] * 3 if rows <= 4 else [])


def _flat(tree: Any) -> list[tuple[str, Any]]:
    return cast(list[tuple[str, Any]], tree_flatten(tree))


def test_other_activations_narrow_gates_and_other_devices_keep_the_module() -> None:
    relu = _ReluMLP(FAST_MLP_MIN_WIDTH)
    gelu_erf = _mlp("gemma", FAST_MLP_MIN_WIDTH, seed=4)  # nn.gelu (erf), not the tanh form
    narrow = _mlp("llama", FAST_MLP_MIN_WIDTH // 2, seed=5)
    model = _Model([relu, gelu_erf, narrow])
    assert patch_model_mlps(model) == 0
    assert [layer.mlp for layer in model.layers] == [relu, gelu_erf, narrow]
    assert patch_model_mlps(model, min_width=FAST_MLP_MIN_WIDTH // 2) == 1
    assert isinstance(model.layers[2].mlp, FastGatedMLP)
    assert patch_model_mlps(model, min_width=FAST_MLP_MIN_WIDTH // 2) == 1  # idempotent
    unpatch_model_mlps(model)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(min_value=1, max_value=HEAD_SLICED_MAX_ROWS + 9), seed=st.integers(0, 2**16)
)
def test_project_rows_equals_the_plain_product(rows: int, seed: int) -> None:
    key = mx.random.key(seed)
    weight = mx.random.normal((9000, 48), key=key)
    h = mx.random.normal((rows, 48), key=mx.random.split(key)[0])
    got = np.array(project_rows(weight, h))
    want = np.array(h, np.float64) @ np.array(weight, np.float64).T
    assert got.shape == (rows, 9000)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class _RecordingActivation:
    """A ``GatedActivationKernel`` that serves (with the definition) only float32 ``serves``."""

    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.calls: list[str] = []

    def __call__(self, gate: mx.array, up: mx.array, *, activation: str) -> mx.array | None:
        self.calls.append(activation)
        return gated_activation(gate, up, activation) if self.serves else None


@pytest.mark.parametrize(
    ("module", "activation"), [("gemma3_text", "gelu_approx"), ("llama", "silu")]
)
@pytest.mark.parametrize("rows", [1, 40])
def test_the_activation_kernel_in_scope_computes_the_activation(
    module: str, activation: str, rows: int
) -> None:
    mlp = _mlp(module, FAST_MLP_MIN_WIDTH, seed=4)
    model = _Model([mlp])
    assert patch_model_mlps(model) == 1
    swapped = model.layers[0].mlp
    x = mx.random.normal((rows, 1, 64), key=mx.random.key(2))
    with fast_mlps(model):
        compiled = swapped(x)
    serving, declining = _RecordingActivation(True), _RecordingActivation(False)
    with fast_mlps(model, kernel=serving):
        served = swapped(x)
    with fast_mlps(model, kernel=declining):
        declined = swapped(x)
    outside = swapped(x)  # disengaged again: the module's own call
    assert serving.calls == [activation] and declining.calls == [activation]
    # The kernel's values are the definition's; the compiled function's are within rounding.
    np.testing.assert_allclose(np.array(served), np.array(compiled), rtol=1e-5, atol=1e-6)
    assert mx.array_equal(declined, compiled)
    assert mx.array_equal(outside, mlp(x))
