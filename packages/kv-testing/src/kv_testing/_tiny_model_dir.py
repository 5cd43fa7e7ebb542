"""A tiny random-weight model saved as an mlx-lm model directory, with the tiny tokenizer.

``config.json`` + ``model.safetensors`` + the tokenizer files (``chat_template.jinja``
included), so anything that loads a local mlx-lm model (``mlx_lm.load``,
``kv_serve.load_model``, ``kv-serve serve --model DIR``, ``mlx_lm.server``) loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ._mlx_lm_zoo import ZOO, build_zoo_model, zoo_config
from ._tiny_models import build_tiny_model, tiny_model_config
from ._tiny_tokenizer import build_tiny_tokenizer

__all__ = ["save_tiny_model_dir", "save_zoo_model_dir"]


def save_tiny_model_dir(
    path: str | Path,
    arch: str = "gemma3_text",
    *,
    window: int = 8,
    num_layers: int = 4,
    seed: int = 0,
    chat_template: bool = True,
    tools: bool = False,
    harmony: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny ``arch`` model (fp32, random weights from ``seed``) into ``path``.

    Its vocabulary is the tiny tokenizer's; ``eos_token_id`` lists the tokenizer's end ids.
    With ``tools``, its chat template is the tool-calling one (``TINY_TOOL_CHAT_TEMPLATE``),
    which ``mlx_lm.load`` reads as ``json_tools``; with ``harmony``, gpt-oss's harmony format
    (``TINY_HARMONY_CHAT_TEMPLATE``).
    ``overrides`` change the architecture's ``ModelArgs`` (``head_dim=64``, say). Returns the
    directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(chat_template=chat_template, tools=tools, harmony=harmony)
    vocab = len(tokenizer)
    model = build_tiny_model(
        arch, window=window, num_layers=num_layers, vocab_size=vocab, seed=seed, **overrides
    )
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = tiny_model_config(
        arch, window=window, num_layers=num_layers, vocab_size=vocab, **overrides
    )
    config["eos_token_id"] = sorted(int(i) for i in tokenizer.eos_token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer._tokenizer.save_pretrained(str(out))
    return out


def save_zoo_model_dir(path: str | Path, name: str, *, seed: int = 0) -> Path:
    """Write zoo architecture ``name`` with the tiny tokenizer into ``path``.

    The directory is laid out as :func:`save_tiny_model_dir` lays it out; ``name`` is a
    ``kv_testing.ZOO`` entry, its weights ``build_zoo_model(name, seed=seed,
    vocab_size=len(tokenizer))``'s (fp32). Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    model = build_zoo_model(name, seed=seed, vocab_size=vocab)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = zoo_config(name)
    inner = config["text_config"] if ZOO[name].text_config else config
    inner["vocab_size"] = vocab
    config["eos_token_id"] = sorted(int(i) for i in tokenizer.eos_token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer._tokenizer.save_pretrained(str(out))
    return out
