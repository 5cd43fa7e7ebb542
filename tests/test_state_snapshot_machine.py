"""A state machine over state-snapshot prefix reuse on a tight budget.

Random submit / step / evict / preempt / abort sequences drive an engine serving a model with
full, sliding-window and recurrent STATE layers, with a pool and a snapshot budget too small
for everything. A recurrent state is a function of its whole prefix, so every state a request
resumes from is checked against the model's own caches run over exactly that prefix: a hit
that restored another prefix's snapshot fails. Every finished request's tokens equal mlx-lm
generating its prompt alone; the snapshot cache's bytes are always the bytes it holds, within
its budget, and only for blocks every sub-pool still holds.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.nn as nn
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_batching import DecodeEngine, RequestStatus
from kv_pool import HybridKVPool
from kv_pool._inspect import allocator, sub_pool_names
from kv_serve import build_engine
from kv_testing import build_zoo_model, mlx_lm_greedy, mlx_lm_states, states_close

BASES = (
    [(5 * j + 2) % 128 for j in range(28)],
    [*[(5 * j + 2) % 128 for j in range(12)], *[(3 * j + 7) % 128 for j in range(16)]],
    [(11 * j + 1) % 128 for j in range(28)],
)


@cache
def model() -> nn.Module:
    return build_zoo_model("gear")  # full, sliding (window 8) and state layers


@cache
def greedy(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(mlx_lm_greedy(model(), list(prompt), max_tokens))


@cache
def state_bytes() -> int:
    with build_engine(model(), page_size=4, max_context=64) as probe:
        per = probe.memory_report().state_bytes_per_request
    assert per
    return per


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine: DecodeEngine = build_engine(
            model(),
            num_pages=16,
            page_size=4,
            max_running=3,
            prefill_chunk=8,
            state_snapshot_interval=8,
            state_cache_bytes=3 * state_bytes(),
        )
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.max_tokens: dict[int, int] = {}
        self.resumed = 0
        real = self.engine._prefill_phase.reuse_prefix

        def checked(request: Any) -> None:
            real(request)
            if request.prefilled:
                # The state it resumes from is the state of exactly its own prefix.
                assert request.states is not None
                prefix = request.prefill_tokens()[: request.prefilled]
                assert states_close(request.states, mlx_lm_states(model(), prefix)), prefix
                self.resumed += 1

        self.engine._prefill_phase.reuse_prefix = checked  # type: ignore[method-assign]

    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.sampled_from([0, 5, 9, 12, 17, 20, 24, 28]),
        tail=st.lists(st.integers(0, 127), min_size=1, max_size=5),
        max_tokens=st.integers(1, 8),
    )
    def submit(self, base: int, cut: int, tail: list[int], max_tokens: int) -> None:
        prompt = (*BASES[base][:cut], *tail)
        rid = self.engine.submit(list(prompt), max_tokens)
        self.prompts[rid] = prompt
        self.max_tokens[rid] = max_tokens

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.engine.step()
        self.check_finished()

    @rule()
    def evict(self) -> None:
        cache_ = self.engine.pool.prefix_cache
        assert cache_ is not None
        cache_.drop_cached()  # type: ignore[attr-defined]

    @precondition(lambda self: bool(self.engine._core.scheduler.running))
    @rule(newest=st.booleans())
    def preempt(self, newest: bool) -> None:
        running = self.engine._core.scheduler.running
        self.engine._core.scheduler.preempt(running[-1] if newest else running[0])

    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prompts)))
        self.engine.abort(rid)
        self.prompts.pop(rid)

    def check_finished(self) -> None:
        for rid in list(self.prompts):
            out = self.engine.output(rid)
            if out.status is RequestStatus.FINISHED:
                assert out.finish_reason == "length", (rid, out.finish_reason, out.error)
                want = greedy(self.prompts[rid], self.max_tokens[rid])
                assert out.tokens == want, (self.prompts[rid], out.tokens, want)
                self.prompts.pop(rid)

    @invariant()
    def snapshot_books_balance(self) -> None:
        policy = self.engine._snapshots
        assert policy is not None
        snapshots = policy.cache
        entries = snapshots._entries
        stats = snapshots.stats()
        assert stats.bytes == sum(s.nbytes for s in entries.values()) <= stats.budget_bytes
        assert stats.snapshots == len(entries)
        pool = self.engine.pool
        assert isinstance(pool, HybridKVPool)
        for key in entries:
            # A snapshot is kept only while every sub-pool holds the page ending there.
            for name in sub_pool_names(pool):
                assert allocator(pool, name).cached_page(key) is not None, name

    def teardown(self) -> None:
        try:
            self.engine.run()
            self.check_finished()
            assert not self.prompts
            cache_ = self.engine.pool.prefix_cache
            assert cache_ is not None
            cache_.drop_cached()  # type: ignore[attr-defined]
            kept = self.engine.memory_report().state_snapshots
            assert kept is not None and (kept.snapshots, kept.bytes) == (0, 0)
            assert self.engine.memory_report().state_bytes_in_use == 0
        finally:
            self.engine.close()


SnapshotMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_state_snapshot_machine = SnapshotMachine.TestCase
