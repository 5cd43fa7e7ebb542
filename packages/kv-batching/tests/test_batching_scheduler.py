"""The engine's scheduler over a paged pool, against a plain-Python model of where requests are.

The scheduler is driven with random admissions, prefill chunks, decode steps, preemptions and
finishes; after every action each request is in exactly one place (queue, prefilling,
running, finished), holds pool pages exactly when it is prefilling or running, and the pool's
lengths are what the model of the requests says.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_batching import EngineStats, RequestStatus, SamplingParams
from kv_batching._requests import EngineRequest
from kv_batching._scheduler import Scheduler
from kv_protocol import CacheLayout, LayerKind, LayerSpec
from kv_testing import ReferenceBookkeeping, ReferenceKVPool


def layout() -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=6, n_kv_heads=1, head_dim=4),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=4),
        ]
    )


def request(rid: int, prompt_len: int) -> EngineRequest:
    return EngineRequest(rid, [1] * prompt_len, 64, SamplingParams(), frozenset(), None)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = ReferenceKVPool(layout(), num_pages=12, page_size=2)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.pool, self.stats, max_running=3)
        self.requests: list[EngineRequest] = []
        # The model: tokens each request holds in the pool.
        self.held: dict[int, int] = {}

    @rule(prompt_len=st.integers(1, 20))
    def submit(self, prompt_len: int) -> None:
        r = request(len(self.requests), prompt_len)
        self.requests.append(r)
        self.scheduler.enqueue(r)

    @rule()
    def admit(self) -> None:
        before = self.scheduler.prefilling
        if before is not None:
            return
        may = self.scheduler.may_admit()
        admitted = self.scheduler.admit()
        assert (admitted is not None) == may
        if admitted is not None:
            assert admitted.status is RequestStatus.PREFILLING
            self.held[admitted.rid] = 0

    @precondition(lambda self: self.scheduler.prefilling is not None)
    @rule(n=st.integers(1, 16))
    def prefill_chunk(self, n: int) -> None:
        r = self.scheduler.prefilling
        assert r is not None
        left = len(r.prefill_tokens()) - r.prefilled
        before = self.pool.seq_len(r.rid)
        reservation = self.scheduler.reserve_chunk(r, min(n, left))
        if reservation is None:
            assert self.pool.seq_len(r.rid) == before
            if r.prefilled == 0:
                self.scheduler.requeue_unstarted(r)
                del self.held[r.rid]
            return
        fit = reservation.n_tokens[0]
        assert reservation.request_ids == (r.rid,) and reservation.start_lengths == (before,)
        assert 1 <= fit <= min(n, left) and self.pool.seq_len(r.rid) == before + fit
        # What was granted leaves room for one more token of every running request.
        running = {q.rid: 1 for q in self.scheduler.running}
        after = self.pool.try_reserve_batch(running)
        assert after is not None
        self.pool.rollback(after)
        self.held[r.rid] += fit
        r.prefilled += fit
        if r.prefilled == len(r.prefill_tokens()):
            self.scheduler.start_running(r)
            r.generated.append(7)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule()
    def decode(self) -> None:
        reservation = self.scheduler.reserve_decode()
        for gone in [rid for rid in self.held if not self.pool.has_request(rid)]:
            del self.held[gone]
        batch = list(self.scheduler.running)
        if not batch:
            assert reservation is None
            return
        assert reservation is not None
        assert reservation.request_ids == tuple(r.rid for r in batch)
        assert reservation.start_lengths == tuple(self.held[r.rid] for r in batch)
        for r in batch:
            self.held[r.rid] += 1
            r.generated.append(7)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(data=st.data())
    def rollback_a_decode(self, data: st.DataObject) -> None:
        batch = list(self.scheduler.running)
        lengths = [self.pool.seq_len(r.rid) for r in batch]
        reservation = self.scheduler.reserve_rows(batch)
        if reservation is None:
            return
        assert [self.pool.seq_len(r.rid) for r in batch] == [n + 1 for n in lengths]
        self.scheduler.rollback(reservation)
        assert [self.pool.seq_len(r.rid) for r in batch] == lengths

    @precondition(lambda self: bool(self.scheduler.active()))
    @rule(data=st.data(), how=st.sampled_from(["finish", "fail", "preempt"]))
    def end(self, data: st.DataObject, how: str) -> None:
        r = data.draw(st.sampled_from(self.scheduler.active()))
        if how == "preempt" and r.status is not RequestStatus.QUEUED:
            self.scheduler.preempt(r)
            assert self.scheduler.queue[0] is r and r.prefilled == 0
        elif how == "fail":
            self.scheduler.fail(r, RuntimeError("boom"))
            assert r.finish_reason == "error" and r.error is not None
        else:
            self.scheduler.finish(r, "aborted")
        self.held.pop(r.rid, None)

    @invariant()
    def each_request_is_in_one_place(self) -> None:
        s = self.scheduler
        places = {
            "queue": [r.rid for r in s.queue],
            "prefilling": [s.prefilling.rid] if s.prefilling is not None else [],
            "running": [r.rid for r in s.running],
            "finished": [r.rid for r in self.requests if r.status is RequestStatus.FINISHED],
        }
        seen = [rid for ids in places.values() for rid in ids]
        assert sorted(seen) == [r.rid for r in self.requests]
        assert len(s.running) <= s.max_running
        for r in s.queue:
            assert r.status is RequestStatus.QUEUED
        for r in s.running:
            assert r.status is RequestStatus.RUNNING

    @invariant()
    def pages_are_held_exactly_by_prefilling_and_running_requests(self) -> None:
        s = self.scheduler
        holders = {r.rid for r in s.running}
        if s.prefilling is not None:
            holders.add(s.prefilling.rid)
        for r in self.requests:
            assert r.in_pool == (r.rid in holders)
            assert self.pool.has_request(r.rid) == (r.rid in holders)
        assert {rid: self.pool.seq_len(rid) for rid in holders} == {
            rid: self.held[rid] for rid in holders
        }
        if not holders:
            assert sum(self.pool.pages_in_use().values()) == 0

    @invariant()
    def counters_match(self) -> None:
        finished = [r for r in self.requests if r.status is RequestStatus.FINISHED]
        assert self.stats.finished == len(finished)
        assert self.stats.errors == sum(r.finish_reason == "error" for r in finished)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_scheduler_against_a_model_of_request_places = SchedulerMachine.TestCase


def test_state_budget_limits_admission() -> None:
    pool = ReferenceKVPool(layout(), num_pages=32, page_size=2)
    scheduler = Scheduler(pool, EngineStats(), max_running=8, state_budget_bytes=100)
    scheduler.state_bytes_per_request = 40
    for rid in range(4):
        scheduler.enqueue(request(rid, 2))
    started = []
    while (admitted := scheduler.admit()) is not None:
        pool.reserve(admitted.rid, 2)
        scheduler.start_running(admitted)
        started.append(admitted.rid)
    # 40 bytes each: a third running request would hold 120 > 100.
    assert started == [0, 1] and not scheduler.may_admit()
    scheduler.state_budget_bytes = None
    assert scheduler.may_admit()


def test_the_scheduler_needs_only_tensor_free_bookkeeping() -> None:
    book = ReferenceBookkeeping(layout(), capacity=10)
    scheduler = Scheduler(book, EngineStats(), max_running=4)
    for rid in range(3):
        scheduler.enqueue(request(rid, 4))
    first = scheduler.admit()
    assert first is not None and book.has_request(0)
    granted = scheduler.reserve_chunk(first, 16)  # halved from 16 until it fits in 10
    assert granted is not None and granted.n_tokens == (8,) and book.lengths[0] == 8
    scheduler.rollback(granted)
    assert book.lengths[0] == 0
    book.lengths[0] = 4
    scheduler.start_running(first)
    second = scheduler.admit()
    assert second is not None
    book.lengths[1] = 5
    scheduler.start_running(second)
    # 9 of 10 held: one more token each does not fit, so the newest is preempted.
    reservation = scheduler.reserve_decode()
    assert [r.rid for r in scheduler.running] == [0] and scheduler.queue[0] is second
    assert reservation is not None and reservation.request_ids == (0,)
    assert not book.has_request(1)
