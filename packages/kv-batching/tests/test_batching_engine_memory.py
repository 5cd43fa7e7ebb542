"""Bounded memory of a long-running engine: release() forgets requests, stats keep windows.

A server submits requests for ever: the engine must not keep every request it was given,
and its statistics must not grow one entry per step for ever. The counters and aggregates
stay exact whatever the window.
"""

from __future__ import annotations

import tracemalloc
from functools import cache
from typing import Any

import pytest
from batching_fakes import FakeKernels, fake_prefill_cache

from kv_batching import DecodeEngine, EngineStats, RequestStatus
from kv_protocol import RequestStateError, UnknownRequestError, layout_from_model
from kv_testing import ReferenceKVPool, build_tiny_model, mlx_lm_greedy

PROMPTS = [[(7 * i + 3 * j + 2) % 64 for j in range(n)] for i, n in enumerate((2, 5, 9, 3))]
MAX_TOKENS = 6


@cache
def model() -> Any:
    return build_tiny_model("gpt_oss", window=4, num_layers=4, vocab_size=64)


@cache
def reference(i: int) -> list[int]:
    return mlx_lm_greedy(model(), PROMPTS[i], MAX_TOKENS)


def engine(**kwargs: Any) -> DecodeEngine:
    pool = ReferenceKVPool(layout_from_model(model()), num_pages=64, page_size=2)
    return DecodeEngine(model(), pool, FakeKernels(), fake_prefill_cache, **kwargs)


def test_release_forgets_a_finished_request_and_returns_its_output() -> None:
    e = engine()
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
    assert e.num_requests == len(PROMPTS)
    e.run()
    for i, rid in enumerate(ids):
        assert e.is_finished(rid)
        out = e.release(rid)
        assert list(out.tokens) == reference(i)
        assert out.finish_reason == "length" and out.status is RequestStatus.FINISHED
        assert tuple(PROMPTS[i]) == out.prompt_tokens
    assert e.num_requests == 0
    with pytest.raises(UnknownRequestError, match="released"):
        e.output(ids[0])
    with pytest.raises(UnknownRequestError, match="released"):
        e.release(ids[0])
    with pytest.raises(UnknownRequestError, match="never submitted"):
        e.output(ids[-1] + 1)


def test_release_refuses_an_active_request_until_it_is_aborted() -> None:
    e = engine()
    rid = e.submit(PROMPTS[2], MAX_TOKENS)
    with pytest.raises(RequestStateError, match="queued"):
        e.release(rid)
    e.step()
    assert not e.is_finished(rid)
    with pytest.raises(RequestStateError, match="abort it"):
        e.release(rid)
    assert e.abort(rid)
    assert e.release(rid).finish_reason == "aborted"
    assert e.num_requests == 0 and not e.has_work


def test_released_requests_do_not_disturb_the_others() -> None:
    e = engine(max_running=2)
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
    done: dict[int, list[int]] = {}
    for _ in range(200):
        if not e.has_work:
            break
        e.step()
        for i, rid in enumerate(ids):
            if i not in done and e.is_finished(rid):
                done[i] = list(e.release(rid).tokens)
    assert done == {i: reference(i) for i in range(len(PROMPTS))}
    assert e.num_requests == 0


def test_stats_series_are_bounded_and_aggregates_exact() -> None:
    bounded = engine(max_running=2, stats_window=3)
    unbounded = engine(max_running=2, stats_window=None)
    for e in (bounded, unbounded):
        for p in PROMPTS:
            e.submit(p, MAX_TOKENS)
        e.run()
    full, short = unbounded.stats, bounded.stats
    assert full.steps == short.steps > 3
    assert len(full.queue_length) == full.steps and len(full.running) == full.steps
    assert len(short.queue_length) == 3 and len(short.pages_used) == 3
    assert len(short.decode_step_seconds) == 3 and len(short.decode_batch_sizes) == 3
    assert list(short.queue_length) == list(full.queue_length)[-3:]
    assert list(short.decode_batch_sizes) == list(full.decode_batch_sizes)[-3:]
    # Exact over the whole run, not over the window.
    assert short.max_queue_length == max(full.queue_length) > 0
    assert short.max_running == max(full.running) == 2
    assert short.max_decode_batch_size == max(full.decode_batch_sizes) == 2
    assert short.decode_batch_size_total == sum(full.decode_batch_sizes)
    assert short.decode_steps == full.decode_steps == len(full.decode_batch_sizes)
    assert short.decode_tokens == full.decode_tokens
    assert short.peak_pages_used == full.peak_pages_used
    mean = sum(full.decode_batch_sizes) / len(full.decode_batch_sizes)
    assert short.mean_decode_batch_size == pytest.approx(mean)


def test_stats_window_is_checked_and_series_stay_list_like() -> None:
    with pytest.raises(ValueError, match="window"):
        EngineStats(window=0)
    stats = EngineStats(window=2)
    for i in range(5):
        stats.record_step(i, i + 1, {"full": i})
        stats.record_decode(0.1 * i, i)
    assert list(stats.queue_length) == [3, 4] and max(stats.running) == 5
    assert stats.peak_pages_used == {"full": 4} and stats.max_decode_step_seconds == 0.4
    assert sorted(stats.decode_step_seconds) == pytest.approx([0.3, 0.4])


def test_engine_memory_does_not_grow_across_rounds() -> None:
    e = engine(max_running=4, stats_window=16, record_pages=True)

    def one_round() -> None:
        ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS * 3]
        for _ in range(500):
            if not e.has_work:
                break
            e.step()
        for rid in ids:
            e.release(rid)

    for _ in range(3):  # warm up: the windows fill, caches and graphs settle
        one_round()
    tracemalloc.start()
    try:
        one_round()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(6):
            one_round()
        last, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.num_requests == 0
    assert len(e.stats.queue_length) == 16 and e.stats.steps > 16 * 8
    # Seven rounds of 12 requests each kept nothing per request or per step.
    assert last - first < 64 * 1024, (first, last)


def test_step_time_splits_into_host_and_device() -> None:
    e = engine(max_running=2)
    for p in PROMPTS:
        e.submit(p, MAX_TOKENS)
    e.run()
    stats = e.stats
    assert 0 < stats.decode_device_seconds <= stats.decode_seconds
    assert 0 < stats.prefill_device_seconds <= stats.prefill_seconds
    assert stats.decode_host_seconds == pytest.approx(
        stats.decode_seconds - stats.decode_device_seconds
    )
    assert stats.prefill_host_seconds > 0
