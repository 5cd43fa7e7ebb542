"""The engine thread's queue bound: a request handed over is counted at every moment.

A submit is first "in transit" (in the worker's inbox), then queued in the engine. If it is
counted in neither for an instant, a concurrent submit passes the bound and the server
queues one request more than ``max_queued`` (an HTTP client then waits for an answer that
should have been a 429). The engine's own ``submit`` is held on the engine thread here, so
the instant lasts as long as the test needs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kv_batching import DecodeEngine
from kv_pool import HybridKVPool
from kv_serve import build_engine
from kv_serve._server_worker import (
    EngineWorker,
    Event,
    QueueFullError,
    RequestParams,
    Submission,
    Ticket,
)
from kv_testing import build_tiny_model


class HeldSubmit:
    """Wrap an engine's ``submit`` so that the engine thread stops inside it on demand."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.inside = threading.Event()
        self.release = threading.Event()

    def wrap(self, engine: DecodeEngine) -> DecodeEngine:
        submit = engine.submit

        def held(*args: Any, **kwargs: Any) -> int:
            if self.hold.is_set():
                self.inside.set()
                assert self.release.wait(30), "the test never released the submit"
            return submit(*args, **kwargs)

        submit_n = engine.submit_n

        def held_n(*args: Any, **kwargs: Any) -> list[int]:
            if self.hold.is_set():
                self.inside.set()
                assert self.release.wait(30), "the test never released the submit"
            return submit_n(*args, **kwargs)

        engine.submit = held  # type: ignore[method-assign]
        engine.submit_n = held_n  # type: ignore[method-assign]
        return engine


@pytest.fixture
def worker_and_hold() -> Iterator[tuple[EngineWorker, HeldSubmit]]:
    hold = HeldSubmit()
    model = build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=64)

    def make_engine() -> DecodeEngine:
        return hold.wrap(build_engine(model, max_running=1, max_context=64, page_size=4))

    worker = EngineWorker(make_engine, max_queued=1)
    worker.start(timeout=120)
    try:
        yield worker, hold
    finally:
        hold.release.set()
        worker.stop()


def test_a_submit_the_engine_is_taking_still_counts_against_the_queue(
    worker_and_hold: tuple[EngineWorker, HeldSubmit],
) -> None:
    worker, hold = worker_and_hold
    loop = asyncio.new_event_loop()
    try:
        params = RequestParams(max_tokens=2)
        hold.hold.set()
        worker.submit(Ticket(loop), [1, 2, 3], params)
        assert hold.inside.wait(30)
        # The engine thread is inside engine.submit: the request is neither in transit nor
        # queued in the engine yet, and must still be counted.
        assert worker.waiting == 1
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            worker.submit(Ticket(loop), [4, 5], params)
        hold.hold.clear()
        hold.release.set()
    finally:
        loop.close()


def test_a_refused_engine_submit_frees_its_place_in_the_queue(
    worker_and_hold: tuple[EngineWorker, HeldSubmit],
) -> None:
    worker, _ = worker_and_hold
    loop = asyncio.new_event_loop()
    try:
        ticket = Ticket(loop)
        # Token id past the vocabulary: the engine refuses it on its thread.
        worker.submit(ticket, [10_000], RequestParams(max_tokens=2))
        for _ in range(3000):
            if worker.waiting == 0 and not ticket.events.empty():
                break
            loop.run_until_complete(asyncio.sleep(0.01))
        assert worker.waiting == 0
        event = ticket.events.get_nowait()
        assert event.finish_reason == "error" and event.error is not None
        # The place is free again: another request is accepted.
        worker.submit(Ticket(loop), [1, 2], RequestParams(max_tokens=2))
    finally:
        loop.close()


class WatchingTicket(Ticket):
    """A ticket that records the worker's waiting count when each event is handed to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, worker: EngineWorker) -> None:
        super().__init__(loop)
        self.worker = worker
        self.waiting_at_events: list[int] = []

    def put(self, event: Event) -> None:
        """Record the count (on the engine thread, as the event is delivered), then deliver."""
        self.waiting_at_events.append(self.worker.waiting)
        super().put(event)


def test_a_request_whose_token_a_client_sees_no_longer_counts_as_waiting(
    worker_and_hold: tuple[EngineWorker, HeldSubmit],
) -> None:
    worker, _ = worker_and_hold
    loop = asyncio.new_event_loop()
    try:
        ticket = WatchingTicket(loop, worker)
        worker.submit(ticket, [1, 2, 3], RequestParams(max_tokens=3))
        for _ in range(3000):
            if len(ticket.waiting_at_events) >= 3:  # three tokens, the last with the end
                break
            loop.run_until_complete(asyncio.sleep(0.01))
        # It was admitted in the step that produced its first token: when that token (and
        # every later event) reaches the client, the queue bound has its place back.
        assert ticket.waiting_at_events == [0, 0, 0]
    finally:
        loop.close()


def drain(loop: asyncio.AbstractEventLoop, tickets: list[Ticket], until: int) -> list[Event]:
    """The events of ``tickets`` (one shared queue) until ``until`` of them ended."""
    events: list[Event] = []
    for _ in range(3000):
        while not tickets[0].events.empty():
            events.append(tickets[0].events.get_nowait())
        if sum(e.done for e in events) >= until:
            return events
        loop.run_until_complete(asyncio.sleep(0.01))
    raise AssertionError(f"only {events} arrived")


def test_a_batch_is_submitted_whole_or_not_at_all(
    worker_and_hold: tuple[EngineWorker, HeldSubmit],
) -> None:
    worker, hold = worker_and_hold
    loop = asyncio.new_event_loop()
    try:
        shared: asyncio.Queue[Event] = asyncio.Queue()
        tickets = [Ticket(loop, index=i, events=shared) for i in range(3)]
        # One sequence fits the bound (max_queued=1) but the batch is taken whole: n=2 of
        # one prompt, then a prompt the engine refuses (a token past the vocabulary).
        worker.submit_batch(
            [
                Submission(tuple(tickets[:2]), [1, 2, 3], RequestParams(max_tokens=4)),
                Submission((tickets[2],), [10_000], RequestParams(max_tokens=4)),
            ]
        )
        events = drain(loop, tickets, 3)
        assert sorted(e.index for e in events) == [0, 1, 2]
        assert all(e.done and e.finish_reason == "error" for e in events)
        assert all("prompt_tokens" in str(e.error) for e in events)
        engine = worker.engine
        assert engine is not None
        for _ in range(300):
            if worker.waiting == 0 and worker.snapshot().engine_requests == 0:
                break
            loop.run_until_complete(asyncio.sleep(0.01))
        assert worker.waiting == 0 and worker.snapshot().engine_requests == 0
        # A good batch: each ticket gets its own sequence's tokens, the last with the end.
        shared = asyncio.Queue()
        tickets = [Ticket(loop, index=i, events=shared) for i in range(2)]
        hold.hold.set()
        worker.submit(tickets, [1, 2, 3], RequestParams(max_tokens=3))
        assert hold.inside.wait(30)
        assert worker.waiting == 2  # both sequences count against the bound
        with pytest.raises(QueueFullError):
            worker.submit(Ticket(loop), [1, 2], RequestParams(max_tokens=2))
        hold.hold.clear()
        hold.release.set()
        events = drain(loop, tickets, 2)
        for index in (0, 1):
            mine = [e for e in events if e.index == index]
            assert sum(len(e.tokens) for e in mine) == 3 and mine[-1].finish_reason == "length"
    finally:
        loop.close()


def test_an_idle_worker_gives_the_pool_s_grown_slabs_back() -> None:
    model = build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=64)

    def make_engine() -> DecodeEngine:
        # One-page slabs (1 byte): the buffers grow with every page handed out.
        return build_engine(
            model, max_running=4, max_context=64, page_size=4, kv_slab_bytes=1, prefix_caching=False
        )

    worker = EngineWorker(make_engine, max_queued=8)
    worker.start(timeout=120)
    loop = asyncio.new_event_loop()
    try:
        start = worker.snapshot().pool_committed_bytes
        tickets = [Ticket(loop) for _ in range(4)]
        for i, ticket in enumerate(tickets):
            worker.submit(ticket, [1 + i, 2, 3, 4, 5, 6, 7, 8, 9], RequestParams(max_tokens=12))
        grown = 0
        ended = 0
        for _ in range(3000):
            grown = max(grown, worker.snapshot().pool_committed_bytes)
            for ticket in tickets:
                while not ticket.events.empty():
                    ended += ticket.events.get_nowait().finish_reason is not None
            if ended == len(tickets):
                break
            loop.run_until_complete(asyncio.sleep(0.01))
        assert ended == len(tickets)
        assert grown > start  # the buffers grew with the load
        # Idle for more than the worker's half-second wait: the pool is cut back to one slab
        # (one page) per sub-pool, nothing being held or cached.
        pool = worker.engine.pool if worker.engine is not None else None
        assert isinstance(pool, HybridKVPool) and pool.slab_pages is not None
        least = sum(s.bytes_per_page * pool.slab_pages[s.name] for s in pool.sub_pools)
        for _ in range(500):
            if worker.snapshot().pool_committed_bytes == least:
                break
            loop.run_until_complete(asyncio.sleep(0.01))
        snap = worker.snapshot()
        assert snap.pool_committed_bytes == least < grown < snap.pool_bytes
    finally:
        loop.close()
        worker.stop()
