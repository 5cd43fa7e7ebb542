"""Models with recurrent STATE layers (linear attention, SSM, short convolution) in the engine.

Each request's state lives in its own caches from the model's ``make_cache()``, stacked for
a batched decode step and split back after it. The oracle is mlx-lm generating each prompt
alone with the model's own caches.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import given, settings

from kv_batching._state_cache import (
    StackedStateCache,
    group_by_state_shapes,
    state_nbytes,
    state_shapes,
)
from kv_batching._state_snapshots import StateSnapshot
from kv_protocol import CacheStateError
from kv_serve import build_engine
from kv_testing import build_zoo_model, mlx_lm_greedy

VOCAB = 128
PROMPTS = [[(7 * i + 3 * j + 1) % VOCAB for j in range(n)] for i, n in enumerate((2, 9, 17, 30))]
MAX_TOKENS = 10
STATE_ARCHS = ["qwen3_next", "lfm2", "jamba", "gear"]


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_preempted_requests_recompute_their_state(arch: str) -> None:
    model = build_zoo_model(arch)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    # Too few pages for all four at once: the newest are preempted and re-prefilled.
    with build_engine(model, num_pages=14, page_size=4, max_running=4, prefill_chunk=8) as engine:
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
        out = engine.run()
        assert engine.stats.preemptions > 0
        assert [out[i] for i in ids] == want
        assert engine.memory_report().state_bytes_in_use == 0
        assert all(n == 0 for n in (engine.memory_report().pages_used or {}).values())


def test_abort_drops_the_state_and_the_others_go_on() -> None:
    model = build_zoo_model("qwen3_next")
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    with build_engine(model, max_running=4, max_context=64, page_size=6) as engine:
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
        for _ in range(6):
            engine.step()
        held = engine.memory_report().state_bytes_in_use
        assert held > 0
        assert engine.abort(ids[1])
        assert engine.memory_report().state_bytes_in_use < held
        out = engine.run()
        assert [out[i] for i in (ids[0], ids[2], ids[3])] == [want[0], want[2], want[3]]
        assert engine.output(ids[1]).finish_reason == "aborted"
        assert engine.memory_report().state_bytes_in_use == 0


def test_state_budget_bounds_the_running_requests() -> None:
    model = build_zoo_model("lfm2")
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    probe = build_engine(model, max_running=1, max_context=64)
    probe.submit(PROMPTS[0], 1)
    probe.run()
    per = probe.memory_report().state_bytes_per_request
    probe.close()
    assert per is not None and per > 0
    # Without prefix caching a running request holds its state only; with it, also the
    # snapshot of the last boundary it decoded past, which admission counts too.
    for caching, running in ((False, 2), (True, 1)):
        engine = build_engine(model, max_running=4, max_context=64, prefix_caching=caching)
        engine.state_budget_bytes = 2 * per
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
        most = 0
        while engine.has_work:
            engine.step()
            most = max(most, engine.memory_report().state_bytes_in_use)
            assert engine.num_running <= running
        assert most <= 2 * per
        assert [list(engine.output(i).tokens) for i in ids] == want
        engine.close()


class _Slots:
    """A stand-in for mlx-lm's ArraysCache: a list of state slots."""

    def __init__(self, values: list[mx.array | None]) -> None:
        self.cache = values


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), slots=st.integers(1, 3), width=st.integers(1, 4))
def test_stacked_state_splits_back_into_its_rows(rows: int, slots: int, width: int) -> None:
    caches = [
        _Slots([mx.full((1, width), float(10 * r + s)) for s in range(slots)]) for r in range(rows)
    ]
    before = [[mx.array(v) for v in c.cache if v is not None] for c in caches]
    stacked = StackedStateCache(3, caches)
    assert stacked.batch_size == rows
    stacked.make_mask(1)  # returns None: no row of a decode step is padded
    for s in range(slots):
        value = stacked[s]
        assert value is not None and value.shape == (rows, width)
        stacked[s] = value + 1.0
    # Until split, the rows are untouched (a step that raises leaves them as they were).
    for cache, old in zip(caches, before, strict=True):
        for a, b in zip(cache.cache, old, strict=True):
            assert a is not None and bool(mx.array_equal(a, b))
    stacked.split()
    for r, (cache, old) in enumerate(zip(caches, before, strict=True)):
        for s, (a, b) in enumerate(zip(cache.cache, old, strict=True)):
            assert a is not None and a.shape == (1, width)
            assert bool(mx.array_equal(a, b + 1.0)), (r, s)
    assert state_nbytes(caches) == rows * slots * width * 4


def test_stacked_state_refuses_rows_half_prefilled() -> None:
    with pytest.raises(CacheStateError, match="set in some rows and empty in others"):
        StackedStateCache(0, [_Slots([mx.zeros((1, 2))]), _Slots([None])])
    with pytest.raises(CacheStateError, match="slots"):
        StackedStateCache(0, [_Slots([None]), _Slots([None, None])])
    assert StackedStateCache(0, [_Slots([None]), _Slots([None])]).empty()


def test_snapshot_gives_back_the_state_it_copied_whatever_changed_since() -> None:
    cache: Any = _Slots([None, mx.ones((1, 2))])
    cache.lengths = None
    snapshot = StateSnapshot([cache], 7)
    cache.cache[0] = mx.zeros((1, 3))
    cache.cache[1] = mx.full((1, 2), 5.0)
    cache.lengths = mx.array([4])
    (back,) = snapshot.caches()
    assert snapshot.position == 7 and snapshot.nbytes == 8
    assert type(back) is type(cache) and back is not cache
    assert back.cache[0] is None
    assert bool(mx.array_equal(back.cache[1], mx.ones((1, 2))))
    assert back.lengths is None
    back.cache[1] = mx.zeros((1, 2))  # a copy handed out changes nothing kept
    assert bool(mx.array_equal(snapshot.caches()[0].cache[1], mx.ones((1, 2))))


def test_states_of_different_shapes_decode_in_groups_not_one_by_one() -> None:
    """longcat_flash_ngram keeps the last n - 1 tokens as its n-gram state, so a request with
    a shorter history has a narrower state: such rows decode in separate batched calls (one
    per shape) instead of failing the batch and retrying each request alone."""
    model = build_zoo_model("longcat_flash_ngram")
    prompts = [[5], [9, 4], [3, 1, 4, 1, 5], [2], [7, 7, 7, 7, 7, 7]]
    want = [mlx_lm_greedy(model, p, 6) for p in prompts]
    with build_engine(model, max_running=8, page_size=4, prefill_chunk=64) as engine:
        ids = [engine.submit(p, 6) for p in prompts]
        out = engine.run()
        assert [out[i] for i in ids] == want
        assert engine.stats.decode_fallbacks == 0
        # Batched, not one request per decode: more than one row per decode call on average.
        assert engine.stats.mean_decode_batch_size > 1


def test_group_by_state_shapes_keeps_order_and_stacks_equal_shapes() -> None:
    class Row:
        def __init__(self, *widths: int | None) -> None:
            self.cache = [None if w is None else mx.zeros((1, w)) for w in widths]

    rows = [("a", [Row(2)]), ("b", [Row(1)]), ("c", [Row(2)]), ("d", [Row(None)])]
    groups = group_by_state_shapes(rows, lambda row: row[1])
    assert [[name for name, _ in g] for g in groups] == [["a", "c"], ["b"], ["d"]]
    assert state_shapes([Row(3, None)]) == (((3,), None),)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_next", "mamba"])
def test_state_bytes_are_known_when_built_and_in_the_memory_report(arch: str) -> None:
    model = build_zoo_model(arch)
    with build_engine(model, max_running=4, max_context=64) as engine:
        per = engine.memory_report().state_bytes_per_request
        assert per is not None and per > 0  # measured before any request: admission holds
        idle = engine.memory_report()
        assert idle.state_bytes_in_use == 0 and idle.state_bytes_per_request == per
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS[:3]]
        while engine.num_running < 3:
            engine.step()
        report = engine.memory_report()
        # A fixed-size state: three running requests hold three states of the measured size.
        assert report.state_bytes_in_use == 3 * per == engine.memory_report().state_bytes_in_use
        assert report.bytes_in_use == (report.pool_bytes_used or 0) + 3 * per
        if engine.pool.layout.attention_layer_ids:
            assert report.pool_bytes_used is not None and report.pool_bytes_used > 0
        engine.run()
        assert engine.memory_report().state_bytes_in_use == 0
        assert all(engine.output(i).finish_reason == "length" for i in ids)


def test_a_state_budget_passed_to_build_engine_caps_admission() -> None:
    model = build_zoo_model("lfm2")
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    per = build_engine(model, max_running=1, max_context=64).memory_report().state_bytes_per_request
    assert per is not None
    with build_engine(model, max_running=4, max_context=64, state_budget_bytes=per) as engine:
        assert engine.memory_report().state_budget_bytes == per
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
        while engine.has_work:
            engine.step()
            assert engine.num_running <= 1
        assert [list(engine.output(i).tokens) for i in ids] == want


@pytest.mark.parametrize("caching", [False, True])
def test_a_budget_below_one_state_runs_requests_one_at_a_time(caching: bool) -> None:
    model = build_zoo_model("lfm2")
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    with build_engine(
        model, max_running=4, max_context=64, state_budget_bytes=1, prefix_caching=caching
    ) as engine:
        ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
        for _ in range(500):
            if not engine.has_work:
                break
            engine.step()
            assert engine.num_running <= 1
        assert not engine.has_work, "a budget below one request's state must not stall"
        assert [list(engine.output(i).tokens) for i in ids] == want
