"""The lock-step engine without processes: a leader and a follower in one process.

Both ranks serve the same unsharded model (the sharded forward is tested across processes in
``test_serve_tensor_parallel.py``); a fake group carries the leader's messages, tokens and
prefill budgets to the follower in order. The follower's engine has another sampling seed
and another prefill budget (the leader bounds prefill by measured time, the follower would
prefill whole chunks), so only the agreement keeps them in step: a
hypothesis state machine submits (greedy, seeded, unseeded; ``n`` up to 2), aborts and steps
on the leader, and after each step the follower must have produced the same tokens with the
same fingerprint. Also: the message codec round trip, refusals, and a diverged follower.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kv_batching import SamplingParams
from kv_protocol import RequestStateError, UnsupportedModelError
from kv_serve import LockstepEngine, RankGroup, RankLostError, build_engine, shard_model
from kv_serve._lockstep import _read_submit, _Reader, _write_submit, _Writer
from kv_testing import build_tiny_model, build_zoo_model


class _Group:
    def __init__(self, rank: int, size: int = 2) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Wire:
    """What the leader said, in order, for the follower to hear."""

    def __init__(self) -> None:
        self.messages: deque[list[int]] = deque()
        self.tokens: deque[list[int]] = deque()


def _lost(message: str) -> None:
    raise AssertionError(message)


class FakeRanks(RankGroup):
    """A rank whose collectives are the wire (leader writes, follower reads)."""

    def __init__(self, rank: int, wire: _Wire) -> None:
        super().__init__(_Group(rank), timeout=600, heartbeat=300, on_lost=_lost)  # type: ignore[arg-type]
        self.wire = wire

    @contextlib.contextmanager
    def watch(self, what: str, seconds: float | None = None) -> Iterator[None]:
        yield

    def broadcast(self, values: Any, what: str) -> list[int]:
        if self.is_leader:
            self.wire.messages.append([int(v) for v in values])
            return [int(v) for v in values]
        assert self.wire.messages, (
            f"the follower waits for a message the leader never sent ({what})"
        )
        return self.wire.messages.popleft()

    def all_min(self, values: Any, what: str, seconds: float | None = None) -> list[int]:
        return list(values)

    def all_gather(self, value: int, what: str, seconds: float | None = None) -> list[int]:
        return [value, value]

    def tokens(self, tokens: mx.array) -> mx.array:
        if self.is_leader:
            mx.eval(tokens)
            self.wire.tokens.append(cast(list[int], tokens.tolist()))
            return tokens
        leader = self.wire.tokens.popleft()
        assert len(leader) == tokens.shape[0], "the ranks sampled batches of different sizes"
        return mx.array(leader, dtype=tokens.dtype) + tokens * 0


def make_pair(
    arch: str, *, prefill_stall: float | None = None, **kwargs: Any
) -> tuple[LockstepEngine, LockstepEngine]:
    """A leader and its follower; the follower samples from another seed and, where the
    leader bounds prefill by time, prefills whole chunks: only agreement keeps them together.
    """
    wire = _Wire()
    engines = []
    for rank, seed, stall in ((0, 0, prefill_stall), (1, 12345, None)):
        model = build_zoo_model(arch)
        engine = build_engine(
            model, ranks=FakeRanks(rank, wire), seed=seed, prefill_stall=stall, **kwargs
        )
        assert isinstance(engine, LockstepEngine)
        engines.append(engine)
    return engines[0], engines[1]


PROMPTS = st.lists(st.integers(1, 127), min_size=1, max_size=30)


class LockstepMachine(RuleBasedStateMachine):
    """Leader and follower stay token-identical under submits, aborts and preemption."""

    leader: LockstepEngine
    follower: LockstepEngine

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[int] = []

    @initialize()
    def crowd(self) -> None:
        # Three requests that outgrow the pool together: preemption in every example.
        for first in (10, 40, 70):
            prompt = list(range(first, first + 20))
            self.ids += self.leader.submit_n(prompt, 10, 1, sampling=SamplingParams())

    @rule(
        prompt=PROMPTS,
        max_tokens=st.integers(1, 10),
        mode=st.sampled_from(["greedy", "seeded", "unseeded"]),
        n=st.integers(1, 2),
    )
    def submit(self, prompt: list[int], max_tokens: int, mode: str, n: int) -> None:
        params = SamplingParams(
            temperature=0.0 if mode == "greedy" else 1.0,
            seed=11 if mode == "seeded" else None,
        )
        try:
            self.ids += self.leader.submit_n(
                prompt, max_tokens, n, sampling=params, stop_tokens=[3]
            )
        except RequestStateError as error:
            # The documented refusal of n sequences that could never be in the pool
            # together: nothing is queued, and nothing reaches the follower.
            assert n > 1 and "sequences of" in str(error), error

    @precondition(lambda self: bool(self.ids))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.ids))
        if not self.leader.is_finished(rid):
            self.leader.abort(rid)

    @rule()
    def step(self) -> None:
        self._step()

    def _step(self) -> None:
        produced = self.leader.step()
        theirs = self.follower.follow_step()
        assert theirs == produced
        for rid in [r for r in self.ids if self.leader.is_finished(r)]:
            self.ids.remove(rid)
            self.leader.release(rid)
        # After each step (submits and aborts reach the follower with the next one).
        assert self.leader.fingerprint() == self.follower.fingerprint()
        assert self.follower.num_running == self.leader.num_running
        assert self.follower.num_queued == self.leader.num_queued

    def teardown(self) -> None:
        for _ in range(200):
            if not self.ids and not self.leader.num_running and not self.leader.num_queued:
                break
            self._step()
        assert not self.ids
        assert self.follower.num_requests == 0


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5"])
def test_follower_produces_the_leaders_tokens(arch: str) -> None:
    # A small pool (preemption) and a time-bounded prefill budget (measured per rank).
    leader, follower = make_pair(
        arch, num_pages=14, page_size=4, max_running=3, prefill_chunk=32, prefill_stall=0.5
    )
    LockstepMachine.leader, LockstepMachine.follower = leader, follower
    run_state_machine_as_test(
        LockstepMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    leader.close()
    assert follower.follow_step() is None  # the leader's close reached the follower
    assert leader.stats.preemptions > 0


def test_a_diverged_follower_is_an_error_not_wrong_text() -> None:
    leader, follower = make_pair("gemma3_text", num_pages=32, page_size=4)
    rid = leader.submit([5, 6, 7], 8)
    leader.step()
    assert follower.follow_step() is not None
    # The follower ends a request by itself: its schedule no longer matches the leader's.
    follower.abort(rid)
    leader.step()
    with pytest.raises(AssertionError, match="scheduling diverged"):
        follower.follow_step()


def test_followers_take_no_requests_and_nothing_rolls_back() -> None:
    leader, follower = make_pair("gemma3_text", num_pages=32, page_size=4)
    with pytest.raises(RequestStateError, match="rank 1 is a follower"):
        follower.submit([5, 6], 3)
    with pytest.raises(RequestStateError, match="rank 1 is a follower"):
        follower.step()
    with pytest.raises(RequestStateError, match="follow\\(\\) is for followers"):
        leader.follow_step()
    rid = leader.submit([5, 6, 7], 4)
    leader.step()
    with pytest.raises(RequestStateError, match="restore\\(\\) is not supported"):
        leader.restore(rid, 3)
    # A refused request is not sent: the follower sees the leader's one request only.
    with pytest.raises(RequestStateError, match="prompt_tokens"):
        leader.submit([5, 10**6], 3)
    with pytest.raises(RequestStateError, match="constraint must carry the grammar"):
        leader.submit_n([5], 3, 1, sampling=SamplingParams(constraint=lambda: None))  # type: ignore[arg-type, return-value]
    assert follower.follow_step() is not None
    leader.step()
    assert follower.follow_step() is not None
    assert follower.fingerprint() == leader.fingerprint()


def test_a_state_budget_set_on_the_leader_reaches_the_follower() -> None:
    leader, follower = make_pair("qwen3_5", num_pages=32, page_size=4)
    leader.state_budget_bytes = 1 << 20
    with pytest.raises(RequestStateError, match="rank 1 is a follower"):
        follower.state_budget_bytes = 1
    assert follower.state_budget_bytes is None
    leader.step()  # an idle step carries it
    assert follower.follow_step() is not None
    assert follower.state_budget_bytes == 1 << 20
    leader.state_budget_bytes = None
    leader.step()
    assert follower.follow_step() is not None
    assert follower.state_budget_bytes is None


def test_speculation_is_refused_on_ranks() -> None:
    with pytest.raises(RequestStateError, match="tensor-parallel ranks"):
        make_pair("gemma3_text", num_pages=32, speculative="ngram")


@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20),
    stops=st.lists(st.integers(0, 1000), max_size=4),
    max_tokens=st.integers(1, 2**40),
    n=st.integers(1, 16),
    temperature=st.floats(0, 100),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 2**40),
    min_p=st.floats(0, 1),
    penalties=st.tuples(st.floats(-2, 2), st.floats(-2, 2), st.floats(0.01, 10)),
    bias=st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    min_tokens=st.integers(0, 50),
    seed=st.none() | st.integers(0, 2**64 - 1),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
)
def test_a_submit_event_travels_whole(**case: Any) -> None:
    presence, frequency, repetition = case["penalties"]
    params = SamplingParams(
        temperature=case["temperature"],
        top_p=case["top_p"],
        top_k=case["top_k"],
        min_p=case["min_p"],
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=case["bias"],
        min_tokens=case["min_tokens"],
        seed=case["seed"],
        logprobs=case["logprobs"],
        prompt_logprobs=case["prompt_logprobs"],
    )
    out = _Writer()
    stops = sorted(set(case["stops"]))
    _write_submit(out, 41, case["prompt"], case["max_tokens"], case["n"], params, stops, None)
    reader = _Reader(out.words)
    assert reader.int32() == 1  # a submit event
    got = _read_submit(reader, None)
    assert reader.done
    assert got == (41, case["prompt"], case["max_tokens"], case["n"], params, stops)


def test_a_grammar_travels_as_its_text() -> None:
    out = _Writer()
    params = SamplingParams()
    object.__setattr__(params, "constraint", _Grammar('start: "é" /[a-z]+/'))
    _write_submit(out, 0, [1], 2, 1, params, [], 'start: "é" /[a-z]+/')
    reader = _Reader(out.words)
    reader.int32()
    seen: list[str] = []
    _read_submit(reader, lambda text: seen.append(text) or _Grammar(text))  # type: ignore[func-returns-value]
    assert seen == ['start: "é" /[a-z]+/']
    with pytest.raises(RankLostError, match="no grammar compiler"):
        reader = _Reader(out.words)
        reader.int32()
        _read_submit(reader, None)


class _Grammar:
    def __init__(self, grammar: str) -> None:
        self.grammar = grammar

    def __call__(self) -> Any:
        raise NotImplementedError


def test_models_that_cannot_be_split_are_refused_whole() -> None:
    # mlx-lm's rule (llama) divides the KV heads: one KV head over two ranks is refused.
    model = build_tiny_model("llama", num_key_value_heads=1)
    before = [mx.array(v) for v in _weights(model)]
    with pytest.raises(UnsupportedModelError, match="1 KV heads, which 2 ranks cannot split"):
        shard_model(model, _Group(0))  # type: ignore[arg-type]
    assert all(mx.array_equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    # Gemma 3: KV heads that neither divide nor are divided by the ranks.
    model = build_tiny_model("gemma3_text", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(UnsupportedModelError, match="neither split them evenly nor replicate"):
        shard_model(model, _Group(0, size=2))  # type: ignore[arg-type]
    model = build_tiny_model("gemma3_text", num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="4 query heads, which 3 ranks cannot split"):
        shard_model(model, _Group(0, size=3))  # type: ignore[arg-type]
    # OLMo 3 normalises queries and keys over all heads at once: no rule splits that.
    with pytest.raises(UnsupportedModelError, match="olmo3 layer 0's q_norm normalises across"):
        shard_model(build_tiny_model("olmo3"), _Group(0))  # type: ignore[arg-type]
    # A state hybrid without mlx-lm's rule: its recurrent layers have none here.
    with pytest.raises(UnsupportedModelError, match="lfm2 has no tensor-parallel sharding"):
        shard_model(build_zoo_model("lfm2"), _Group(0))  # type: ignore[arg-type]


def _weights(model: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten

    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return [v for _, v in flat]
