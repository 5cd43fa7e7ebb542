"""The host side of structured output: the step's constrained rows' masks, in one buffer."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kv_protocol import TokenConstraint, mask_words

from ._sampling import TokenMasks

__all__ = ["collect_token_masks"]


def collect_token_masks(
    constraints: Sequence[TokenConstraint | None], vocab: int
) -> TokenMasks | None:
    """The masks of the rows that have a constraint, or ``None`` when no row has one.

    ``constraints`` has one entry per batch row; each constraint writes its row of one
    zeroed host buffer (``mask_words(vocab)`` words per row), copied to MLX once.
    """
    constrained = [(b, c) for b, c in enumerate(constraints) if c is not None]
    if not constrained:
        return None
    words = mask_words(vocab)
    buffer = memoryview(bytearray(4 * words * len(constrained))).cast("I")
    for i, (_, constraint) in enumerate(constrained):
        constraint.fill_next_mask(buffer[i * words : (i + 1) * words])
    # MLX copies any buffer-protocol object; its stub names only DLPack and sequences.
    packed = mx.array(buffer).reshape(len(constrained), words)  # type: ignore[arg-type]
    return TokenMasks(rows=tuple(b for b, _ in constrained), packed=packed)
