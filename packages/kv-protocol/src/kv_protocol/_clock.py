"""The one clock of evaluation that happens while a forward is being built."""

from __future__ import annotations

__all__ = ["EVALUATION_CLOCK", "EvaluationClock"]


class EvaluationClock:
    """Seconds spent evaluating MLX work, or in a native kernel, inside a forward's building.

    MLX is lazy: a forward's graph is built on the host and evaluated afterwards, so an
    engine splits a step into graph building (host) and the wait for evaluation (device).
    A kernel that evaluates its inputs and computes on the spot (the CPU's native quantized
    products and paged attention) does device work while the graph is built; it adds those
    seconds here, and the engine moves them from host to device time.
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        """Count ``seconds`` of evaluation."""
        self.seconds += seconds

    def take(self) -> float:
        """The seconds counted since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


#: The process's clock: the kernels add to it, engines take from it after each forward.
EVALUATION_CLOCK = EvaluationClock()
