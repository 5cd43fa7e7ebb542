"""Linear layers that read a GGUF's codes through the native CPU kernel for few rows.

Oracles: ``nn.Linear`` over the same float32 weights (a ``KernelLinear``'s product at every
row count, to float rounding) and mlx-lm's greedy tokens on the float32 model (the
``"dual"`` model decodes the same tokens). The codes themselves are checked against the
``gguf`` package in ``test_serve_gguf_quantized.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching import ModelSurgery
from kv_metal_kernels import CpuQuantizedHead
from kv_protocol import UnsupportedModelError
from kv_serve import load_model
from kv_serve._gguf import KERNEL_CODES_FILE
from kv_serve._kernel_linears import (
    KERNEL_MAX_ROWS,
    KernelCodes,
    KernelLinear,
    SiblingRows,
    attach_kernel_codes,
    kernel_max_rows,
    linear_kernel,
)
from kv_testing import mlx_lm_greedy, save_tiny_model_dir

needs_kernel = pytest.mark.skipif(
    CpuQuantizedHead().library.handle is None or mx.default_device().type != mx.cpu,
    reason="the native CPU kernel does not build here",
)


class CountingProjection:
    """A kernel projection that counts its calls and the rows it was given."""

    def __init__(self, projection: Any) -> None:
        self.projection = projection
        self.rows: list[int] = []

    def __call__(self, rows: mx.array) -> mx.array:
        self.rows.append(rows.size // rows.shape[-1])
        out: mx.array = self.projection(rows)
        return out


def _quantized_layer(
    out_dims: int, in_dims: int, bits: int, with_bias: bool, seed: int
) -> tuple[nn.Linear, CountingProjection]:
    """A float ``nn.Linear`` holding exactly the values of ``bits``-bit groups, and its codes."""
    key = mx.random.key(seed)
    weight = mx.random.normal((out_dims, in_dims), key=key) * 0.1
    codes, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
    layer = nn.Linear(in_dims, out_dims, bias=with_bias)
    layer.weight = mx.dequantize(codes, scales, biases, group_size=32, bits=bits)
    if with_bias:
        layer.bias = mx.random.normal((out_dims,), key=mx.random.split(key)[0])
    projection = linear_kernel().prepare(codes, scales, biases, group_size=32, bits=bits)
    assert projection is not None
    return layer, CountingProjection(projection)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    out_dims=st.integers(1, 40),
    groups=st.integers(1, 4),
    bits=st.sampled_from([4, 8]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_linear_is_nn_linear_of_the_same_values(
    lead: list[int], out_dims: int, groups: int, bits: int, with_bias: bool, seed: int
) -> None:
    layer, projection = _quantized_layer(out_dims, 32 * groups, bits, with_bias, seed)
    mine = KernelLinear(layer.weight, layer.get("bias"), projection, max_rows=6)
    x = mx.random.normal((*lead, 32 * groups), key=mx.random.key(seed + 1))
    expected = layer(x)
    got = mine(x)
    assert got.shape == expected.shape and got.dtype == mx.float32
    scale = float(cast(float, mx.abs(expected).max().item())) + 1e-6
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    rows = int(np.prod(lead))
    assert projection.rows == ([rows] if rows <= 6 else [])
    half = x.astype(mx.float16)  # another dtype: nn.Linear's own product
    assert mx.array_equal(mine(half), layer(half))
    assert projection.rows == ([rows] if rows <= 6 else [])


@needs_kernel
def test_kernel_linear_is_an_nn_linear_to_whoever_inspects_it() -> None:
    layer, projection = _quantized_layer(8, 64, 8, True, 3)
    mine = KernelLinear(layer.weight, layer["bias"], projection)
    assert isinstance(mine, nn.Linear) and mine.max_rows == KERNEL_MAX_ROWS
    assert sorted(mine.keys()) == ["bias", "weight"]  # no codes among the parameters
    assert mx.array_equal(mine.weight, layer.weight)


def test_a_directory_without_codes_replaces_nothing(tmp_path: Path) -> None:
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    model, _ = load_model(model_dir)
    assert attach_kernel_codes(model, model_dir, CpuQuantizedHead()) == 0
    assert not any(isinstance(m, KernelLinear) for _, m in model.named_modules())


@pytest.fixture(scope="module")
def dual_gemma() -> tuple[Any, Path]:
    from kv_serve import default_cache_dir

    model, _ = load_model("gemma3-270m", gguf_weights="dual")
    [directory] = [
        p
        for p in default_cache_dir().iterdir()
        if p.name.endswith("-gguf-dual-v2") and (p / KERNEL_CODES_FILE).exists()
    ]
    return model, directory


@needs_kernel
def test_dual_gemma_reads_codes_for_every_decoder_linear(
    dual_gemma: tuple[Any, Path], gemma_dense: tuple[Any, Any]
) -> None:
    model, directory = dual_gemma
    dense = gemma_dense[0]
    described = json.loads((directory / "kv-serve.json").read_text())["kernel_codes"]
    layers = model.model.layers
    assert len(described) == 7 * len(layers)
    # Q5_0 widened to 8 bits, Q4_K 4 bits, Q6_K 8 bits in groups of 16.
    assert described["model.layers.0.self_attn.q_proj"] == {"bits": 8, "group_size": 32}
    assert described["model.layers.0.self_attn.o_proj"] == {"bits": 4, "group_size": 32}
    assert described["model.layers.0.mlp.down_proj"] == {"bits": 8, "group_size": 16}
    linears = [m for _, m in model.named_modules() if isinstance(m, KernelLinear)]
    assert len(linears) == 7 * len(layers)
    # The linear kernel takes prompt chunks too; the head's kernel decode steps only.
    limit = kernel_max_rows(linear_kernel())
    assert all(m.max_rows == limit for m in linears)
    assert kernel_max_rows(CpuQuantizedHead()) == KERNEL_MAX_ROWS
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    for mine, theirs in (
        (layers[0].self_attn.q_proj, dense.model.layers[0].self_attn.q_proj),
        (layers[5].mlp.down_proj, dense.model.layers[5].mlp.down_proj),  # Q6_K
        (layers[2].mlp.down_proj, dense.model.layers[2].mlp.down_proj),  # Q4_K
    ):
        assert mx.array_equal(mine.weight, theirs.weight)
        for rows in (1, 5, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 3, 300):
            x = mx.random.normal((rows, theirs.weight.shape[1]), key=mx.random.key(rows))
            expected = theirs(x)
            scale = float(cast(float, mx.abs(expected).max().item()))
            assert mx.allclose(mine(x), expected, rtol=1e-5, atol=1e-5 * scale)


@needs_kernel
def test_dual_gemma_decodes_the_float_models_tokens(
    dual_gemma: tuple[Any, Path], gemma_dense: tuple[Any, Any]
) -> None:
    model, _ = dual_gemma
    dense, tokenizer = gemma_dense
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = [int(t) for t in tokenizer.encode(text)]
        assert mlx_lm_greedy(model, prompt, 12) == mlx_lm_greedy(dense, prompt, 12)


@needs_kernel
def test_kernel_codes_uninstall_to_plain_linears_of_the_same_weights(
    dual_gemma: tuple[Any, Path],
) -> None:
    model, directory = dual_gemma
    prompt = [2, 651, 6037, 576, 6081, 603]
    want = mlx_lm_greedy(model, prompt, 8)
    coded = {n: m for n, m in model.named_modules() if isinstance(m, KernelLinear)}
    change = KernelCodes(directory, linear_kernel())
    report = ModelSurgery(model).install(change)  # what load_model did counts as installed
    assert (report.installed, report.reason) == (len(coded), None)
    assert change.uninstall(model) == len(coded)
    modules = dict(model.named_modules())
    for name, layer in coded.items():
        assert type(modules[name]) is nn.Linear and modules[name].weight is layer.weight
    try:
        assert mlx_lm_greedy(model, prompt, 8) == want
    finally:
        report = ModelSurgery(model).install(KernelCodes(directory, linear_kernel()))
        assert report.installed == len(coded)


def test_dual_is_refused_where_keep_is(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'dual' keeps the GGUF's own"):
        load_model("gemma3-270m", gguf_weights="dual", weights_bits=8)
    with pytest.raises(UnsupportedModelError, match="exact scales in float32"):
        load_model("gemma3-270m", gguf_weights="dual", dtype="bfloat16")
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    with pytest.raises(UnsupportedModelError, match="'dual' is for GGUF files"):
        load_model(model_dir, gguf_weights="dual")


class _Product:
    """A projection ``x @ W.T`` that counts the calls it computed."""

    def __init__(self, weight: mx.array) -> None:
        self.weight = weight
        self.calls = 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        return x @ self.weight.T


@settings(max_examples=60, deadline=None)
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    calls=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=30),
    seed=st.integers(0, 2**16),
)
def test_siblings_take_their_columns_of_one_product_and_nothing_else(
    widths: list[int], calls: list[tuple[int, int]], seed: int
) -> None:
    weight = mx.random.normal((sum(widths), 8), key=mx.random.key(seed))
    bounds: list[tuple[int, int]] = []
    for width in widths:
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + width))
    fused = _Product(weight)
    parts = [_Product(weight[a:b]) for a, b in bounds]
    rows = SiblingRows(fused, parts, bounds)
    inputs = [mx.random.normal((3, 8), key=mx.random.key(seed + 1 + i)) for i in range(3)]
    # Any order of calls on any inputs: each is its own rows' product.
    for sibling, which in calls:
        sibling %= len(widths)
        x = inputs[which]
        a, b = bounds[sibling]
        assert mx.allclose(rows.project(sibling, x), x @ weight[a:b].T, atol=1e-5)
    # A forward that calls every sibling in order on one input computes one product while
    # they are together; once apart, each its own.
    before = fused.calls, sum(p.calls for p in parts)
    x = mx.random.normal((3, 8), key=mx.random.key(seed + 9))
    for sibling in range(len(widths)):
        rows.project(sibling, x)
    after = fused.calls, sum(p.calls for p in parts)
    if rows.together:
        assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    else:
        assert (after[0] - before[0], after[1] - before[1]) == (0, len(widths))


def test_siblings_a_forward_skips_part_ways_for_good() -> None:
    weight = mx.random.normal((6, 4), key=mx.random.key(1))
    fused = _Product(weight)
    parts = [_Product(weight[:2]), _Product(weight[2:])]
    rows = SiblingRows(fused, parts, [(0, 2), (2, 6)])
    x, y = mx.ones((1, 4)), mx.zeros((1, 4))
    rows.project(0, x)
    rows.project(0, x)  # the same input again: the same product
    assert (fused.calls, rows.together) == (1, True)
    rows.project(0, y)  # sibling 1 never took x's product: a forward that skips it
    assert not rows.together and (fused.calls, parts[0].calls) == (1, 1)
    rows.project(1, y)
    assert (fused.calls, parts[1].calls) == (1, 1)
    with pytest.raises(ValueError, match="at least two"):
        SiblingRows(fused, parts[:1], [(0, 2)])


@needs_kernel
def test_dual_gemma_siblings_share_one_product_of_their_own_bits(
    dual_gemma: tuple[Any, Path],
) -> None:
    model, directory = dual_gemma
    arrays = cast(dict[str, mx.array], mx.load(str(directory / KERNEL_CODES_FILE)))
    layer = model.model.layers[4]
    modules = {
        "self_attn": ("q_proj", "k_proj", "v_proj"),
        "mlp": ("gate_proj", "up_proj"),
    }
    for parent, names in modules.items():
        x = mx.random.normal((5, 640), key=mx.random.key(len(names)))
        for name in names:
            mine = getattr(getattr(layer, parent), name)
            prefix = f"model.layers.4.{parent}.{name}"
            form = json.loads((directory / "kv-serve.json").read_text())["kernel_codes"][prefix]
            alone = linear_kernel().prepare(
                arrays[f"{prefix}.codes"],
                arrays[f"{prefix}.scales"],
                arrays[f"{prefix}.biases"],
                group_size=form["group_size"],
                bits=form["bits"],
            )
            assert alone is not None
            # The sibling's columns of the stacked product: the same bits as its own codes.
            assert mx.array_equal(mine(x), alone(x))
            assert mine.codes_nbytes == getattr(alone, "nbytes", None)
        first = getattr(getattr(layer, parent), names[0])
        assert first._projection._rows.together


_RESIDENT = """
import json
from kv_serve import load_fast_blas
load_fast_blas()
import mlx.core as mx
from mlx.utils import tree_flatten
from kv_serve import load_model
from kv_serve._kernel_linears import KernelLinear
from kv_serve._load import resident_parameters
model, _ = load_model("gemma3-270m")
kernel_weights = sum(
    m.weight.nbytes for _, m in model.named_modules() if isinstance(m, KernelLinear)
)
parameters = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
resident = sum(v.nbytes for v in resident_parameters(model))
print(json.dumps({"active": mx.get_active_memory(), "kernel_weights": kernel_weights,
                  "parameters": parameters, "resident": resident}))
"""


@needs_kernel
def test_a_coded_model_holds_its_codes_not_the_float_weights_they_replace() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _RESIDENT], capture_output=True, text=True, check=True, timeout=600
    )
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    # Every kernel layer's float32 weight is left unread (about 400 MB for Gemma 3 270M).
    assert sizes["resident"] == sizes["parameters"] - sizes["kernel_weights"]
    assert sizes["kernel_weights"] > 300 * 2**20
    # What the process holds after loading: the resident parameters and the codes, not the
    # float32 weights (their bytes would put it past the parameters' total).
    assert sizes["active"] < sizes["parameters"] - sizes["kernel_weights"] // 2


@needs_kernel
def test_a_coded_layer_s_float_weight_is_still_read_where_it_is_used(
    dual_gemma: tuple[Any, Path], gemma_dense: tuple[Any, Any]
) -> None:
    model, _ = dual_gemma
    dense = gemma_dense[0]
    mine, theirs = model.model.layers[3].mlp.up_proj, dense.model.layers[3].mlp.up_proj
    x = mx.random.normal((2, 640), key=mx.random.key(4)).astype(mx.float16)
    # Another dtype is nn.Linear's own product of the float32 weight, read from the file.
    assert mx.array_equal(mine(x), theirs(x))
