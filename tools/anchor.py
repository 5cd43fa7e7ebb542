"""The model mlx-lm runs as the anchor of a comparison: the same weights, in its fastest form.

On the CPU ``kv_serve.load_model`` keeps a GGUF's 8-bit token embedding (Gemma's tied
vocabulary head) as quantized groups by default, which the engine projects through its
native kernel. mlx-lm would run that head through MLX's own CPU quantized product, several
times slower than float32 (``kv_metal_kernels.CpuQuantizedHead``), so an anchor on that
model would be slowed by our loading choice, not by mlx-lm. :func:`anchor_model` gives
mlx-lm the same values dequantized to float32, as it would load them itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn

__all__ = ["anchor_model"]


def anchor_model(model: nn.Module, name: str | Path, *, dtype: str = "float32") -> Any:
    """``model`` itself, or where its embedding was kept quantized at load, a float twin.

    ``name`` and ``dtype`` are what ``model`` was loaded with (``kv_serve.load_model``).
    """
    from kv_serve import load_model

    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(embedding, nn.QuantizedEmbedding):
        return model
    twin, _ = load_model(name, dtype=dtype, gguf_weights="dequantize")
    return twin
