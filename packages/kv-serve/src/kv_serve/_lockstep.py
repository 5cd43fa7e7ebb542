"""A decode engine replicated on every tensor-parallel rank, run in lock step.

Each rank holds its shard of the model and its own pool (its KV heads only) and runs the same
:class:`kv_batching.DecodeEngine`. Given the same requests in the same order, scheduling is
the same on every rank; what is not (the tokens a step samples, the time-based prefill budget)
the engine takes from the leader through its ``RankAgreement`` (:class:`RankGroup`). What
reaches the engine from outside (requests submitted and aborted between steps) reaches it on
the leader only: :class:`LockstepEngine` records it there and sends it, at the start of the
next step, as one int32 message: ``[kind, fingerprint, events...]``. Followers apply the
events, compare their scheduling fingerprint with the leader's (a divergence ends the
process, never wrong text), and step when the leader steps. The leader sends an idle message
at least every ``heartbeat`` seconds, so a follower that hears nothing for ``timeout``
seconds knows the leader is gone.

A submitted request travels whole: prompt, ``max_tokens``, ``n``, stop tokens and every
sampling field; a structured-output constraint as its grammar's text (constraints the server
compiles carry it), compiled again on the follower.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from kv_batching import (
    DecodeEngine,
    DecodePlan,
    EngineConfig,
    EngineMemoryReport,
    EngineStats,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from kv_protocol import KVPool, RequestStateError, TokenConstraintFactory, check_int_sequence

from ._ranks import RankGroup, RankLostError

__all__ = ["LockstepEngine", "ServedEngine"]

logger = logging.getLogger(__name__)

# Message kinds (the first word of each step message).
_IDLE, _STEP, _SHUTDOWN = 0, 1, 2
# Event kinds.
_SUBMIT, _ABORT, _STATE_BUDGET = 1, 2, 3

GrammarSource = Callable[[str], TokenConstraintFactory]


class _Writer:
    """Words of an int32 message."""

    def __init__(self) -> None:
        self.words: list[int] = []

    def int32(self, value: int) -> None:
        self.words.append(int(value))

    def int64(self, value: int) -> None:
        high, low = struct.unpack("<ii", struct.pack("<q", value))
        self.words += [high, low]

    def float64(self, value: float) -> None:
        high, low = struct.unpack("<ii", struct.pack("<d", float(value)))
        self.words += [high, low]

    def ints(self, values: Sequence[int]) -> None:
        self.words.append(len(values))
        self.words += [int(v) for v in values]

    def optional(self, value: int | None) -> None:
        self.int32(0 if value is None else 1)
        self.int64(0 if value is None else value)


class _Reader:
    """Reads what :class:`_Writer` wrote, in the same order."""

    def __init__(self, words: Sequence[int]) -> None:
        self.words = words
        self.at = 0

    @property
    def done(self) -> bool:
        return self.at >= len(self.words)

    def int32(self) -> int:
        if self.at >= len(self.words):
            raise RankLostError("a rank message ended early (the ranks disagree on its format)")
        self.at += 1
        return int(self.words[self.at - 1])

    def int64(self) -> int:
        high, low = self.int32(), self.int32()
        return int(struct.unpack("<q", struct.pack("<ii", high, low))[0])

    def float64(self) -> float:
        high, low = self.int32(), self.int32()
        return float(struct.unpack("<d", struct.pack("<ii", high, low))[0])

    def ints(self) -> list[int]:
        count = self.int32()
        return [self.int32() for _ in range(count)]

    def optional(self) -> int | None:
        present = self.int32()
        value = self.int64()
        return value if present else None


def _grammar_text(params: SamplingParams) -> str | None:
    """The grammar a constraint was compiled from; refused if it cannot travel."""
    if params.constraint is None:
        return None
    grammar = getattr(params.constraint, "grammar", None)
    if not isinstance(grammar, str):
        raise RequestStateError(
            "on tensor-parallel ranks a constraint must carry the grammar it was compiled from "
            f"(its text is sent to the other ranks); {params.constraint!r} has none"
        )
    return grammar


def _write_submit(
    out: _Writer,
    rid: int,
    prompt: Sequence[int],
    max_tokens: int,
    n: int,
    params: SamplingParams,
    stops: Sequence[int],
    grammar: str | None,
) -> None:
    out.int32(_SUBMIT)
    out.int32(rid)
    out.int32(n)
    out.int64(max_tokens)
    out.ints(prompt)
    out.ints(stops)
    for value in (
        params.temperature,
        params.top_p,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
    ):
        out.float64(value)
    out.int64(params.top_k)
    out.int64(params.min_tokens)
    out.optional(None if params.seed is None else params.seed - 2**63)
    out.optional(params.logprobs)
    out.optional(params.prompt_logprobs)
    out.int32(len(params.logit_bias))
    for token, bias in sorted(params.logit_bias.items()):
        out.int32(token)
        out.float64(bias)
    out.ints(list(grammar.encode()) if grammar is not None else [])
    out.int32(0 if grammar is None else 1)


def _read_submit(
    reader: _Reader, grammars: GrammarSource | None
) -> tuple[int, list[int], int, int, SamplingParams, list[int]]:
    rid = reader.int32()
    n = reader.int32()
    max_tokens = reader.int64()
    prompt = reader.ints()
    stops = reader.ints()
    temperature, top_p, min_p, presence, frequency, repetition = (
        reader.float64() for _ in range(6)
    )
    top_k = reader.int64()
    min_tokens = reader.int64()
    seed = reader.optional()
    logprobs = reader.optional()
    prompt_logprobs = reader.optional()
    bias = {}
    for _ in range(reader.int32()):
        token = reader.int32()
        bias[token] = reader.float64()
    grammar_bytes = reader.ints()
    constraint = None
    if reader.int32():
        if grammars is None:
            raise RankLostError(
                "the leader sent a constrained request but this rank has no grammar compiler"
            )
        constraint = grammars(bytes(grammar_bytes).decode())
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=bias,
        min_tokens=min_tokens,
        seed=None if seed is None else seed + 2**63,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
    )
    return rid, prompt, max_tokens, n, params, stops


def _host_ready(tokens: object) -> bool:
    """Whether ``tokens`` is not an array the engine refuses (one of ints, at most 1-D)."""
    return not isinstance(tokens, mx.array) or (
        mx.issubdtype(tokens.dtype, mx.integer) and tokens.ndim <= 1
    )


def _token_list(tokens: Iterable[int] | mx.array) -> object:
    if isinstance(tokens, mx.array):
        return tokens.reshape(-1).tolist()
    return tokens


class LockstepEngine:
    """One rank's engine of a tensor-parallel group, kept in step with the leader's.

    It holds the rank's :class:`kv_batching.DecodeEngine` and sends (leader) or applies
    (follower) the messages that keep every rank's engine in step.

    ``engine`` must have been built with ``agreement=ranks`` (``build_engine(...,
    ranks=...)`` builds both). On the leader it is driven as a ``DecodeEngine`` is
    (:meth:`submit`, :meth:`abort`, :meth:`step`; :attr:`has_work` is also true when an idle
    message is due); on a follower :meth:`follow` runs until the leader closes its engine.
    :meth:`restore` is refused (the rollback is not sent to the other ranks), so are requests
    given to a follower. Every other member is the held engine's.
    """

    def __init__(self, engine: DecodeEngine, ranks: RankGroup) -> None:
        self._engine = engine
        self._ranks = ranks
        self._events = _Writer()
        self._last_message = time.monotonic()
        self._grammars: GrammarSource | None = None
        self._closed = False
        #: A follower's requests not yet released.
        self._live: set[int] = set()

    @property
    def engine(self) -> DecodeEngine:
        """The rank's own engine (step it only through this object)."""
        return self._engine

    @property
    def ranks(self) -> RankGroup:
        """The group this engine's rank belongs to."""
        return self._ranks

    def set_grammar_source(self, grammars: GrammarSource) -> None:
        """How a follower compiles the grammar text of a constrained request."""
        self._grammars = grammars

    # ------------------------------------------------------------------ leader

    def submit(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_tokens: Iterable[int] | mx.array = (),
        **short: Any,
    ) -> int:
        """As :meth:`DecodeEngine.submit`, on the leader; the request reaches every rank.

        ``temperature``, ``top_p`` and ``seed`` are the short form of ``sampling``, as there.
        """
        unknown = sorted(set(short) - {"temperature", "top_p", "seed"})
        if unknown:
            raise TypeError(f"submit() got unexpected keyword arguments {unknown}")
        if short:
            if sampling is not None:
                raise RequestStateError(
                    f"give sampling= or {', '.join(short)}, not both (they set the same fields)"
                )
            sampling = SamplingParams(**short)
        return self.submit_n(
            prompt_tokens, max_tokens, 1, sampling=sampling, stop_tokens=stop_tokens
        )[0]

    def submit_n(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        n: int,
        *,
        sampling: SamplingParams | None = None,
        stop_tokens: Iterable[int] | mx.array = (),
    ) -> list[int]:
        """As :meth:`DecodeEngine.submit_n`, on the leader; the request reaches every rank."""
        self._leader_only("takes requests")
        engine = self._engine
        if not (_host_ready(prompt_tokens) and _host_ready(stop_tokens)):
            # An array the engine takes for no token list: its own refusal says why.
            return engine.submit_n(
                prompt_tokens, max_tokens, n, sampling=sampling, stop_tokens=stop_tokens
            )
        top = engine.vocab_size - 1
        # The engine's own checks, first: only a valid request is written down.
        prompt = check_int_sequence(
            _token_list(prompt_tokens), "prompt_tokens", minimum=0, maximum=top
        )
        stops = check_int_sequence(_token_list(stop_tokens), "stop_tokens", minimum=0, maximum=top)
        params = sampling if sampling is not None else SamplingParams()
        event = _Writer()
        if isinstance(params, SamplingParams):  # otherwise submit_n refuses it below
            grammar = _grammar_text(params)
            try:
                # The request id is written once the engine has given one (word 1).
                _write_submit(event, -1, prompt, max_tokens, n, params, sorted(set(stops)), grammar)
            except (struct.error, TypeError, ValueError, OverflowError) as error:
                raise RequestStateError(
                    f"the request cannot be sent to the other ranks: {error} (max_tokens, n, "
                    "top_k and min_tokens must fit 64 bits)"
                ) from None
        rids = engine.submit_n(prompt, max_tokens, n, sampling=sampling, stop_tokens=stops)
        event.words[1] = rids[0]
        self._events.words += event.words
        return rids

    def abort(self, request_id: int) -> bool:
        """As :meth:`DecodeEngine.abort`; on the leader the abort reaches every rank."""
        done = self._engine.abort(request_id)
        if done and self._ranks.is_leader:
            self._events.int32(_ABORT)
            self._events.int32(request_id)
        return done

    @property
    def state_budget_bytes(self) -> int | None:
        """As :attr:`DecodeEngine.state_budget_bytes`; set on the leader, it reaches every rank."""
        return self._engine.state_budget_bytes

    @state_budget_bytes.setter
    def state_budget_bytes(self, value: int | None) -> None:
        self._leader_only("changes the state budget")
        self._engine.state_budget_bytes = value
        self._events.int32(_STATE_BUDGET)
        self._events.optional(self._engine.state_budget_bytes)

    def restore(self, request_id: int, position: int) -> None:
        """Refused: a rollback is not sent to the other ranks."""
        raise RequestStateError(
            "restore() is not supported on tensor-parallel ranks (the rollback would reach "
            "this rank only)"
        )

    @property
    def has_work(self) -> bool:
        """Requests to serve, events to send, or (leader) an idle message due."""
        if self._engine.has_work or self._events.words:
            return True
        return (
            self._ranks.is_leader and time.monotonic() - self._last_message >= self._ranks.heartbeat
        )

    def step(self) -> dict[int, list[int]]:
        """The leader's step: send what happened since the last one, then step together."""
        self._leader_only("steps in follow()")
        run = self._engine.has_work
        message = [_STEP if run else _IDLE, self._engine.fingerprint(), *self._events.words]
        self._events = _Writer()
        self._last_message = time.monotonic()
        self._ranks.broadcast(message, "sending the step message")
        if not run:
            return {}
        with self._ranks.watch("an engine step"):
            return self._engine.step()

    def stream(self) -> Iterator[tuple[int, int]]:
        """As :meth:`DecodeEngine.stream`, through this rank group's :meth:`step`."""
        while self._engine.has_work:
            for rid, tokens in self.step().items():
                for token in tokens:
                    yield rid, token

    def run(self) -> dict[int, list[int]]:
        """As :meth:`DecodeEngine.run`, through this rank group's :meth:`step`."""
        while self._engine.has_work:
            self.step()
        return self._engine.run()

    def close(self) -> None:
        """Tell the followers to stop (leader), then put the model back."""
        if not self._closed:
            self._closed = True
            if self._ranks.is_leader:
                with contextlib.suppress(RankLostError):
                    self._ranks.broadcast([_SHUTDOWN, 0], "sending the shutdown message")
        self._engine.close()

    def __enter__(self) -> LockstepEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leader_only(self, what: str) -> None:
        if not self._ranks.is_leader:
            raise RequestStateError(
                f"rank {self._ranks.rank} is a follower: only the leader (rank 0) {what}"
            )

    # ------------------------------------------------------------------ the held engine's

    @property
    def config(self) -> EngineConfig:
        """The held engine's :attr:`DecodeEngine.config`."""
        return self._engine.config

    @property
    def pool(self) -> KVPool:
        """The held engine's pool (this rank's KV heads)."""
        return self._engine.pool

    @property
    def stats(self) -> EngineStats:
        """The held engine's :attr:`DecodeEngine.stats`."""
        return self._engine.stats

    @property
    def vocab_size(self) -> int:
        """The held engine's :attr:`DecodeEngine.vocab_size`."""
        return self._engine.vocab_size

    @property
    def decode_plan(self) -> DecodePlan:
        """The held engine's :attr:`DecodeEngine.decode_plan`."""
        return self._engine.decode_plan

    @property
    def prefix_caching(self) -> bool:
        """The held engine's :attr:`DecodeEngine.prefix_caching`."""
        return self._engine.prefix_caching

    @property
    def max_running(self) -> int:
        """The held engine's :attr:`DecodeEngine.max_running`."""
        return self._engine.max_running

    @property
    def state_snapshot_interval(self) -> int | None:
        """The held engine's :attr:`DecodeEngine.state_snapshot_interval`."""
        return self._engine.state_snapshot_interval

    @property
    def num_requests(self) -> int:
        """The held engine's :attr:`DecodeEngine.num_requests`."""
        return self._engine.num_requests

    @property
    def num_running(self) -> int:
        """The held engine's :attr:`DecodeEngine.num_running`."""
        return self._engine.num_running

    @property
    def num_queued(self) -> int:
        """The held engine's :attr:`DecodeEngine.num_queued`."""
        return self._engine.num_queued

    def token_logprobs(self, request_id: int, start: int = 0) -> tuple[TokenLogprob, ...]:
        """As :meth:`DecodeEngine.token_logprobs`."""
        return self._engine.token_logprobs(request_id, start)

    def release(self, request_id: int) -> RequestOutput:
        """As :meth:`DecodeEngine.release`."""
        return self._engine.release(request_id)

    def is_finished(self, request_id: int) -> bool:
        """As :meth:`DecodeEngine.is_finished`."""
        return self._engine.is_finished(request_id)

    def output(self, request_id: int) -> RequestOutput:
        """As :meth:`DecodeEngine.output`."""
        return self._engine.output(request_id)

    def memory_report(self) -> EngineMemoryReport:
        """As :meth:`DecodeEngine.memory_report`."""
        return self._engine.memory_report()

    def shrink_pool(self, *, drop_cached: bool = False) -> int:
        """As :meth:`DecodeEngine.shrink_pool` (this rank's pool)."""
        return self._engine.shrink_pool(drop_cached=drop_cached)

    def fingerprint(self) -> int:
        """As :meth:`DecodeEngine.fingerprint`: the same on every rank in step."""
        return self._engine.fingerprint()

    # ------------------------------------------------------------------ follower

    def follow(self) -> None:
        """Apply the leader's messages until it closes its engine (followers only)."""
        while self.follow_step() is not None:
            pass

    def follow_step(self) -> dict[int, list[int]] | None:
        """Wait for the leader's next message and apply it; ``None`` once the leader closed.

        Returns the tokens the step produced (as the leader's :meth:`step` does).
        The events are applied, the fingerprints compared (a mismatch reports the ranks lost
        and raises :class:`RankLostError`), the step run when the leader ran one, and the
        requests that finished are released (nobody reads a follower's outputs).
        """
        ranks = self._ranks
        engine = self._engine
        if ranks.is_leader:
            raise RequestStateError("the leader (rank 0) steps itself; follow() is for followers")
        message = ranks.broadcast(None, "waiting for the leader's next step")
        if len(message) < 2:
            raise self._lost("an empty step message")
        kind, fingerprint = message[0], message[1]
        if kind == _SHUTDOWN:
            return None
        self._apply(_Reader(message[2:]))
        mine = engine.fingerprint()
        if mine != fingerprint:
            raise self._lost(
                f"scheduling diverged from the leader's (fingerprint {mine} against {fingerprint})"
            )
        produced: dict[int, list[int]] = {}
        if kind == _STEP:
            with ranks.watch("an engine step"):
                produced = engine.step()
        for rid in [r for r in self._live if engine.is_finished(r)]:
            self._live.discard(rid)
            engine.release(rid)
        return produced

    def _apply(self, reader: _Reader) -> None:
        engine = self._engine
        while not reader.done:
            kind = reader.int32()
            if kind == _SUBMIT:
                rid, prompt, max_tokens, n, params, stops = _read_submit(reader, self._grammars)
                rids = engine.submit_n(prompt, max_tokens, n, sampling=params, stop_tokens=stops)
                if rids[0] != rid:
                    raise self._lost(f"request {rid} of the leader is request {rids[0]} here")
                self._live.update(rids)
            elif kind == _ABORT:
                engine.abort(reader.int32())
            elif kind == _STATE_BUDGET:
                engine.state_budget_bytes = reader.optional()
            else:
                raise self._lost(f"an unknown event kind {kind}")

    def _lost(self, why: str) -> RankLostError:
        message = f"rank {self._ranks.rank}: {why}"
        self._ranks.lost(message)
        return RankLostError(message)


#: What a server drives: one process's engine, or one rank's of a tensor-parallel group.
ServedEngine = DecodeEngine | LockstepEngine
