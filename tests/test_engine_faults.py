"""A step is a transaction: a failure anywhere inside it loses nothing and corrupts nothing.

Failures are injected at every point a step can raise: in the middle of the model's forward
(a decoder layer after earlier layers wrote their K/V; during batched decode and during each
prefill chunk), in the prefill cache factory, in sampling and in the pool's reservation. Each
fault is raised once, as an ``Exception`` (the request it hit is finished with reason
``"error"``, or a failed batch is retried request by request) or as a ``KeyboardInterrupt``
(re-raised, every request as before the step). Afterwards the engine must go on: every
request that finished normally is token-identical to mlx-lm generating it alone, the tokens
handed out by ``step()`` are exactly the request's tokens, and every page is free.

A hypothesis test then drives the engine with random submit / abort / step / faulty-step
sequences on a tight pool and checks the bookkeeping after every operation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_batching import DecodeEngine, RequestStatus
from kv_pool import HybridKVPool
from kv_pool._inspect import held_pages, request_ids
from kv_protocol import layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

VOCAB = 48
WINDOW = 8
LAYERS = 4
CHUNK = 8
PROMPTS: tuple[tuple[int, ...], ...] = (
    tuple(range(3, 8)),
    tuple((7 * i + 2) % VOCAB for i in range(19)),
    tuple((5 * i + 1) % VOCAB for i in range(30)),
    tuple((11 * i + 4) % VOCAB for i in range(11)),
)
MAX_TOKENS = 6
MAX_GEN = 12


@cache
def model() -> nn.Module:
    return build_tiny_model("gpt_oss", window=WINDOW, num_layers=LAYERS, vocab_size=VOCAB)


@cache
def reference(prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(mlx_lm_greedy(model(), prompt, MAX_GEN))


def expected(prompt: tuple[int, ...], max_tokens: int, stops: frozenset[int]) -> list[int]:
    out: list[int] = []
    for token in reference(prompt)[:max_tokens]:
        out.append(token)
        if token in stops:
            break
    return out


class Injected(Exception):
    """The fault the tests raise."""


@dataclass
class Fault:
    """Raise ``kind`` at the ``at``-th call of a hooked point (``at=None``: only count)."""

    at: int | None = None
    kind: type[BaseException] = Injected
    calls: int = 0
    fired: bool = False

    def tick(self) -> None:
        self.calls += 1
        if self.at is not None and self.calls == self.at and not self.fired:
            self.fired = True
            raise self.kind(f"injected at call {self.calls}")


def make_engine(num_pages: int | None = None, max_running: int = 16) -> DecodeEngine:
    m = model()
    pool = HybridKVPool(layout_from_model(m), num_pages=num_pages or 256, page_size=4)
    return build_engine(m, pool=pool, max_running=max_running, prefill_chunk=CHUNK)


@contextmanager
def hooked(engine: DecodeEngine, point: str, fault: Fault) -> Iterator[None]:
    """Make ``fault.tick()`` run at ``point`` while the block runs."""
    if point == "layer":
        layer = model().layers[2]  # type: ignore[attr-defined]
        original = type(layer)

        def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
            fault.tick()
            return original.__call__(self, *args, **kwargs)

        layer.__class__ = type("FaultyLayer", (original,), {"__call__": faulty})
        try:
            yield
        finally:
            layer.__class__ = original
        return
    target: Any
    name: str
    if point == "factory":
        target, name = engine._core, "make_prefill_cache"
    elif point == "sample":
        target, name = engine._core.sampler, "sample"
    elif point == "try_reserve_batch":
        target, name = engine.pool, "try_reserve_batch"
    else:
        raise AssertionError(point)
    real = getattr(target, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fault.tick()
        return real(*args, **kwargs)

    setattr(target, name, wrapped)
    try:
        yield
    finally:
        setattr(target, name, real)


def drive(engine: DecodeEngine, fault: Fault) -> tuple[list[int], dict[int, list[int]], int]:
    """Submit the prompts (two of them late) and step until idle, surviving interrupts."""
    rids = [engine.submit(PROMPTS[0], MAX_TOKENS), engine.submit(PROMPTS[1], MAX_TOKENS)]
    streamed: dict[int, list[int]] = {}
    interrupts = 0
    steps = 0
    while engine.has_work or len(rids) < len(PROMPTS):
        steps += 1
        assert steps < 500, "the engine did not finish"
        if steps == 3:
            rids += [engine.submit(p, MAX_TOKENS) for p in PROMPTS[2:]]
        try:
            out = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for rid, tokens in out.items():
            streamed.setdefault(rid, []).extend(tokens)
    return rids, streamed, interrupts


POINTS = ("layer", "factory", "sample", "try_reserve_batch")


@cache
def clean_calls() -> dict[str, int]:
    """How often each point runs in a fault-free run (every call gets a fault in turn)."""
    counts = {}
    for point in POINTS:
        engine = make_engine()
        fault = Fault()
        with hooked(engine, point, fault):
            rids, _, _ = drive(engine, fault)
        assert [engine.output(r).tokens for r in rids] == [
            tuple(expected(p, MAX_TOKENS, frozenset())) for p in PROMPTS
        ]
        counts[point] = fault.calls
    return counts


def check_pool_empty(engine: DecodeEngine) -> None:
    pool = engine.pool
    assert isinstance(pool, HybridKVPool)
    assert request_ids(pool) == ()
    assert all(s.pages_used == 0 for s in pool.memory_report().sub_pools)


@pytest.mark.parametrize("kind", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS)
def test_a_fault_at_every_call_of_a_step_loses_nothing(
    point: str, kind: type[BaseException]
) -> None:
    total = clean_calls()[point]
    assert total > 0
    for at in range(1, total + 1):
        engine = make_engine()
        fault = Fault(at=at, kind=kind)
        with hooked(engine, point, fault):
            rids, streamed, interrupts = drive(engine, fault)
        assert fault.fired
        errors = []
        for rid, prompt in zip(rids, PROMPTS, strict=True):
            out = engine.output(rid)
            assert out.status is RequestStatus.FINISHED, (point, at, rid)
            assert streamed.get(rid, []) == list(out.tokens), (point, at, rid)
            want = expected(prompt, MAX_TOKENS, frozenset())
            if out.finish_reason == "error":
                errors.append(rid)
                assert isinstance(out.error, Injected)
                assert list(out.tokens) == want[: len(out.tokens)]
            else:
                assert out.finish_reason == "length", (point, at, out.finish_reason)
                assert list(out.tokens) == want, (point, at, rid)
        if kind is KeyboardInterrupt:
            assert interrupts == 1 and not errors, (point, at)
        else:
            # A prefill fault ends the request it hit; a decode fault is retried alone.
            assert len(errors) <= 1, (point, at, errors)
            assert engine.stats.errors == len(errors)
        check_pool_empty(engine)


def test_a_request_that_keeps_failing_alone_is_finished_and_the_others_go_on() -> None:
    engine = make_engine()
    rids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
    poisoned = rids[2]
    runner = engine._core.runner
    real = runner.decode

    def decode(reservation: Any, *args: Any) -> Any:
        # Every decode batch that holds `poisoned` fails, after the reservation was made.
        out = real(reservation, *args)
        if poisoned in reservation.request_ids:
            raise Injected("poisoned request in the batch")
        return out

    runner.decode = decode  # type: ignore[method-assign,assignment]
    engine.run()
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        out = engine.output(rid)
        if rid == poisoned:
            assert out.finish_reason == "error"
            assert isinstance(out.error, Injected)
        else:
            assert list(out.tokens) == expected(prompt, MAX_TOKENS, frozenset())
    assert engine.stats.errors == 1
    check_pool_empty(engine)


# ---------------------------------------------------------------------- property test

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, MAX_GEN),
            st.booleans(),
        ),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(
            st.just("fault"),
            st.sampled_from(POINTS),
            st.integers(1, 6),
            st.sampled_from([Injected, KeyboardInterrupt]),
        ),
    ),
    min_size=1,
    max_size=40,
)


@dataclass
class Submitted:
    prompt: tuple[int, ...]
    max_tokens: int
    stops: frozenset[int]


def check_bookkeeping(engine: DecodeEngine, submitted: dict[int, Submitted]) -> None:
    pool = engine.pool
    assert isinstance(pool, HybridKVPool)
    live = {
        rid
        for rid in submitted
        if engine.output(rid).status in (RequestStatus.PREFILLING, RequestStatus.RUNNING)
    }
    assert set(request_ids(pool)) == live
    for sub in pool.memory_report().sub_pools:
        held = sum(len(held_pages(pool, rid, sub.name)) for rid in live)
        assert sub.pages_used == held
    queued = [r for r in submitted if engine.output(r).status is RequestStatus.QUEUED]
    assert engine.num_queued == len(queued)
    assert engine.num_running == sum(
        engine.output(r).status is RequestStatus.RUNNING for r in submitted
    )
    for rid, sub_req in submitted.items():
        out = engine.output(rid)
        want = expected(sub_req.prompt, sub_req.max_tokens, sub_req.stops)
        if out.status is RequestStatus.FINISHED:
            assert out.finish_reason is not None
            if out.finish_reason in ("stop", "length"):
                assert list(out.tokens) == want, rid
            else:
                assert list(out.tokens) == want[: len(out.tokens)], rid
                assert (out.error is not None) == (out.finish_reason == "error")
        else:
            assert out.finish_reason is None
            assert list(out.tokens) == want[: len(out.tokens)], rid


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(ops=OPS)
def test_random_operations_and_faults_keep_the_books(ops: list[tuple[Any, ...]]) -> None:
    for prompt in PROMPTS:
        reference(prompt)
    # Tight: about two requests' worth of full-layer pages, so requests queue and preempt.
    engine = make_engine(num_pages=14, max_running=3)
    submitted: dict[int, Submitted] = {}
    for op in ops:
        if op[0] == "submit":
            prompt = PROMPTS[op[1]]
            stops = frozenset({reference(prompt)[op[2] // 2]}) if op[3] else frozenset()
            rid = engine.submit(prompt, op[2], stop_tokens=stops)
            submitted[rid] = Submitted(prompt, op[2], stops)
        elif op[0] == "abort":
            if op[1] in submitted:
                engine.abort(op[1])
        elif op[0] == "step":
            engine.step()
        else:
            fault = Fault(at=op[2], kind=op[3])
            with hooked(engine, op[1], fault):
                for _ in range(3):
                    with suppress(KeyboardInterrupt):
                        engine.step()
        check_bookkeeping(engine, submitted)
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 1000
        engine.step()
        check_bookkeeping(engine, submitted)
    check_pool_empty(engine)


def test_the_fault_hook_itself_can_fail() -> None:
    """Guard: the layer hook really interrupts a forward (else the tests above prove nothing)."""
    engine = make_engine()
    fault = Fault(at=1, kind=Injected)
    engine.submit(PROMPTS[0], 2)
    with hooked(engine, "layer", fault), pytest.raises(Injected):
        engine._model(mx.array([[1, 2]]))
    assert fault.calls == 1
    with hooked(engine, "layer", fault):
        engine._model(mx.array([[1, 2]]))  # a fault fires once
    assert fault.calls == 2
