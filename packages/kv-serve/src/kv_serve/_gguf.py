"""GGUF (llama.cpp) Gemma 3 files converted once into an mlx-lm model directory.

MLX's own GGUF reader cannot be used for these files: it fails on Q5_0 tensors and decodes
Q4_K wrong (every odd 32-value sub-block). The ``gguf`` package's numpy dequantization is
right for every type these files hold (F32, Q8_0, Q6_K, Q5_0, Q4_K), so weights are
dequantized with it, renamed onto mlx-lm's ``gemma3_text`` names and saved as safetensors
beside a ``config.json`` and the tokenizer rebuilt from the GGUF metadata. llama.cpp stores
Gemma's RMSNorm weights as ``1 + w`` (mlx-lm adds the 1 itself), so 1 is subtracted; the
embedding is tied; a few facts llama.cpp hard-codes for Gemma 3 and does not write into the
metadata (local RoPE base, sliding pattern, query scale, end-of-turn id) are set here.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from kv_protocol import UnsupportedModelError

from ._extras import require_extra
from ._gguf_quants import GROUP_SIZE, affine_blocks, kernel_codes

__all__ = [
    "GEMMA3_HARD_CODED",
    "convert_gguf",
    "gguf_sha256",
    "gguf_tensor_names",
    "read_gguf_tensor",
]

#: What llama.cpp assumes for Gemma 3 without reading it from the file.
GEMMA3_HARD_CODED: dict[str, Any] = {
    "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "eos_token_id": [1, 106],
}

_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
#: Bump when the converted layout changes, so old caches are not reused.
_FORMAT = 2
#: The file of a ``keep_quantized="dual"`` conversion that holds the kernel's codes.
KERNEL_CODES_FILE = "kv-kernel-codes.safetensors"

Progress = Callable[[str], None]


def _reader(path: Path) -> Any:
    require_extra("gguf")
    import gguf

    return gguf.GGUFReader(str(path))


def gguf_sha256(path: Path) -> str:
    """The file's sha256 (the conversion cache key)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _mlx_name(gguf_name: str) -> tuple[str, bool]:
    """The mlx-lm ``gemma3_text`` name of a GGUF tensor, and whether it is a norm (``1 + w``)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight", False
    if gguf_name == "output_norm.weight":
        return "model.norm.weight", True
    match = _BLOCK.fullmatch(gguf_name)
    if match is not None:
        layer, part = match.groups()
        if part in _NORMS:
            return f"model.layers.{layer}.{_NORMS[part]}.weight", True
        if part in _LINEARS:
            return f"model.layers.{layer}.{_LINEARS[part]}.weight", False
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no gemma3_text counterpart")


def read_gguf_tensor(tensor: Any) -> np.ndarray[Any, Any]:
    """One GGUF tensor dequantized to float32 in row-major (mlx) shape."""
    require_extra("gguf")
    from gguf import quants

    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    values = quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def gguf_tensor_names(path: Path) -> list[str]:
    """Names of the tensors in a GGUF file."""
    return [str(t.name) for t in _reader(path).tensors]


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; kv-serve converts Gemma 3 ('gemma3') "
            "GGUF files (for other models use an mlx-lm model directory)"
        )

    def meta(name: str) -> Any:
        value = _field(reader, f"gemma3.{name}")
        if value is None:
            raise UnsupportedModelError(f"the GGUF file has no gemma3.{name}")
        return value

    tokens = reader.fields["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": int(meta("attention.head_count")),
        "num_key_value_heads": int(meta("attention.head_count_kv")),
        "head_dim": int(meta("attention.key_length")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base")),
        "sliding_window": int(meta("attention.sliding_window")),
        "max_position_embeddings": int(meta("context_length")),
        "vocab_size": len(tokens.data),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "tie_word_embeddings": True,
    }
    config.update(GEMMA3_HARD_CODED)
    return config


def _save_tokenizer(reader: Any, out: Path) -> None:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = GGUF_TOKENIZER_MAPPING["tokenizer"]
    wanted = {f"tokenizer.{key}": name for key, name in fields.items()}
    tokenizer_dict = {
        name: _field(reader, key) for key, name in wanted.items() if key in reader.fields
    }
    backend, _ = convert_gguf_tokenizer("gemma3", tokenizer_dict)
    tokens = tokenizer_dict["tokens"]
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos_id is not None and (add_bos is None or bool(add_bos)):
        # The file asks for BOS before every text: make the tokenizer itself add it, so any
        # consumer (mlx-lm's generate included) encodes prompts the way the model expects.
        bos = str(tokens[int(bos_id)])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, int(bos_id))]
        )

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else str(tokens[int(index)])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = str(template)
    tokenizer.save_pretrained(str(out))


def convert_gguf(
    path: Path,
    cache_dir: Path,
    *,
    dtype: mx.Dtype = mx.float32,
    sha256: str | None = None,
    progress: Progress | None = None,
    keep_quantized: bool | Literal["embedding", "dual"] = False,
) -> Path:
    """Convert a Gemma 3 GGUF into an mlx-lm model directory under ``cache_dir`` (once).

    The directory is keyed by the file's sha256, the dtype and ``keep_quantized``; a finished
    conversion (marked by ``kv-serve.json``) is reused as it is. Returns the directory.

    With ``keep_quantized`` the linear layers and the embedding whose blocks are exactly MLX
    affine groups of 32 (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q4_K``: see
    :mod:`kv_serve._gguf_quants`) stay quantized, with float32 scales, and ``config.json``
    names each one's bits, so mlx-lm loads them as ``QuantizedLinear`` /
    ``QuantizedEmbedding``; other tensors (``Q6_K``, the norms) are dequantized. It needs
    ``dtype`` float32 (the exact scales are float32). ``keep_quantized="embedding"`` keeps
    only the token embedding (Gemma's tied vocabulary head) so, where it is exactly 8- or
    4-bit groups (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q4_K``: what
    ``kv_metal_kernels.CpuQuantizedHead`` reads). ``keep_quantized="dual"`` keeps the
    embedding so too, writes every other linear layer in float32 as ``False`` does, and
    beside them (:data:`KERNEL_CODES_FILE`, ``{module}.codes`` / ``.scales`` / ``.biases``;
    each module's bits and group size in ``kv-serve.json``'s ``kernel_codes``) the same
    layers' blocks in the form the native CPU kernel reads
    (:func:`kv_serve._gguf_quants.kernel_codes`), for products over a few rows.
    """
    if keep_quantized and dtype != mx.float32:
        raise UnsupportedModelError(
            f"a GGUF kept quantized keeps its exact scales in float32: load it with dtype "
            f"float32, not {str(dtype).rsplit('.', 1)[-1]} (or dequantize it)"
        )
    say = progress or (lambda _message: None)
    digest = sha256 or gguf_sha256(path)
    name = str(dtype).rsplit(".", 1)[-1]
    if keep_quantized == "embedding":
        name += "-gguf-embedding-quantized"
    elif keep_quantized == "dual":
        name += "-gguf-dual"
    elif keep_quantized:
        name += "-gguf-quantized"
    out = cache_dir / f"{digest[:16]}-{name}-v{_FORMAT}"
    marker = out / "kv-serve.json"
    if marker.exists():
        return out
    require_extra("gguf")
    say(f"converting {path.name} to an mlx-lm model in {out} (once; about a minute)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # A private work directory renamed into place: concurrent conversions do not collide.
    work = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".partial", dir=cache_dir))
    reader = _reader(path)
    config = _config(reader)
    weights: dict[str, mx.array] = {}
    kept: dict[str, dict[str, int]] = {}
    codes_out: dict[str, mx.array] = {}
    coded: dict[str, dict[str, int]] = {}
    for index, tensor in enumerate(reader.tensors):
        target, is_norm = _mlx_name(str(tensor.name))
        shape = tuple(int(d) for d in reversed(list(tensor.shape)))
        affine = None
        embedding = target == "model.embed_tokens.weight"
        kept_here = keep_quantized is True or (
            keep_quantized in ("embedding", "dual") and embedding
        )
        if kept_here and not is_norm:
            affine = affine_blocks(tensor.tensor_type.name, np.asarray(tensor.data), shape)
            # Only the embedding's bits the CPU's quantized head kernel reads.
            if keep_quantized in ("embedding", "dual") and affine and affine[3] not in (4, 8):
                affine = None
        if affine is not None:
            codes, scales, biases, bits = affine
            module = target.removesuffix(".weight")
            weights[target] = mx.array(codes)
            weights[f"{module}.scales"] = mx.array(scales)
            weights[f"{module}.biases"] = mx.array(biases)
            kept[module] = {"group_size": GROUP_SIZE, "bits": bits}
        else:
            values = read_gguf_tensor(tensor)
            if is_norm:
                values = values - np.float32(1.0)
            weights[target] = mx.array(values).astype(dtype)
        if keep_quantized == "dual" and not is_norm and not embedding and affine is None:
            form = kernel_codes(tensor.tensor_type.name, np.asarray(tensor.data), shape)
            if form is not None:
                module = target.removesuffix(".weight")
                codes, scales, biases, bits, group = form
                codes_out[f"{module}.codes"] = mx.array(codes)
                codes_out[f"{module}.scales"] = mx.array(scales)
                codes_out[f"{module}.biases"] = mx.array(biases)
                coded[module] = {"bits": bits, "group_size": group}
        if index % 40 == 0:
            say(f"  converted {index + 1}/{len(reader.tensors)} tensors")
    if kept:
        # Every kept module named with its bits (they differ: Q8_0 is 8, Q5_0 5, Q4_K 4).
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 8, "mode": "affine", **kept}
    mx.save_safetensors(str(work / "model.safetensors"), weights, metadata={"format": "mlx"})
    if codes_out:
        mx.save_safetensors(str(work / KERNEL_CODES_FILE), codes_out)
    (work / "config.json").write_text(json.dumps(config, indent=2))
    say("  building the tokenizer from the GGUF metadata")
    _save_tokenizer(reader, work)
    (work / "kv-serve.json").write_text(
        json.dumps(
            {
                "source": path.name,
                "sha256": digest,
                "dtype": name,
                "format": _FORMAT,
                "kept_quantized": sorted(kept),
                "kernel_codes": coded,
            }
        )
    )
    try:
        work.rename(out)
    except OSError:
        # Another process finished the same conversion first: keep theirs.
        shutil.rmtree(work, ignore_errors=True)
        if not marker.exists():
            raise
    return out
