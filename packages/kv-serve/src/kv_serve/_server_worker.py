"""The engine thread: the one thread that owns MLX and the ``DecodeEngine`` of a server.

HTTP handlers never touch MLX. They hand requests to :class:`EngineWorker` through a
thread-safe queue and read each request's tokens from its own :class:`Ticket`; the worker
submits and aborts on the engine between steps, so a request that arrives while others
decode joins the next step (continuous batching), and an abort frees the request's pages
before the next step runs. A finished request is released from the engine as soon as its
last event is handed to its ticket, so the engine keeps nothing per finished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_batching import SamplingParams, TokenLogprob
from kv_protocol import KVCacheError, PoolMemoryReport

from ._host_memory import trim_host_memory
from ._lockstep import LockstepEngine, ServedEngine

__all__ = [
    "EngineWorker",
    "Event",
    "QueueFullError",
    "RequestParams",
    "SubPoolLimits",
    "Submission",
    "Ticket",
    "WorkerSnapshot",
    "WorkerStoppedError",
]

logger = logging.getLogger("kv_serve.server")


class QueueFullError(KVCacheError, RuntimeError):
    """The server's waiting queue is full; the client should retry later."""


class WorkerStoppedError(KVCacheError, RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed)."""


@dataclass(frozen=True, kw_only=True)
class RequestParams:
    """What one prompt's sequences ask of the engine: length, sampling, stop tokens."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Event:
    """What the engine thread hands a sequence: new tokens, and at its end reason and error.

    ``logprobs`` holds one entry per token of ``tokens`` when the sequence asked for them;
    ``prompt_logprobs`` comes once, with the sequence's first event, when it asked for them.
    ``index`` is the receiving ticket's.
    """

    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    index: int = 0
    #: Prompt tokens the prefix cache served, with the sequence's first event.
    cached_tokens: int | None = None

    @property
    def done(self) -> bool:
        """Whether this is the sequence's last event."""
        return self.finish_reason is not None


class Ticket:
    """One sequence's mailbox: the engine thread puts events, the handler's loop reads them.

    Created on the handler's event loop; :meth:`put` may be called from any thread. The
    tickets of one request may share an ``events`` queue; each marks its events with its
    ``index``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        index: int = 0,
        events: asyncio.Queue[Event] | None = None,
    ) -> None:
        self._loop = loop
        self.index = index
        self.events: asyncio.Queue[Event] = asyncio.Queue() if events is None else events
        self.request_id: int | None = None
        self.submitted_at = time.perf_counter()
        self.closed = False

    def put(self, event: Event) -> None:
        """Hand ``event`` to the handler (thread-safe; a closed loop drops it)."""
        if event.index != self.index:
            event = dataclasses.replace(event, index=self.index)
        # A closed loop (the handler is gone) raises RuntimeError: nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(frozen=True)
class Submission:
    """One prompt for the engine: its sequences' tickets (``n`` = how many), tokens, params."""

    tickets: tuple[Ticket, ...]
    prompt: list[int]
    params: RequestParams


@dataclass(frozen=True, kw_only=True)
class SubPoolLimits:
    """Static facts of one sub-pool: what a single request may use of it."""

    name: str
    kind: str
    window: int | None
    page_size: int
    num_pages: int


@dataclass(frozen=True, kw_only=True)
class WorkerSnapshot:
    """The engine's state after its latest step, for /metrics and /health."""

    alive: bool
    running: int = 0
    queued: int = 0
    active: int = 0
    engine_requests: int = 0
    steps: int = 0
    pages_used: Mapping[str, int] = field(default_factory=dict)
    pages_total: Mapping[str, int] = field(default_factory=dict)
    #: Bits of each sub-pool's quantized pages; 0 where they hold the model's dtype.
    kv_bits: Mapping[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    errors: int = 0
    state_bytes: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_pages: int = 0
    prefix_evictions: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    state_snapshot_budget_bytes: int = 0
    state_snapshot_hits: int = 0
    speculative_steps: int = 0
    speculative_proposed: int = 0
    speculative_accepted: int = 0
    #: Ranks of the tensor-parallel group the engine runs on (1: one process).
    world_size: int = 1
    #: Bytes of this rank's KV pool at its cap (each rank holds the K/V of its own heads).
    pool_bytes: int = 0
    #: Bytes the pool's buffers hold now (they grow with use up to ``pool_bytes``).
    pool_committed_bytes: int = 0


@dataclass
class _Submit:
    submissions: tuple[Submission, ...]

    @property
    def sequences(self) -> int:
        return sum(len(s.tickets) for s in self.submissions)


@dataclass
class _Abort:
    ticket: Ticket


@dataclass
class _Active:
    """A sequence the engine runs for a ticket, and what was delivered of it."""

    ticket: Ticket
    logprobs: bool
    prompt_logprobs: bool
    delivered: int = 0
    first: bool = True


_STOP = object()


def _pool_limits(engine: ServedEngine) -> tuple[SubPoolLimits, ...]:
    return tuple(
        SubPoolLimits(
            name=s.name,
            kind=s.kind,
            window=s.window,
            page_size=s.page_size,
            num_pages=s.num_pages,
        )
        for s in engine.pool.memory_report().sub_pools
    )


def pool_pages(
    report: PoolMemoryReport,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per sub-pool: pages used, pages in all, and the pages' bits (0: the model's dtype)."""
    subs = report.sub_pools
    return (
        {s.name: s.pages_used for s in subs},
        {s.name: s.num_pages for s in subs},
        {s.name: s.kv_bits or 0 for s in subs},
    )


class EngineWorker:
    """Run a ``DecodeEngine`` on its own thread and serve requests from other threads.

    ``make_engine`` runs on the engine thread (so the pool's buffers and the engine's probes
    are made by the thread that will use them). ``max_queued`` bounds the requests waiting
    for admission (handed over but not yet running): :meth:`submit` raises
    :class:`QueueFullError` beyond it.
    """

    def __init__(self, make_engine: Callable[[], ServedEngine], *, max_queued: int) -> None:
        self._make_engine = make_engine
        self.max_queued = max_queued
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_submits = 0
        self._engine_queued = 0
        self._snapshot = WorkerSnapshot(alive=False)
        self._thread = threading.Thread(target=self._main, name="kv-serve-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._active: dict[int, _Active] = {}
        self.engine: ServedEngine | None = None
        self.pool_limits: tuple[SubPoolLimits, ...] = ()
        self.vocab_size = 0
        self.max_running = 0
        self.layout: Any = None

    # ------------------------------------------------------------------ any thread

    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and wait until its engine is built (or raise its error)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine thread did not start in time")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still active end with an error."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def snapshot(self) -> WorkerSnapshot:
        """The engine's state after its latest step."""
        with self._lock:
            return self._snapshot

    @property
    def waiting(self) -> int:
        """Sequences handed over and not yet running (queued in the engine or in transit)."""
        with self._lock:
            return self._pending_submits + self._engine_queued

    def submit(
        self, ticket: Ticket | Sequence[Ticket], prompt: list[int], params: RequestParams
    ) -> None:
        """Hand one prompt to the engine thread: one sequence per ticket.

        The sequences of more than one ticket are submitted together (``submit_n``: the
        prompt is prefilled once); each ticket gets its own sequence's events.
        """
        tickets = (ticket,) if isinstance(ticket, Ticket) else tuple(ticket)
        self.submit_batch([Submission(tickets, prompt, params)])

    def submit_batch(self, submissions: Sequence[Submission]) -> None:
        """Hand several prompts to the engine thread at once: all are submitted or none.

        Raises :class:`QueueFullError` when ``max_queued`` sequences already wait (a batch
        is taken whole while fewer wait, so one larger than the bound is still served).
        If the engine refuses one of them, every ticket of the batch gets that error and
        the others are aborted.
        """
        command = _Submit(tuple(submissions))
        if not self.alive:
            raise WorkerStoppedError("the engine thread is not running")
        with self._lock:
            if self._pending_submits + self._engine_queued >= self.max_queued:
                raise QueueFullError(
                    f"the server's waiting queue is full ({self.max_queued} sequences wait for "
                    "admission); retry later"
                )
            self._pending_submits += command.sequences
        self._inbox.put(command)

    def abort(self, ticket: Ticket) -> None:
        """Abort the ticket's request if it runs; its pages are freed before the next step."""
        if not ticket.closed:
            ticket.closed = True
            self._inbox.put(_Abort(ticket))

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        try:
            engine = self._make_engine()
            self.engine = engine
            self.pool_limits = _pool_limits(engine)
            self.vocab_size = engine.vocab_size
            self.max_running = engine.max_running
            self.layout = engine.pool.layout
            # What loading the model and building the engine freed goes back to the system.
            trim_host_memory()
            self._publish(engine)
        except BaseException as error:
            self._startup_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(engine)
        except BaseException:
            logger.exception("the engine thread stopped")
            raise
        finally:
            self._shutdown(engine)

    def _loop(self, engine: ServedEngine) -> None:
        # False from the first step after the pool last gave memory back.
        shrunk = True
        while True:
            commands: list[Any] = []
            if not engine.has_work:
                try:
                    commands.append(self._inbox.get(timeout=0.5))
                except queue.Empty:
                    if not shrunk:
                        # Idle for a while: the pool's buffers go back to what the cached
                        # prefixes hold, so the server's memory follows its load.
                        engine.shrink_pool()
                        trim_host_memory()
                        shrunk = True
                        self._publish(engine)
                    continue
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    return
                self._apply(engine, command)
            if engine.has_work:
                self._step(engine)
                shrunk = False
            self._publish(engine)

    def _apply(self, engine: ServedEngine, command: Any) -> None:
        if isinstance(command, _Submit):
            started: list[int] = []
            try:
                for sub in command.submissions:
                    if all(t.closed for t in sub.tickets):
                        continue
                    started += self._start(engine, sub)
            except Exception as error:
                for rid in started:
                    self._active.pop(rid, None)
                    engine.abort(rid)
                    engine.release(rid)
                for sub in command.submissions:
                    for ticket in sub.tickets:
                        ticket.put(Event(finish_reason="error", error=error))
            finally:
                # In transit until the engine holds it, then queued there: counted in one
                # place or the other at every moment, or a concurrent submit could pass the
                # queue bound while this one is in between.
                with self._lock:
                    self._pending_submits -= command.sequences
                    self._engine_queued = engine.num_queued
        elif isinstance(command, _Abort):
            target = command.ticket.request_id
            if target is not None and target in self._active:
                del self._active[target]
                engine.abort(target)
                engine.release(target)
                command.ticket.put(Event(finish_reason="aborted"))

    def _start(self, engine: ServedEngine, sub: Submission) -> list[int]:
        params = sub.params
        n = len(sub.tickets)
        if n == 1:
            rids = [
                engine.submit(
                    sub.prompt,
                    params.max_tokens,
                    sampling=params.sampling,
                    stop_tokens=params.stop_tokens,
                )
            ]
        else:
            rids = engine.submit_n(
                sub.prompt,
                params.max_tokens,
                n,
                sampling=params.sampling,
                stop_tokens=params.stop_tokens,
            )
        for rid, ticket in zip(rids, sub.tickets, strict=True):
            ticket.request_id = rid
            self._active[rid] = _Active(
                ticket,
                logprobs=params.sampling.logprobs is not None,
                prompt_logprobs=params.sampling.prompt_logprobs is not None,
            )
        return rids

    def _step(self, engine: ServedEngine) -> None:
        try:
            produced = engine.step()
        except Exception as error:
            # The engine finishes failing requests itself; an exception escaping a step is
            # a bug: end every request with it rather than serve on a broken engine state.
            logger.exception("an engine step raised; ending every active request")
            for rid, active in list(self._active.items()):
                del self._active[rid]
                if not engine.is_finished(rid):
                    engine.abort(rid)
                engine.release(rid)
                active.ticket.put(Event(finish_reason="error", error=error))
            return
        # The step may have admitted queued requests: say so before any client hears of its
        # tokens, or a client could see a token while its request still counts as waiting.
        with self._lock:
            self._engine_queued = engine.num_queued
        for rid, active in list(self._active.items()):
            tokens = tuple(produced.get(rid) or ())
            finished = engine.is_finished(rid)
            if not tokens and not finished:
                continue
            logprobs: tuple[TokenLogprob, ...] = ()
            if tokens and active.logprobs:
                logprobs = engine.token_logprobs(rid, start=active.delivered)[: len(tokens)]
            active.delivered += len(tokens)
            prompt = None
            cached: int | None = None
            if active.first:  # sent once, with the first event
                active.first = False
                snapshot = engine.output(rid)
                cached = snapshot.cached_tokens
                if active.prompt_logprobs:
                    prompt = snapshot.prompt_logprobs
            if not finished:
                active.ticket.put(
                    Event(
                        tokens=tokens,
                        logprobs=logprobs,
                        prompt_logprobs=prompt,
                        cached_tokens=cached,
                    )
                )
                continue
            del self._active[rid]
            out = engine.release(rid)
            active.ticket.put(
                Event(
                    tokens=tokens,
                    finish_reason=out.finish_reason or "error",
                    error=out.error,
                    logprobs=logprobs,
                    prompt_logprobs=prompt,
                    cached_tokens=cached,
                )
            )

    def _publish(self, engine: ServedEngine) -> None:
        memory = engine.memory_report()
        used, total, bits = pool_pages(memory.pool)
        stats = engine.stats
        cache = memory.prefix_cache
        kept = memory.state_snapshots
        snap = WorkerSnapshot(
            alive=True,
            running=engine.num_running,
            queued=engine.num_queued,
            active=len(self._active),
            engine_requests=engine.num_requests,
            steps=stats.steps,
            pages_used=used,
            pages_total=total,
            kv_bits=bits,
            prefill_tokens=stats.prefill_tokens,
            decode_tokens=stats.decode_tokens,
            preemptions=stats.preemptions,
            errors=stats.errors,
            state_bytes=memory.state_bytes_in_use,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prefix_cached_pages=0 if cache is None else cache.cached_pages,
            prefix_evictions=0 if cache is None else cache.evictions,
            state_snapshots=0 if kept is None else kept.snapshots,
            state_snapshot_bytes=0 if kept is None else kept.bytes,
            state_snapshot_budget_bytes=0 if kept is None else kept.budget_bytes,
            state_snapshot_hits=0 if kept is None else kept.hits,
            speculative_steps=stats.speculative_steps,
            speculative_proposed=stats.speculative_proposed,
            speculative_accepted=stats.speculative_accepted,
            world_size=engine.ranks.size if isinstance(engine, LockstepEngine) else 1,
            pool_bytes=memory.pool.bytes_total,
            pool_committed_bytes=memory.pool.bytes_committed,
        )
        with self._lock:
            self._engine_queued = engine.num_queued
            self._snapshot = snap

    def _shutdown(self, engine: ServedEngine) -> None:
        error = RuntimeError("the server is shutting down")
        for rid, active in list(self._active.items()):
            del self._active[rid]
            if not engine.is_finished(rid):
                engine.abort(rid)
            engine.release(rid)
            active.ticket.put(Event(finish_reason="error", error=error))
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                for sub in command.submissions:
                    for ticket in sub.tickets:
                        ticket.put(Event(finish_reason="error", error=error))
        with self._lock:
            self._pending_submits = 0
            self._snapshot = WorkerSnapshot(alive=False)
        try:
            # Puts the model back and, on tensor-parallel ranks, tells the followers to stop.
            engine.close()
        except Exception:
            logger.exception("closing the engine failed")
