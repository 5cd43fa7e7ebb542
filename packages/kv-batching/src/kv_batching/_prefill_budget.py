"""How many prompt tokens one engine step may prefill beside the running requests' decode.

A step decodes every running request first, then prefills. A long prompt prefilled in big
chunks makes each of those steps long, and every running request waits for it before its
next token. With a stall bound, a step's prefill is sized from what the engine measured: the
decode it just ran and the recent cost of a prompt token, so the step takes about
``1 + prefill_stall`` times its decode alone, whatever the model, machine or context length.
"""

from __future__ import annotations

import math

from kv_protocol import check_int

__all__ = ["PrefillBudget"]


class PrefillBudget:
    """The prompt tokens a step may prefill.

    ``prefill_stall=None``: always ``prefill_chunk``. With a positive ``prefill_stall``,
    while requests decode a step may spend about ``prefill_stall`` times the decode's
    seconds on prefill: ``prefill_stall * decode_seconds / seconds_per_token``, where
    ``seconds_per_token`` is a running average of the measured prefill chunks (``smoothing``
    weighs the newest). The budget is at least ``min_chunk`` (a prompt always progresses;
    also the budget before any chunk was measured) and at most ``prefill_chunk``. A step
    with nothing decoding gets ``prefill_chunk``: nobody waits on it.
    """

    def __init__(
        self,
        prefill_chunk: int,
        *,
        prefill_stall: float | None = None,
        min_chunk: int = 16,
        smoothing: float = 0.5,
    ) -> None:
        self.prefill_chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
        self.min_chunk = min(check_int(min_chunk, "min_chunk", minimum=1), self.prefill_chunk)
        if prefill_stall is not None:
            prefill_stall = _positive_finite(prefill_stall, "prefill_stall")
        self.prefill_stall = prefill_stall
        smoothing = _positive_finite(smoothing, "smoothing")
        if smoothing > 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        #: Running average of the prefill seconds per prompt token (``None`` until measured).
        self.seconds_per_token: float | None = None

    def tokens(self, decode_seconds: float | None) -> int:
        """The step's prefill budget; ``decode_seconds``: its decode's time (``None``: none)."""
        if self.prefill_stall is None or decode_seconds is None:
            return self.prefill_chunk
        per_token = self.seconds_per_token
        if per_token is None:
            return self.min_chunk
        if per_token <= 0:  # measured as free: nothing to bound
            return self.prefill_chunk
        fits = self.prefill_stall * max(0.0, decode_seconds) / per_token
        if not math.isfinite(fits):
            return self.prefill_chunk
        return max(self.min_chunk, min(self.prefill_chunk, int(fits)))

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Account one prefill chunk of ``tokens`` prompt tokens that took ``seconds``."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        sample = seconds / tokens
        previous = self.seconds_per_token
        self.seconds_per_token = (
            sample
            if previous is None
            else self.smoothing * sample + (1 - self.smoothing) * previous
        )


def _positive_finite(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)
