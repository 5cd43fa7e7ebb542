"""Tiny random-weight models of real hybrid architectures, built from mlx-lm's own classes.

Nothing is downloaded: each builder instantiates the architecture's ``Model`` with a small
configuration and random weights. Used by the tests, the demo and the benchmarks.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

__all__ = ["ARCHITECTURES", "build_tiny_model", "tiny_model_config"]

#: Architectures the builders know, mapped to their mlx-lm module names.
ARCHITECTURES = ("gpt_oss", "gemma3_text", "cohere2", "olmo3", "llama")


def tiny_model_config(
    arch: str, *, window: int = 8, num_layers: int = 4, vocab_size: int = 256, **overrides: Any
) -> dict[str, Any]:
    """The keyword arguments of the architecture's ``ModelArgs`` for a tiny instance."""
    common: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
    }
    if arch == "gpt_oss":
        common.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=window,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ],
        )
    elif arch == "gemma3_text":
        common.update(
            sliding_window=window,
            sliding_window_pattern=3,
            query_pre_attn_scalar=16,
            rms_norm_eps=1e-6,
        )
    elif arch == "cohere2":
        common.update(sliding_window=window, sliding_window_pattern=4, layer_norm_eps=1e-5)
    elif arch == "olmo3":
        common.update(
            sliding_window=window,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_theta=10000.0,
        )
    elif arch == "llama":
        common.update(
            rms_norm_eps=1e-6,
            sliding_window=window,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ],
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")
    common.update(overrides)
    return common


def build_tiny_model(
    arch: str,
    *,
    window: int = 8,
    num_layers: int = 4,
    vocab_size: int = 256,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    **overrides: Any,
) -> nn.Module:
    """A tiny random-weight mlx-lm model of ``arch`` in ``dtype`` (fp32 by default)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = tiny_model_config(
        arch, window=window, num_layers=num_layers, vocab_size=vocab_size, **overrides
    )
    mx.random.seed(seed)
    model: nn.Module = module.Model(module.ModelArgs(**config))
    # Small weights keep logits well spread so greedy tokens are not decided by rounding.
    params = tree_map(
        lambda p: (
            (mx.random.normal(p.shape) * 0.2).astype(dtype)
            if mx.issubdtype(p.dtype, mx.floating)
            else p
        ),
        model.parameters(),
    )
    model.update(params)
    mx.eval(model.parameters())
    return model
