"""The oracle: mlx-lm generating one prompt alone, greedily, with its own model and caches.

This is the one greedy reference the engine's tokens are compared with (tests, the demo, the
benchmarks). It uses nothing but the mlx-lm model and mlx-lm caches (``make_prompt_cache``,
or caches the caller built from mlx-lm's, e.g. :func:`kv_testing.stored_kv_caches`), so it
stays independent of the code it checks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["greedy_continue", "mlx_lm_greedy", "mlx_lm_states", "states_close"]


def mlx_lm_greedy(
    model: nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    caches: list[Any] | None = None,
    prefill_chunk: int | None = None,
    stop_tokens: Collection[int] = (),
    allowed: Callable[[Sequence[int]], Collection[int]] | None = None,
) -> list[int]:
    """Greedy tokens of ``model`` for ``prompt`` alone: prefill, then argmax steps.

    ``caches`` default to ``make_prompt_cache(model)``; caches passed in are updated in place
    (read their ``nbytes`` afterwards for the KV mlx-lm held). The prompt goes through the
    model in one pass, or in pieces of ``prefill_chunk`` tokens; a piece that samples no token
    evaluates only the caches, so its logits (the vocabulary head) are never computed.
    Generation stops after ``max_tokens`` tokens or at the first token in ``stop_tokens``
    (which is returned). ``allowed(generated)`` (a constrained decode's oracle) names the
    tokens the next one is taken from: the argmax over those alone.
    """
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
    if caches is None:
        caches = make_prompt_cache(model)
    tokens = list(prompt)
    step = prefill_chunk or len(tokens)
    for start in range(0, len(tokens) - step, step):
        model(mx.array([tokens[start : start + step]]), cache=caches)
        mx.eval([c.state for c in caches])
    last = (len(tokens) - 1) // step * step
    logits = model(mx.array([tokens[last:]]), cache=caches)
    return greedy_continue(
        model, caches, logits, max_tokens, stop_tokens=stop_tokens, allowed=allowed
    )


def greedy_continue(
    model: nn.Module,
    caches: list[Any],
    logits: mx.array,
    max_tokens: int,
    *,
    stop_tokens: Collection[int] = (),
    record: list[mx.array] | None = None,
    allowed: Callable[[Sequence[int]], Collection[int]] | None = None,
) -> list[int]:
    """Greedy tokens from ``logits`` (``(1, T, vocab)``; the last position is sampled) on.

    Each token is fed back through ``model`` with ``caches`` until ``max_tokens`` tokens or a
    token in ``stop_tokens``; the last token is not fed. ``record`` receives the
    ``(1, vocab)`` logits of each token fed (for a comparison of logits step by step).
    ``allowed(generated)``, when given, names the tokens each next one is taken from.
    """
    out: list[int] = []
    while len(out) < max_tokens:
        if allowed is None:
            token = int(mx.argmax(logits[0, -1]))
        else:
            choices = sorted(allowed(out))
            row = logits[0, -1][mx.array(choices, dtype=mx.int32)]
            token = choices[int(mx.argmax(row))]
        out.append(token)
        if token in stop_tokens or len(out) == max_tokens:
            break
        logits = model(mx.array([[token]]), cache=caches)
        if record is not None:
            record.append(logits[0])
    return out


def mlx_lm_states(model: nn.Module, tokens: Sequence[int]) -> list[list[mx.array | None]]:
    """The recurrent state mlx-lm's model holds after ``tokens``: slots per STATE layer.

    The model runs ``tokens`` in one pass on its own ``make_prompt_cache`` caches; the slots of
    each recurrent-state layer's cache come back in layer order (what a state snapshot of
    that prefix must hold).
    """
    from kv_protocol import flatten_caches, layout_from_model

    caches = make_prompt_cache(model)
    forward: Any = model
    mx.eval(forward(mx.array([list(tokens)], dtype=mx.int32), cache=caches))
    flat: list[Any] = flatten_caches(caches)
    return [list(flat[i].cache) for i in layout_from_model(model).state_layer_ids]


def states_close(
    caches: Sequence[Any],
    states: Sequence[Sequence[mx.array | None]],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> bool:
    """Whether state caches (``.cache`` slot lists) hold ``states`` (:func:`mlx_lm_states`)."""
    if len(caches) != len(states):
        return False
    for cache, slots in zip(caches, states, strict=True):
        mine = list(cache.cache)
        if len(mine) != len(slots):
            return False
        for got, want in zip(mine, slots, strict=True):
            if (got is None) != (want is None):
                return False
            close = (
                got is None
                or want is None
                or (got.shape == want.shape and mx.allclose(got, want, rtol=rtol, atol=atol))
            )
            if not close:
                return False
    return True
