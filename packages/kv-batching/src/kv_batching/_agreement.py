"""What the ranks of a tensor-parallel engine must agree on inside a step.

Every rank runs the same engine on its shard of the model. Scheduling is deterministic given
the same requests, so the ranks stay in lock step by themselves except where a decision comes
from outside the model's arithmetic: the tokens a step samples (random streams, host-side
masks) and the prefill budget (measured wall time). The engine hands both to a
:class:`RankAgreement`, which returns the leader's choice on every rank.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

__all__ = ["RankAgreement"]


class RankAgreement(Protocol):
    """The leader rank's decisions, the same on every rank of one engine."""

    def tokens(self, tokens: mx.array) -> mx.array:
        """The leader's ``tokens`` (lazy, same shape): what every rank's step emits.

        Called on every rank with its own sampled tokens; the result must still depend on
        them (a follower's forward, with its collectives, runs when its tokens evaluate).
        """
        ...

    def prefill_budget(self, tokens: int) -> int:
        """The leader's prefill budget for this step (each rank passes its own)."""
        ...
