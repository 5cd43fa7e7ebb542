"""The oracle: mlx-lm generating one prompt alone with the model's own caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["ReferenceRun", "mlx_lm_greedy"]


@dataclass(frozen=True, kw_only=True)
class ReferenceRun:
    """Tokens mlx-lm generated for one prompt and the KV bytes its caches held at the end."""

    tokens: list[int]
    kv_bytes: int


def mlx_lm_greedy(
    model: nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    prefill_chunk: int = 512,
    stop_tokens: Sequence[int] = (),
) -> ReferenceRun:
    """Greedy-decode ``prompt`` alone through mlx-lm's ``make_prompt_cache`` caches."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    cache = make_prompt_cache(model)
    tokens = list(prompt)
    logits = None
    for start in range(0, len(tokens), prefill_chunk):
        chunk = mx.array([tokens[start : start + prefill_chunk]])
        logits = model(chunk, cache=cache)
        mx.eval(logits, [c.state for c in cache])
    assert logits is not None
    out: list[int] = []
    stops = set(stop_tokens)
    while len(out) < max_tokens:
        token = int(mx.argmax(logits[0, -1]))
        out.append(token)
        if token in stops or len(out) == max_tokens:
            break
        logits = model(mx.array([[token]]), cache=cache)
    mx.eval([c.state for c in cache])
    return ReferenceRun(tokens=out, kv_bytes=sum(int(c.nbytes) for c in cache))
