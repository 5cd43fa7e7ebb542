"""Published geometries of real hybrid models, instantiated lazily from mlx-lm's classes.

MLX arrays are lazy, so building a full-size ``Model`` object allocates nothing until its
weights are evaluated: reading the KV layout off it costs no memory.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.nn as nn

__all__ = ["REAL_MODEL_CONFIGS", "lazy_model_from_config", "lazy_model_from_directory"]

#: mlx-lm ``ModelArgs`` of published checkpoints (attention-relevant fields).
REAL_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 24,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
    "gemma-3-27b": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "num_hidden_layers": 62,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "head_dim": 128,
        "num_key_value_heads": 16,
        "vocab_size": 262208,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "command-r7b": {
        "model_type": "cohere2",
        "hidden_size": 4096,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 256000,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
    },
    "olmo-3-7b": {
        "model_type": "olmo3",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": 100278,
        "max_position_embeddings": 65536,
        "sliding_window": 4096,
        "rope_theta": 500000.0,
    },
}


def lazy_model_from_config(config: dict[str, Any]) -> nn.Module:
    """An mlx-lm model object for ``config`` whose weights are never materialised."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    model: nn.Module = module.Model(args)
    return model


def lazy_model_from_directory(path: Path) -> nn.Module:
    """The model object of a local mlx-lm model directory (its config.json), weights not loaded."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not an mlx-lm model directory: no config.json")
    config = json.loads(config_file.read_text())
    if "model_type" not in config:
        raise ValueError(f"{config_file} has no model_type")
    config = config.get("text_config", config) | {"model_type": config["model_type"]}
    return lazy_model_from_config(config)
