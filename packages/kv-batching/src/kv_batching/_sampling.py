"""Sampling the next tokens: greedy, temperature and top-p, per-request keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

__all__ = ["Sampler", "SamplingRow", "sample_top_p", "token_key"]


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


@dataclass(frozen=True, kw_only=True)
class SamplingRow:
    """How one row of a batch samples.

    ``temperature == 0`` is greedy; ``seed`` gives the row its own stream (its
    ``generated``-th token's key is :func:`token_key`).
    """

    temperature: float
    top_p: float
    seed: int | None
    generated: int


class Sampler:
    """Turns a batch's last-position logits into tokens, one :class:`SamplingRow` per row.

    Rows without a seed draw from the sampler's own stream (seeded once); a step that is
    rolled back puts the stream back with :meth:`restore` so a retry samples the same.
    """

    def __init__(self, seed: int) -> None:
        self._key = mx.random.key(seed)

    def save(self) -> mx.array:
        """The stream's state now (for :meth:`restore`)."""
        return self._key

    def restore(self, saved: mx.array) -> None:
        """Put the stream back where :meth:`save` found it."""
        self._key = saved

    def sample(self, logits: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
        """``(B,)`` tokens (lazy) for ``(B, vocab)`` logits."""
        greedy = mx.argmax(logits, axis=-1)
        if all(r.temperature == 0.0 for r in rows):
            return greedy
        self._key, key = mx.random.split(self._key)
        sampled = sample_top_p(
            logits,
            [r.temperature if r.temperature > 0 else 1.0 for r in rows],
            [r.top_p for r in rows],
            key,
        )
        if any(r.seed is not None and r.temperature > 0 for r in rows):
            picked = [
                sample_top_p(
                    logits[i : i + 1], [r.temperature], [r.top_p], token_key(r.seed, r.generated)
                )[0]
                if r.seed is not None and r.temperature > 0
                else sampled[i]
                for i, r in enumerate(rows)
            ]
            sampled = mx.stack(picked)
        use = mx.array([r.temperature > 0 for r in rows])
        return mx.where(use, sampled, greedy)
