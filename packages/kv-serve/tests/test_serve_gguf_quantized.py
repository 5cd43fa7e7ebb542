"""GGUF blocks kept quantized: the same values as the ``gguf`` package's.

The oracle is the ``gguf`` package's own dequantization (independent of the mapping): random
blocks of every kept type decode, through ``mx.dequantize``, to exactly its values, and so
do the native CPU kernel's codes of every type it serves (``kernel_codes``, ``Q6_K``
included); on the packaged Gemma 3 270M every kept layer holds the dequantized model's
weights, the whole model a third of the bytes, and greedy decoding gives the dequantized
model's tokens.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from kv_metal_kernels import CpuQuantizedHead
from kv_protocol import UnsupportedModelError
from kv_serve import cli_main, load_model
from kv_serve._gguf_quants import KEPT_TYPES, KERNEL_TYPES, affine_blocks, kernel_codes
from kv_testing import mlx_lm_greedy, save_tiny_model_dir

#: Bytes and values of one block of each type, and where its float16 fields sit.
BLOCKS = {
    "Q8_0": (34, 32, (0,)),
    "Q4_0": (18, 32, (0,)),
    "Q4_1": (20, 32, (0, 2)),
    "Q5_0": (22, 32, (0,)),
    "Q5_1": (24, 32, (0, 2)),
    "Q4_K": (144, 256, (0, 2)),
    "Q6_K": (210, 256, (208,)),
}


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray[Any, Any]:
    size, values, halves = BLOCKS[name]
    rng = np.random.default_rng(seed)
    count = rows * cols // values
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in halves:  # finite float16 scales and minimums
        half = rng.normal(0.0, 0.05, size=count).astype(np.float16)
        raw[:, at : at + 2] = half.view(np.uint8).reshape(count, 2)
    return raw.reshape(rows, -1)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(KEPT_TYPES)),
    rows=st.integers(1, 5),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_kept_blocks_decode_to_the_gguf_packages_values(
    name: str, rows: int, groups: int, seed: int
) -> None:
    cols = groups * BLOCKS[name][1]
    raw = random_blocks(name, rows, cols, seed)
    expected = np.asarray(
        quants.dequantize(raw, getattr(GGMLQuantizationType, name)), dtype=np.float32
    ).reshape(rows, cols)
    kept = affine_blocks(name, raw, (rows, cols))
    assert kept is not None
    codes, scales, biases, bits = kept
    assert bits == KEPT_TYPES[name] and codes.dtype == np.uint32
    got = mx.dequantize(
        mx.array(codes), mx.array(scales), mx.array(biases), group_size=32, bits=bits
    )
    assert np.array_equal(np.array(got), expected)


def test_types_without_an_exact_form_are_not_kept() -> None:
    raw = np.zeros((2, 210), dtype=np.uint8)
    assert affine_blocks("Q6_K", raw, (2, 256)) is None  # groups of 16
    assert affine_blocks("F32", raw, (2, 256)) is None
    assert affine_blocks("Q8_0", np.zeros((1, 34), np.uint8), (1, 32, 1)) is None


def unpacked(codes: np.ndarray[Any, Any], bits: int, rows: int) -> np.ndarray[Any, Any]:
    """The codes as floats, one per value (MLX's little-endian packing, read by numpy)."""
    stream = codes.view(np.uint8).reshape(rows, -1)
    if bits == 8:
        return stream.astype(np.float32)
    return np.stack([stream & 15, stream >> 4], axis=-1).reshape(rows, -1).astype(np.float32)


def test_every_block_type_has_a_kernel_form() -> None:
    assert set(KERNEL_TYPES) == set(BLOCKS)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(BLOCKS)),
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_codes_are_the_gguf_packages_values(
    name: str, rows: int, blocks: int, seed: int
) -> None:
    cols = blocks * BLOCKS[name][1]
    raw = random_blocks(name, rows, cols, seed)
    expected = np.asarray(
        quants.dequantize(raw, getattr(GGMLQuantizationType, name)), dtype=np.float32
    ).reshape(rows, cols)
    form = kernel_codes(name, raw, (rows, cols))
    assert form is not None
    codes, scales, biases, bits, group = form
    assert (bits, group) == KERNEL_TYPES[name] and codes.dtype == np.uint32
    values = unpacked(codes, bits, rows).reshape(rows, cols // group, group)
    got = (values * scales[..., None] + biases[..., None]).reshape(rows, cols)
    assert np.array_equal(got, expected)


def test_shapes_the_kernel_form_does_not_serve() -> None:
    assert kernel_codes("F32", np.zeros((2, 128), np.uint8), (2, 32)) is None
    assert kernel_codes("Q2_K", np.zeros((1, 84), np.uint8), (1, 256)) is None
    assert kernel_codes("Q6_K", np.zeros((1, 210), np.uint8), (2, 128)) is None  # width
    assert kernel_codes("Q8_0", np.zeros((1, 34), np.uint8), (1, 32, 1)) is None  # rank


@pytest.fixture(scope="module")
def both_gemmas() -> tuple[Any, Any, Any]:
    dequantized, tokenizer = load_model("gemma3-270m", gguf_weights="dequantize")
    kept, _ = load_model("gemma3-270m", gguf_weights="keep")
    return dequantized, kept, tokenizer


def _bytes(model: nn.Module) -> int:
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in flat)


def test_gemma_keeps_its_blocks_with_the_same_values(both_gemmas: tuple[Any, Any, Any]) -> None:
    dequantized, kept, _ = both_gemmas
    inner, reference = kept.model, dequantized.model
    assert isinstance(inner.embed_tokens, nn.QuantizedEmbedding)  # Q8_0
    assert inner.embed_tokens.bits == 8
    layer, plain = inner.layers[0], reference.layers[0]
    bits = {
        "q_proj": layer.self_attn.q_proj.bits,  # Q5_0
        "v_proj": layer.self_attn.v_proj.bits,  # Q8_0
        "o_proj": layer.self_attn.o_proj.bits,  # Q4_K
    }
    assert bits == {"q_proj": 5, "v_proj": 8, "o_proj": 4}
    assert isinstance(layer.mlp.down_proj, nn.Linear)  # Q6_K: dequantized
    for mine, theirs in (
        (inner.embed_tokens, reference.embed_tokens),
        (layer.self_attn.q_proj, plain.self_attn.q_proj),
        (layer.self_attn.o_proj, plain.self_attn.o_proj),
        (layer.mlp.gate_proj, plain.mlp.gate_proj),
    ):
        values = mx.dequantize(
            mine.weight, mine.scales, mine.biases, group_size=mine.group_size, bits=mine.bits
        )
        assert mx.array_equal(values, theirs.weight)
    assert _bytes(kept) < 0.4 * _bytes(dequantized)


def test_gemma_kept_quantized_decodes_the_same_tokens(both_gemmas: tuple[Any, Any, Any]) -> None:
    dequantized, kept, tokenizer = both_gemmas
    for text in ("The capital of France is", "Water boils at"):
        prompt = [int(t) for t in tokenizer.encode(text)]
        assert mlx_lm_greedy(kept, prompt, 8) == mlx_lm_greedy(dequantized, prompt, 8)


def test_gemma_keeps_only_its_embedding_for_the_native_head(
    both_gemmas: tuple[Any, Any, Any], gemma: tuple[Any, Any]
) -> None:
    """``"embedding"``: the Q8_0 table as 8-bit groups (same values), every other layer float.

    ``"auto"`` (the session's ``gemma``) chooses it on the CPU where the kernel builds.
    """
    dequantized, _, tokenizer = both_gemmas
    model, _ = load_model("gemma3-270m", gguf_weights="embedding")
    table = model.model.embed_tokens
    assert isinstance(table, nn.QuantizedEmbedding) and table.bits == 8
    values = mx.dequantize(
        table.weight, table.scales, table.biases, group_size=table.group_size, bits=8
    )
    assert mx.array_equal(values, dequantized.model.embed_tokens.weight)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.Linear and type(layer.mlp.gate_proj) is nn.Linear
    saved = _bytes(dequantized) - _bytes(model)
    assert saved > 400 * 2**20  # 640 MiB of float32 table against 170 MiB of groups
    if CpuQuantizedHead().library.handle is not None:
        assert isinstance(gemma[0].model.embed_tokens, nn.QuantizedEmbedding)
    prompt = [int(t) for t in tokenizer.encode("The capital of France is")]
    assert mlx_lm_greedy(model, prompt, 6) == mlx_lm_greedy(dequantized, prompt, 6)


def test_bad_gguf_weight_choices_are_refused(tmp_path: Any) -> None:
    with pytest.raises(UnsupportedModelError, match="gguf_weights must be one of"):
        load_model("gemma3-270m", gguf_weights="yes")
    with pytest.raises(UnsupportedModelError, match="give one of them"):
        load_model("gemma3-270m", gguf_weights="keep", weights_bits=8)
    with pytest.raises(UnsupportedModelError, match="'embedding' keeps the GGUF's own"):
        load_model("gemma3-270m", gguf_weights="embedding", weights_bits=4)
    with pytest.raises(UnsupportedModelError, match="exact scales in float32"):
        load_model("gemma3-270m", gguf_weights="embedding", dtype="bfloat16")
    with pytest.raises(UnsupportedModelError, match="exact scales in float32"):
        load_model("gemma3-270m", gguf_weights="keep", dtype="bfloat16")
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    with pytest.raises(UnsupportedModelError, match="is for GGUF files"):
        load_model(model_dir, gguf_weights="keep")
    with pytest.raises(UnsupportedModelError, match="'embedding' is for GGUF files"):
        load_model(model_dir, gguf_weights="embedding")
    argv = ["generate", "--model", str(model_dir), "--prompt", "x"]
    for kept in ("keep", "embedding"):
        with pytest.raises(SystemExit) as stopped:
            cli_main([*argv, "--gguf-weights", kept, "--weights-bits", "8"])
        assert stopped.value.code == 2
