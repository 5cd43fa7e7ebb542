"""A state machine over speculative decoding with partial acceptances, preemption and aborts.

Random submit / step / preempt / abort sequences, with proposals right for a drawn number of
tokens and wrong after, drive an engine serving a model with full, sliding-window and
recurrent STATE layers (proposals verified as rows of the shared decode step, the recurrent
mixers running each request's rows in order; and again with the mixers left as they are, each
request verified by a forward of its own), and one with full and sliding-window layers only,
on a pool too small for everything. After every rule: each request in the pool holds exactly
the positions the engine says it has, and in each full-attention sub-pool exactly the pages
those positions need (rejected positions came back); a sliding sub-pool holds no more pages
than its window needs; each decoding request's full-attention K/V and recurrent state equal
mlx-lm's over its tokens. Every finished request's tokens equal
mlx-lm generating its prompt alone; when everything is done and the prefix cache dropped,
every page is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

from kv_batching import DecodeEngine, RequestStatus, SpeculationConfig
from kv_batching._ragged_state import RaggedStateMixers
from kv_pool import HybridKVPool
from kv_pool._inspect import held_pages
from kv_protocol import flatten_caches, layout_from_model
from kv_serve import build_engine
from kv_testing import build_zoo_model, mlx_lm_greedy, mlx_lm_states, states_close

VOCAB = 128
PAGE = 4
CHUNK = 8  # prefill chunk
PROPOSAL = 4  # longest proposal
BASES = (
    [(5 * j + 2) % VOCAB for j in range(12)] * 2,
    [(3 * j + 7) % VOCAB for j in range(20)],
    [(11 * j + 1) % VOCAB for j in range(9)] * 3,
)


@cache
def model(arch: str) -> nn.Module:
    return build_zoo_model(arch)


@cache
def mlx_lm_full_kv(arch: str, tokens: tuple[int, ...]) -> dict[int, tuple[mx.array, mx.array]]:
    """Token-major ``(T, n_kv_heads, head_dim)`` K/V of every full-attention layer after mlx-lm
    runs ``tokens`` on its own caches."""
    layout = layout_from_model(model(arch))
    caches = make_prompt_cache(model(arch))
    mx.eval(model(arch)(mx.array([list(tokens)], dtype=mx.int32), cache=caches))
    flat: list[Any] = flatten_caches(caches)
    out = {}
    for layer_id in layout.full_layer_ids:
        keys, values = flat[layer_id].keys, flat[layer_id].values
        n = len(tokens)
        out[layer_id] = (
            keys[0, :, :n].transpose(1, 0, 2),
            values[0, :, :n].transpose(1, 0, 2),
        )
    return out


@cache
def greedy(arch: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(mlx_lm_greedy(model(arch), list(prompt), max_tokens))


class Oracle:
    """Proposes mlx-lm's continuation, right for ``right`` tokens and wrong after."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.right = 1
        self.prompts: dict[tuple[int, ...], int] = {}

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for prompt, max_tokens in self.prompts.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                truth = greedy(self.arch, prompt, max_tokens)[done : done + k]
                return [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(truth)]
        return []


class SpeculationMachine(RuleBasedStateMachine):
    #: Full, sliding (window 8) and recurrent state layers: proposals verified as rows of the
    #: shared decode step, the recurrent mixer running each request's rows in order.
    arch = "gear"

    def __init__(self) -> None:
        super().__init__()
        self.oracle = Oracle(self.arch)
        self.engine: DecodeEngine = build_engine(
            model(self.arch),
            num_pages=18,
            page_size=PAGE,
            max_running=3,
            prefill_chunk=CHUNK,
            state_snapshot_interval=8,
            # Without the step-rate gate: it decides by measured seconds, so a replayed
            # example would verify in other steps and hypothesis would see another machine.
            speculative=SpeculationConfig(
                proposer=self.oracle,
                num_tokens=PROPOSAL,
                max_batch=3,
                cooldown=0,
                compare_rates=False,
            ),
        )
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.max_tokens: dict[int, int] = {}

    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.sampled_from([6, 11, 16, 20]),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=3),
        max_tokens=st.integers(1, 12),
    )
    def submit(self, base: int, cut: int, tail: list[int], max_tokens: int) -> None:
        prompt = (*BASES[base][:cut], *tail)
        if prompt in self.oracle.prompts:
            max_tokens = self.oracle.prompts[prompt]
        self.oracle.prompts[prompt] = max_tokens
        rid = self.engine.submit(list(prompt), max_tokens)
        self.prompts[rid] = prompt
        self.max_tokens[rid] = max_tokens

    @rule(right=st.integers(0, 5))
    def accuracy(self, right: int) -> None:
        self.oracle.right = right

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.engine.step()
        self.check_finished()

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
                want = greedy(self.arch, self.prompts[rid], self.max_tokens[rid])
                assert out.tokens == want, (self.prompts[rid], out.tokens, want)
                self.prompts.pop(rid)

    @invariant()
    def no_verification_fell_back(self) -> None:
        assert self.engine.stats.decode_fallbacks == 0

    @invariant()
    def running_requests_hold_plain_decoding_s_kv_and_state(self) -> None:
        """Each decoding request's full-attention K/V and recurrent state are what mlx-lm's
        model computes over its tokens: speculation left nothing of a rejected token."""
        layout = layout_from_model(model(self.arch))
        pool = self.engine.pool
        for request in self.engine._core.scheduler.running:
            tokens = [*request.prompt, *request.generated[:-1]]
            want_kv = mlx_lm_full_kv(self.arch, tuple(tokens))
            for layer_id, (keys, values) in want_kv.items():
                slots = pool.token_slots(request.rid, layer_id, 0, len(tokens))
                got_keys, got_values = pool.get_kv(layer_id, slots)
                assert mx.allclose(got_keys, keys, rtol=1e-4, atol=1e-5), (request.rid, layer_id)
                assert mx.allclose(got_values, values, rtol=1e-4, atol=1e-5)
            if layout.state_layer_ids:
                want = mlx_lm_states(model(self.arch), tokens)
                assert states_close(request.states or [], want), request.rid

    @invariant()
    def pages_held_are_pages_needed(self) -> None:
        pool = self.engine.pool
        assert isinstance(pool, HybridKVPool)
        scheduler = self.engine._core.scheduler
        expected = {r.rid: len(r.prompt) + len(r.generated) - 1 for r in scheduler.running}
        if scheduler.prefilling is not None:
            expected[scheduler.prefilling.rid] = scheduler.prefilling.prefilled
        for rid, length in expected.items():
            assert pool.seq_len(rid) == length, (rid, pool.seq_len(rid), length)
            for spec in pool.sub_pools:
                held = len(held_pages(pool, rid, spec.name))
                if spec.window is None:
                    assert held == -(-length // spec.page_size), (spec.name, held, length)
                else:
                    # The last reservation (a prefill chunk or a verification) released what
                    # its first query could not see and added its positions: at most
                    # window - 1 + its size, plus a page of alignment.
                    widest = max(CHUNK, PROPOSAL + 1)
                    bound = -(-(spec.window - 1 + widest) // spec.page_size) + 1
                    assert held <= bound, (spec.name, held, bound)

    def teardown(self) -> None:
        try:
            self.engine.run()
            self.check_finished()
            assert not self.prompts
            cache_ = self.engine.pool.prefix_cache
            assert cache_ is not None
            cache_.drop_cached()  # type: ignore[attr-defined]
            assert sum(self.engine.pool.memory_report().pages_used.values()) == 0
        finally:
            self.engine.close()


class BatchedVerificationMachine(SpeculationMachine):
    #: Full and sliding layers only: proposals verified as rows of the shared decode step.
    arch = "gpt_oss"


class PerRequestVerificationMachine(SpeculationMachine):
    """The state hybrid with its mixers as the model has them: each verification is a forward
    of its own (what a model gets whose mixers cannot run a step's rows)."""

    def __init__(self) -> None:
        super().__init__()
        runner = self.engine._core.runner
        assert runner.surgery.uninstall(RaggedStateMixers) > 0
        assert runner.ragged_state_mixers is None


for machine in (SpeculationMachine, BatchedVerificationMachine, PerRequestVerificationMachine):
    machine.TestCase.settings = settings(
        max_examples=30,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
test_speculation_machine = SpeculationMachine.TestCase
test_batched_verification_machine = BatchedVerificationMachine.TestCase
test_per_request_verification_machine = PerRequestVerificationMachine.TestCase
