"""Sampling the next tokens: per-request keys, temperature and top-p."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

__all__ = ["sample_top_p", "token_key"]


def token_key(seed: int, index: int) -> mx.array:
    """The random key of the ``index``-th generated token of a request seeded ``seed``.

    A pure function of both (the ``index``-th of ``index + 1`` keys split from the seed's
    key), so a rolled-back or re-prefilled step samples the same token again.
    """
    return mx.random.split(mx.random.key(seed), index + 1)[index]


def sample_top_p(
    logits: mx.array, temperatures: Sequence[float], top_ps: Sequence[float], key: mx.array
) -> mx.array:
    """Temperature + nucleus sampling, one row per request, in one graph.

    Row ``b`` keeps the smallest set of most likely tokens whose probability reaches
    ``top_ps[b]`` (the most likely token always stays) and samples from it.
    """
    scaled = logits.astype(mx.float32) / mx.array(list(temperatures), dtype=mx.float32)[:, None]
    order = mx.argsort(-scaled, axis=-1)
    ranked = mx.take_along_axis(scaled, order, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs
    keep = before < mx.array(list(top_ps), dtype=mx.float32)[:, None]
    masked = mx.where(keep, ranked, mx.array(-mx.inf, dtype=mx.float32))
    choice = mx.random.categorical(masked, key=key)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
