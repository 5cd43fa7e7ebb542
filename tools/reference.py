"""Whether a difference from the oracle is a tie: where two greedy continuations first differ.

The oracle itself is :func:`kv_testing.mlx_lm_greedy` (mlx-lm generating one prompt alone
with its own caches); here mlx-lm re-runs a prompt to read the two tokens' logits where its
continuation and another first differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["TIE_ULPS", "Divergence", "first_divergence"]


#: Machine epsilon of the dtypes a model can run in: the spacing of values near 1.
_EPSILON = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
#: A tie is a gap of at most this many units in the last place of the larger logit: the
#: two paths round their many intermediate values differently, so a few ulps apart is
#: still a tie that either side may break its own way.
TIE_ULPS = 4


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where two greedy continuations of one prompt first differ, and whether it is a tie.

    ``gap`` is the reference's logit of its own token minus its logit of the other side's
    token at ``index``; ``tolerance`` is :data:`TIE_ULPS` units in the last place of the
    dtype at the larger logit.
    """

    index: int
    reference_token: int
    other_token: int
    gap: float
    tolerance: float

    @property
    def is_tie(self) -> bool:
        """Whether the two tokens' logits tie within the dtype's precision."""
        return self.gap <= self.tolerance


def first_divergence(
    model: nn.Module,
    prompt: Sequence[int],
    reference: Sequence[int],
    other: Sequence[int],
    *,
    dtype: mx.Dtype,
) -> Divergence | None:
    """Compare ``other`` with the ``reference`` greedy tokens of ``prompt``.

    Returns ``None`` when they agree (one may be a prefix of the other only if both
    stopped). Otherwise mlx-lm re-runs the prompt and the agreed prefix and reads its logits
    of the two tokens at the first difference.
    """
    index = next(
        (i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), None
    )
    if index is None:
        if len(reference) == len(other):
            return None
        index = min(len(reference), len(other))
    if index >= len(reference) or index >= len(other):
        # One side stopped where the other went on: compare the stop with the extra token.
        return Divergence(
            index=index,
            reference_token=reference[index] if index < len(reference) else -1,
            other_token=other[index] if index < len(other) else -1,
            gap=float("inf"),
            tolerance=0.0,
        )
    context = mx.array([list(prompt) + list(reference[:index])])
    logits = model(context, cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    mine, theirs = float(logits[reference[index]]), float(logits[other[index]])
    eps = _EPSILON.get(dtype, 2.0**-23)
    return Divergence(
        index=index,
        reference_token=int(reference[index]),
        other_token=int(other[index]),
        gap=mine - theirs,
        tolerance=TIE_ULPS * eps * max(abs(mine), abs(theirs), 1.0),
    )
