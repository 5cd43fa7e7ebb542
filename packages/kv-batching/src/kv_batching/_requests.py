"""The engine's requests.

What it keeps per request, what a caller reads, and the table that hands them out by id.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kv_protocol import (
    RequestStateError,
    TokenConstraint,
    TokenHashes,
    UnknownRequestError,
    as_int,
)

from ._sampling_params import SamplingParams, SamplingRow, TokenLogprob
from ._speculative import SpeculationState
from ._state_snapshots import StateSnapshot

__all__ = ["EngineRequest", "RequestOutput", "RequestStatus", "RequestTable"]


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request: its tokens so far and why it finished (if it did).

    ``finish_reason`` is ``"stop"`` (a stop token was generated, and is included),
    ``"length"`` (``max_tokens`` reached), ``"aborted"``, ``"pool_exhausted"`` (the request
    alone does not fit in the pool), ``"error"`` (its prefill or decode raised; ``error``
    holds the exception) or ``None`` while it runs. ``logprobs`` has one
    :class:`TokenLogprob` per generated token when the request asked for them
    (``SamplingParams.logprobs``), ``prompt_logprobs`` one per prompt token (``None`` for
    the first, which nothing predicts) when it asked for those.
    """

    request_id: int
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    status: RequestStatus
    finish_reason: str | None
    error: BaseException | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    #: Speculative decoding: tokens proposed for this request and accepted of them.
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    #: Prompt tokens served from the prefix cache when the request was first admitted
    #: (their prefill skipped); 0 before it was admitted or without a hit.
    cached_tokens: int = 0


class EngineRequest:
    """One request as the engine keeps it: prompt, sampling, tokens, where it is, its state."""

    __slots__ = (
        "cached_tokens",
        "constraint",
        "error",
        "finish_reason",
        "followers",
        "generated",
        "hashes",
        "in_pool",
        "leader",
        "logprobs",
        "max_tokens",
        "params",
        "pending_snapshot",
        "prefilled",
        "prompt",
        "prompt_logprobs",
        "prompt_set",
        "rid",
        "seed",
        "speculation",
        "states",
        "status",
        "step_snapshot",
        "stop_tokens",
    )

    def __init__(
        self,
        rid: int,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams,
        stop_tokens: frozenset[int],
        seed: int | None = None,
    ) -> None:
        self.rid = rid
        self.params = params
        #: The request's own stream (``params.seed``, or a sibling's shifted seed).
        self.seed = seed if seed is not None else params.seed
        self.prompt = prompt
        #: The prompt's distinct tokens (the repetition penalty's), made once when needed.
        self.prompt_set: frozenset[int] | None = None
        self.max_tokens = max_tokens
        self.stop_tokens = stop_tokens
        self.generated: list[int] = []
        self.status = RequestStatus.QUEUED
        self.finish_reason: str | None = None
        self.prefilled = 0
        #: Prompt tokens the prefix cache served at the first admission (``None``: not yet).
        self.cached_tokens: int | None = None
        self.states: list[Any] | None = None
        #: A copy of ``states`` at the last prefix boundary a decode step reached (state
        #: snapshots only), kept in the snapshot cache when the request leaves the pool.
        self.pending_snapshot: StateSnapshot | None = None
        #: ``states`` before the last decode step (``step_snapshots`` only): what
        #: ``DecodeEngine.restore`` puts back to undo that step.
        self.step_snapshot: StateSnapshot | None = None
        #: Its speculative decoding (proposal length, counts), once it has speculated.
        self.speculation: SpeculationState | None = None
        #: The prefix cache's hashes of the tokens whose K/V the request writes (prefix
        #: caching only): made once at its first admission, extended as it decodes.
        self.hashes: TokenHashes | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt) if params.prompt_logprobs is not None else None
        )
        #: Sequences of the same prompt (``submit_n``) waiting for this one's prefill, and
        #: the sequence a waiting one belongs to.
        self.followers: list[EngineRequest] = []
        self.leader: EngineRequest | None = None
        self.in_pool = False
        self.error: BaseException | None = None
        #: The sequence's own structured-output constraint (made from the params' factory).
        self.constraint: TokenConstraint | None = None
        if params.constraint is not None:
            try:
                self.constraint = params.constraint()
            except Exception as error:
                raise RequestStateError(
                    f"the request's constraint factory raised {error!r}"
                ) from error

    def prefill_tokens(self) -> list[int]:
        """The tokens to prefill.

        The prompt, and after a preemption the generated tokens but the last (which the
        first decode step feeds).
        """
        return self.prompt + self.generated[:-1]

    def sampling_row(self) -> SamplingRow:
        """How this request samples its next token."""
        params = self.params
        prompt: frozenset[int] = frozenset()
        if params.repetition_penalty != 1.0:
            if self.prompt_set is None:
                self.prompt_set = frozenset(self.prompt)
            prompt = self.prompt_set
        return SamplingRow(
            params=params,
            generated=len(self.generated),
            seed=self.seed,
            prompt=prompt,
            output=self.generated if params.processes_logits else (),
            stop_tokens=self.stop_tokens if len(self.generated) < params.min_tokens else (),
        )

    @property
    def prompt_logprobs_missing(self) -> bool:
        """Whether some prompt position still lacks its logprob (computed by prefill)."""
        found = self.prompt_logprobs
        return found is not None and any(lp is None for lp in found[1:])

    def output(self) -> RequestOutput:
        """A snapshot of the request (copies of its tokens)."""
        return RequestOutput(
            self.rid,
            tuple(self.prompt),
            tuple(self.generated),
            self.status,
            self.finish_reason,
            self.error,
            None if self.logprobs is None else tuple(self.logprobs),
            None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
            0 if self.speculation is None else self.speculation.proposed,
            0 if self.speculation is None else self.speculation.accepted,
            self.cached_tokens or 0,
        )


class RequestTable:
    """The requests an engine keeps, by id; ids are handed out in order and never reused.

    A released request is forgotten: naming it again raises ``UnknownRequestError`` that
    says so (and a different one for an id never handed out).
    """

    def __init__(self) -> None:
        self._requests: dict[int, EngineRequest] = {}
        self._next_id = 0

    def next_id(self) -> int:
        """The id the next :meth:`add` will use."""
        return self._next_id

    def add(self, request: EngineRequest) -> None:
        """Keep ``request`` (its id must be :meth:`next_id`)."""
        if request.rid != self._next_id:
            raise RequestStateError(
                f"request ids are handed out in order: expected {self._next_id}, got {request.rid}"
            )
        self._requests[request.rid] = request
        self._next_id += 1

    def get(self, request_id: int) -> EngineRequest:
        """The request with this id, or ``UnknownRequestError`` saying why there is none."""
        key = as_int(request_id)
        if key is None:
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        request = self._requests.get(key)
        if request is None:
            if 0 <= key < self._next_id:
                raise UnknownRequestError(
                    f"request {request_id} was released from this engine (its output was "
                    "delivered and forgotten)"
                )
            raise UnknownRequestError(f"request {request_id} was never submitted to this engine")
        return request

    def forget(self, request_id: int) -> None:
        """Drop the request (it must be kept)."""
        del self._requests[request_id]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(list(self._requests.values()))
