"""Scheduling the engine's requests over the pool.

Where each active request is (queued, prefilling, running) and what the pool lets them do
next (admission, chunk sizes, room for a decode step, preemption). The scheduler makes the
step's one reservation per decode batch or prefill chunk (``try_reserve_batch``) and is the
only place that rolls one back.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kv_protocol import KVRequestBookkeeping, Reservation, check_int

from ._engine_stats import EngineStats
from ._requests import EngineRequest, RequestStatus
from ._state_cache import state_nbytes

__all__ = ["Scheduler"]

logger = logging.getLogger("kv_batching._engine")


class Scheduler:
    """The queue, the one request being prefilled and the running batch, over one pool.

    It needs the pool's bookkeeping only (:class:`kv_protocol.KVRequestBookkeeping`): it makes
    the reservations and rolls them back, and never reads their slots.

    At most ``max_running`` requests run; a request is admitted when its pool entry can be
    made and (with ``state_budget_bytes``) one more request's recurrent state fits. When the
    running requests outgrow the pool the prefilling request, then the newest running one,
    is preempted back to the head of the queue (pages freed, tokens kept); a request alone
    that cannot fit is finished with ``"pool_exhausted"``. Every transition that ends a
    request's time in the pool frees its pages.
    """

    def __init__(
        self,
        pool: KVRequestBookkeeping,
        stats: EngineStats,
        *,
        max_running: int,
        state_budget_bytes: int | None = None,
    ) -> None:
        self.pool = pool
        self.stats = stats
        self.max_running = check_int(max_running, "max_running", minimum=1)
        self._state_budget_bytes: int | None = None
        self.state_budget_bytes = state_budget_bytes
        #: Bytes of one request's recurrent state (largest seen; ``None`` until one is known).
        self.state_bytes_per_request: int | None = None
        #: Copies of its state a running request may hold: its state, plus the snapshot of
        #: the last boundary it decoded past and its state before the last step when the
        #: engine keeps them. Admission counts them all against ``state_budget_bytes``.
        self.state_copies = 1
        self.queue: deque[EngineRequest] = deque()
        self.prefilling: EngineRequest | None = None
        self.running: list[EngineRequest] = []
        #: Called with a request that leaves the pool with a sound state (finished but not
        #: failed, or preempted), before its pages and state are released.
        self.on_leave: Callable[[EngineRequest], None] | None = None

    @property
    def state_budget_bytes(self) -> int | None:
        """Bytes of recurrent state the running requests may hold together (``None``: no cap)."""
        return self._state_budget_bytes

    @state_budget_bytes.setter
    def state_budget_bytes(self, value: int | None) -> None:
        self._state_budget_bytes = (
            None if value is None else check_int(value, "state_budget_bytes", minimum=1)
        )

    # ------------------------------------------------------------------ reading

    @property
    def has_work(self) -> bool:
        """True while any request is queued, prefilling or running."""
        return bool(self.queue or self.running or self.prefilling is not None)

    def active(self) -> list[EngineRequest]:
        """Every request that has not finished: running, prefilling, queued, then waiting.

        Waiting requests are the other sequences of a prompt (``submit_n``) waiting for the
        first one's prefill.
        """
        prefilling = [self.prefilling] if self.prefilling is not None else []
        return [*self.running, *prefilling, *self.queue, *self.waiting()]

    def waiting(self) -> list[EngineRequest]:
        """Sequences waiting for their prompt's first sequence to be prefilled."""
        leaders = [*([self.prefilling] if self.prefilling is not None else []), *self.queue]
        return [f for leader in leaders for f in leader.followers]

    def state_bytes_in_use(self) -> int:
        """Bytes of recurrent state held now (running and prefilling requests).

        A request's own snapshots count too: the copy at the last prefix boundary it decoded
        past and its state before the last decode step (with state snapshots on).
        """
        holders = [*self.running, *([self.prefilling] if self.prefilling else [])]
        total = 0
        for request in holders:
            if request.states is not None:
                total += state_nbytes(request.states)
            for own in (request.pending_snapshot, request.step_snapshot):
                total += 0 if own is None else own.nbytes
        return total

    def note_state_bytes(self, request: EngineRequest) -> None:
        """Account the size of ``request``'s recurrent state for admission."""
        if request.states:
            held = state_nbytes(request.states)
            self.state_bytes_per_request = max(self.state_bytes_per_request or 0, held)

    # ------------------------------------------------------------------ transitions

    def enqueue(self, request: EngineRequest) -> None:
        """Queue a new request at the back."""
        self.queue.append(request)

    def release(self, request: EngineRequest) -> None:
        """Give back every page the request holds in the pool (if it holds any)."""
        request.states = None
        request.pending_snapshot = None
        request.step_snapshot = None
        if request.in_pool:
            request.in_pool = False
            self.pool.free_request(request.rid)

    def _leave(self, request: EngineRequest) -> None:
        if self.on_leave is not None and request.in_pool:
            try:
                self.on_leave(request)
            except Exception as error:  # only what is kept for later requests is lost
                logger.warning("keeping request %d's state failed: %r", request.rid, error)

    def _remove(self, request: EngineRequest) -> None:
        if request in self.running:
            self.running.remove(request)
        if self.prefilling is request:
            self.prefilling = None

    def finish(self, request: EngineRequest, reason: str) -> None:
        """End ``request`` with ``reason`` wherever it is; its pages are freed.

        Sequences waiting for it (``submit_n``) go to the queue to prefill on their own; a
        waiting sequence leaves its first sequence's list.
        """
        self._remove(request)
        if request.status is RequestStatus.QUEUED and request in self.queue:
            self.queue.remove(request)
        if request.leader is not None:
            request.leader.followers.remove(request)
            request.leader = None
        for follower in request.followers:
            follower.leader = None
            self.queue.append(follower)
        request.followers = []
        if reason != "error":
            self._leave(request)
        self.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.stats.finished += 1

    def fail(self, request: EngineRequest, error: Exception) -> None:
        """Finish ``request`` with reason ``"error"``, keeping the exception."""
        logger.error(
            "request %d failed and was finished with reason 'error': %r", request.rid, error
        )
        request.error = error
        self.stats.errors += 1
        self.finish(request, "error")

    def preempt(self, request: EngineRequest) -> None:
        """Send ``request`` back to the head of the queue: pages freed, tokens kept."""
        self._remove(request)
        self._leave(request)
        self.release(request)
        request.prefilled = 0
        request.status = RequestStatus.QUEUED
        self.queue.appendleft(request)
        self.stats.preemptions += 1

    def requeue_unstarted(self, request: EngineRequest) -> None:
        """Put the prefilling request, which has prefilled nothing, back at the queue's head."""
        self.prefilling = None
        self.release(request)
        request.status = RequestStatus.QUEUED
        self.queue.appendleft(request)

    def start_running(self, request: EngineRequest) -> None:
        """The prefilling request (or a fork of it) has every position: it joins the batch."""
        if self.prefilling is request:
            self.prefilling = None
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    # ------------------------------------------------------------------ decisions

    def reserve_decode(
        self,
        rows: Sequence[EngineRequest] | None = None,
        extra: Mapping[int, int] | None = None,
    ) -> Reservation | None:
        """The decode step's reservation: one more token for every running request.

        ``rows``: only these running requests (the others already took their step). Preempts
        (the prefilling request first, then the newest running one) or finishes a lone
        request that cannot fit, until the pool grants the batch; ``None`` when no request
        (of ``rows``) is left running. ``extra`` (request id -> tokens) asks for that many
        more positions for some requests (their speculative proposals) when the pool has
        the room as it stands; nobody is preempted for them (the reservation's ``n_tokens``
        tell whether they were granted).
        """
        if extra and self.running:
            batch = self.running if rows is None else [r for r in rows if r in self.running]
            granted = self.pool.try_reserve_batch({r.rid: 1 + extra.get(r.rid, 0) for r in batch})
            if granted is not None:
                return granted
        while self.running:
            batch = self.running if rows is None else [r for r in rows if r in self.running]
            if not batch:
                return None
            reservation = self.pool.try_reserve_batch({r.rid: 1 for r in batch})
            if reservation is not None:
                return reservation
            if self.prefilling is not None:
                self.preempt(self.prefilling)
            elif len(self.running) == 1:
                self.finish(self.running[0], "pool_exhausted")
            else:
                self.preempt(self.running[-1])
        return None

    def reserve_rows(self, batch: Sequence[EngineRequest]) -> Reservation | None:
        """One more token for each request of ``batch`` (part of an earlier granted step)."""
        return self.pool.try_reserve_batch({r.rid: 1 for r in batch})

    def reserve_chunk(self, request: EngineRequest, n: int) -> Reservation | None:
        """The largest of ``n, n // 2, ...`` prefill tokens the pool grants ``request``.

        With room left for one more token of each running request (their next decode step);
        ``None`` when not even one token fits.
        """
        headroom = {r.rid: 1 for r in self.running}
        while n >= 1:
            reservation = self.pool.try_reserve_batch(
                {request.rid: n}, headroom=headroom, page_tables=False
            )
            if reservation is not None:
                return reservation
            n //= 2
        return None

    def reserve_verify(self, request: EngineRequest, n: int) -> Reservation | None:
        """``n`` positions for a running request's speculative step, or ``None``.

        With room left for one more token of each other running request; never preempts
        (without the room the request decodes one token as usual).
        """
        headroom = {r.rid: 1 for r in self.running if r is not request}
        return self.pool.try_reserve_batch({request.rid: n}, headroom=headroom, page_tables=False)

    def rollback(self, reservation: Reservation) -> None:
        """Undo a reservation of a step that failed: its requests go back to where they were."""
        self.pool.rollback(reservation)

    def state_room(self) -> bool:
        """Whether one more request's recurrent state fits ``state_budget_bytes``.

        A request is always let in when none runs: a budget below one request's state (and
        its copies) runs requests one at a time instead of none ever.
        """
        per = self.state_bytes_per_request
        if self.state_budget_bytes is None or per is None or not self.running:
            return True
        return (len(self.running) + 1) * per * self.state_copies <= self.state_budget_bytes

    def may_admit(self) -> bool:
        """Whether a queued request could start now (running slots and state budget)."""
        return bool(self.queue) and len(self.running) < self.max_running and self.state_room()

    def admit(self) -> EngineRequest | None:
        """Move the queue's head into the pool and make it the prefilling request.

        ``None`` when nothing may be admitted, or when the pool refused the head (which is
        then finished with the error; :meth:`may_admit` says whether to try the next).
        """
        if not self.may_admit():
            return None
        request = self.queue[0]
        try:
            self.pool.add_request(request.rid)
        except Exception as error:
            self.queue.popleft()
            self.fail(request, error)
            return None
        self.queue.popleft()
        request.in_pool = True
        request.prefilled = 0
        request.status = RequestStatus.PREFILLING
        self.prefilling = request
        return request
