"""The update phase of a step: what a request wrote is committed, its token emitted.

Every token a step produces, by a plain decode row, a verification, a prefill chunk's last
position or a fork, reaches the request through :meth:`StepOutputs.emit`, which also decides
whether the request finishes (a stop token, a grammar that completed, ``max_tokens``).
"""

from __future__ import annotations

from ._engine_core import EngineCore
from ._requests import EngineRequest
from ._sampling_params import TokenLogprob
from ._snapshot_policy import SnapshotPolicy
from ._speculative import SpeculationConfig

__all__ = ["StepOutputs"]


class StepOutputs:
    """Emits a step's tokens and commits what the step wrote.

    ``speculation`` (the engine's config, ``None`` without speculative decoding) lets each
    token feed the request's acceptance record; ``snapshots`` keeps state snapshots at the
    boundaries a decode step reaches.
    """

    def __init__(
        self,
        core: EngineCore,
        *,
        speculation: SpeculationConfig | None,
        snapshots: SnapshotPolicy | None,
    ) -> None:
        self._core = core
        self._speculation = speculation
        self._snapshots = snapshots

    def emit(
        self,
        request: EngineRequest,
        token: int,
        produced: dict[int, list[int]],
        logprob: TokenLogprob | None = None,
    ) -> None:
        """Append ``token`` to ``request`` (and to ``produced``); finish it where it ends."""
        request.generated.append(token)
        if request.speculation is not None and self._speculation is not None:
            request.speculation.observe(token, self._speculation)
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        produced.setdefault(request.rid, []).append(token)
        complete = False
        constraint = request.constraint
        scheduler = self._core.scheduler
        if constraint is not None and token not in request.stop_tokens:
            try:
                constraint.accept_token(token)
                complete = constraint.is_finished
            except Exception as error:  # the grammar broke: this request ends with it
                scheduler.fail(request, error)
                return
        if token in request.stop_tokens or complete:
            scheduler.finish(request, "stop")
        elif len(request.generated) >= request.max_tokens:
            scheduler.finish(request, "length")

    def advance(
        self,
        request: EngineRequest,
        chosen: tuple[int, TokenLogprob | None],
        length: int,
        produced: dict[int, list[int]],
    ) -> None:
        """The request's decode step went through: commit what it wrote, emit its token."""
        if request.hashes is not None:
            request.hashes.extend(request.generated[-1:])
            self._core.commit(request, length)
            if self._snapshots is not None and request.states:
                self._snapshots.after_decode(request, length)
        self.emit(request, chosen[0], produced, chosen[1])
