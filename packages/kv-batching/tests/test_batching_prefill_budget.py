"""The prefill budget per step: bounded by the decode it sits beside, never below progress.

The budget's arithmetic against hand-computed values and as properties over any measured
history, its argument checks, and the engine using it: a long prompt that arrives while
another request decodes is spread over small chunks, the tokens stay mlx-lm's.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
from batching_fakes import FakeKernels, fake_prefill_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching import DecodeEngine
from kv_batching._prefill_budget import PrefillBudget
from kv_protocol import layout_from_model
from kv_testing import ReferenceKVPool, build_tiny_model, mlx_lm_greedy


def test_without_a_stall_bound_every_step_gets_the_whole_chunk() -> None:
    budget = PrefillBudget(512)
    budget.note_prefill(100, 10.0)
    assert budget.tokens(None) == 512
    assert budget.tokens(0.001) == 512


def test_nothing_decoding_gets_the_whole_chunk_and_no_measurement_the_smallest() -> None:
    budget = PrefillBudget(512, prefill_stall=2.0, min_chunk=16)
    assert budget.tokens(None) == 512
    assert budget.tokens(0.05) == 16


def test_the_budget_is_the_stall_over_the_measured_cost_per_token() -> None:
    budget = PrefillBudget(512, prefill_stall=2.0, min_chunk=16, smoothing=0.5)
    budget.note_prefill(100, 0.1)  # 1 ms a token
    assert budget.seconds_per_token == pytest.approx(0.001)
    assert budget.tokens(0.02) == 40  # 2 x 20 ms of decode / 1 ms
    assert budget.tokens(0.001) == 16  # never below min_chunk
    assert budget.tokens(10.0) == 512  # never above prefill_chunk
    budget.note_prefill(50, 0.15)  # 3 ms a token: the average moves half way
    assert budget.seconds_per_token == pytest.approx(0.002)
    assert budget.tokens(0.02) == 20


def test_a_chunk_smaller_than_min_chunk_caps_it() -> None:
    budget = PrefillBudget(8, prefill_stall=1.0, min_chunk=16)
    assert budget.min_chunk == 8
    assert budget.tokens(0.5) == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prefill_stall": 0.0}, ValueError, "prefill_stall must be a positive finite"),
        ({"prefill_stall": -1.0}, ValueError, "prefill_stall must be a positive finite"),
        ({"prefill_stall": math.nan}, ValueError, "prefill_stall must be a positive finite"),
        ({"prefill_stall": math.inf}, ValueError, "prefill_stall must be a positive finite"),
        ({"prefill_stall": True}, TypeError, "prefill_stall must be a number"),
        ({"prefill_stall": "2"}, TypeError, "prefill_stall must be a number"),
        ({"smoothing": 1.5}, ValueError, r"smoothing must be in \(0, 1\]"),
        ({"smoothing": 0.0}, ValueError, "smoothing must be a positive finite"),
        ({"min_chunk": 0}, ValueError, "min_chunk"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PrefillBudget(64, **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.integers(1, 4096),
    min_chunk=st.integers(1, 64),
    stall=st.floats(0.01, 100.0),
    history=st.lists(
        st.tuples(st.integers(-2, 4096), st.floats(-1.0, 10.0) | st.just(math.nan)), max_size=8
    ),
    decode=st.floats(0.0, 5.0),
    more=st.floats(0.0, 5.0),
)
def test_the_budget_stays_in_range_and_grows_with_the_decode_time(
    chunk: int,
    min_chunk: int,
    stall: float,
    history: list[tuple[int, float]],
    decode: float,
    more: float,
) -> None:
    budget = PrefillBudget(chunk, prefill_stall=stall, min_chunk=min_chunk)
    for tokens, seconds in history:
        budget.note_prefill(tokens, seconds)  # nonsense samples (<= 0 tokens, nan) ignored
    per = budget.seconds_per_token
    assert per is None or (math.isfinite(per) and per >= 0)
    low = min(min_chunk, chunk)
    got = budget.tokens(decode)
    assert low <= got <= chunk
    assert budget.tokens(decode + more) >= got
    assert budget.tokens(None) == chunk


# ---------------------------------------------------------------------- in the engine


@cache
def model() -> Any:
    return build_tiny_model("gpt_oss", window=4, num_layers=4, vocab_size=64)


SHORT = [(5 * j + 1) % 64 for j in range(3)]
LONG = [(7 * j + 2) % 64 for j in range(90)]


def engine(**kwargs: Any) -> DecodeEngine:
    pool = ReferenceKVPool(layout_from_model(model()), num_pages=128, page_size=4)
    return DecodeEngine(
        model(), pool, FakeKernels(), fake_prefill_cache, prefill_chunk=64, **kwargs
    )


def run_with_arrival(e: DecodeEngine) -> tuple[list[int], list[int]]:
    """A short request decodes; a long prompt arrives after its first token."""
    first = e.submit(SHORT, 24)
    e.step()
    second = e.submit(LONG, 4)
    e.run()
    return list(e.output(first).tokens), list(e.output(second).tokens)


def test_a_prompt_arriving_beside_a_decode_is_prefilled_in_small_chunks() -> None:
    plain = engine()
    plain_tokens = run_with_arrival(plain)
    assert list(plain.stats.prefill_chunk_tokens) == [3, 64, 26]
    # A stall bound far below any real cost: every chunk beside a decode is the smallest.
    bounded = engine(prefill_stall=1e-9)
    assert bounded._prefill_phase.budget.min_chunk == 16
    tokens = run_with_arrival(bounded)
    assert list(bounded.stats.prefill_chunk_tokens) == [3, 16, 16, 16, 16, 16, 10]
    assert bounded.stats.prefill_chunks == 7
    assert bounded.stats.prefill_tokens == len(SHORT) + len(LONG)
    expected = (mlx_lm_greedy(model(), SHORT, 24), mlx_lm_greedy(model(), LONG, 4))
    assert tokens == plain_tokens == expected


def test_the_engine_refuses_a_bad_stall() -> None:
    with pytest.raises(ValueError, match="prefill_stall must be a positive finite number"):
        engine(prefill_stall=-2.0)
