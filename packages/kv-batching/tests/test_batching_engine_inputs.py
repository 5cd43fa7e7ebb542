"""Hostile submit / abort / construction arguments: a clear error, nothing queued, no id used.

Token ids past the vocabulary used to read memory past the embedding table (and ids around
1e5..2**31 crashed the process); they are refused at submit against the embedding's rows.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from batching_fakes import FakeKernels, fake_prefill_cache

from kv_batching import DecodeEngine, vocabulary_size
from kv_protocol import KVCacheError, RequestStateError, UnsupportedModelError, layout_from_model
from kv_testing import ReferenceKVPool, build_tiny_model, mlx_lm_greedy

VOCAB = 64


@cache
def model() -> Any:
    return build_tiny_model("gpt_oss", window=4, num_layers=2, vocab_size=VOCAB)


def engine(**kwargs: Any) -> DecodeEngine:
    pool = ReferenceKVPool(layout_from_model(model()), num_pages=64, page_size=2)
    return DecodeEngine(model(), pool, FakeKernels(), fake_prefill_cache, **kwargs)


def test_vocabulary_is_read_off_the_embedding_table() -> None:
    assert vocabulary_size(model()) == VOCAB
    assert engine().vocab_size == VOCAB
    assert engine(vocab_size=10).vocab_size == 10
    with pytest.raises(UnsupportedModelError, match="larger than the model's embedding"):
        engine(vocab_size=VOCAB + 1)
    for bad in (0, 1.5, True, "64"):
        with pytest.raises(RequestStateError, match="vocab_size"):
            engine(vocab_size=bad)


BAD_SUBMITS: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
    (([VOCAB], 3), {}, r"prompt_tokens\[0\] must be an int in 0\.\.63"),
    (([1, VOCAB + 1], 3), {}, r"prompt_tokens\[1\]"),
    (([100_000], 3), {}, "0..63"),
    (([2**31 - 1], 3), {}, "0..63"),
    (([2**31], 3), {}, "0..63"),
    (([2**64], 3), {}, "0..63"),
    (([-1], 3), {}, "0..63"),
    (([1.7], 3), {}, r"got 1\.7 \(float\)"),
    (([1.0], 3), {}, "float"),
    (([True], 3), {}, "bool"),
    ((["a"], 3), {}, "str"),
    (("abc", 3), {}, "sequence of ints"),
    ((None, 3), {}, "sequence of ints"),
    ((5, 3), {}, "sequence of ints"),
    (([[1, 2]], 3), {}, "list"),
    ((mx.array([1.0, 2.0]), 3), {}, "integer array"),
    (([], 3), {}, "at least one token"),
    (([1], 0), {}, "max_tokens"),
    (([1], 2.0), {}, "max_tokens"),
    (([1], True), {}, "max_tokens"),
    (([1], "3"), {}, "max_tokens"),
    (([1], 2), {"temperature": "hot"}, "temperature"),
    (([1], 2), {"temperature": float("nan")}, "temperature"),
    (([1], 2), {"temperature": float("inf")}, "temperature"),
    (([1], 2), {"temperature": -0.5}, "temperature"),
    (([1], 2), {"top_p": 0.0}, "top_p"),
    (([1], 2), {"top_p": 1.5}, "top_p"),
    (([1], 2), {"top_p": None}, "top_p"),
    (([1], 2), {"stop_tokens": 5}, "stop_tokens"),
    (([1], 2), {"stop_tokens": [VOCAB]}, "stop_tokens"),
    (([1], 2), {"stop_tokens": ["x"]}, "stop_tokens"),
]


@pytest.mark.parametrize(("args", "kwargs", "match"), BAD_SUBMITS)
def test_bad_submits_are_refused_and_use_no_request_id(
    args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    e = engine()
    with pytest.raises(RequestStateError, match=match):
        e.submit(*args, **kwargs)
    assert not e.has_work
    # The next good request gets id 0: the refused one consumed nothing.
    assert e.submit([1, 2], 2) == 0


def test_the_engine_serves_on_after_refusals() -> None:
    e = engine()
    for args, kwargs, _ in BAD_SUBMITS:
        with pytest.raises(KVCacheError):
            e.submit(*args, **kwargs)
    prompts = [[3, 4, 5], list(range(VOCAB - 5, VOCAB))]
    ids = [e.submit(np.array(prompts[0]), 4), e.submit(mx.array(prompts[1]), 4)]
    out = e.run()
    assert [out[i] for i in ids] == [mlx_lm_greedy(model(), p, 4) for p in prompts]


@pytest.mark.parametrize("bad", [0.0, 1.5, "0", None, [0], True])
def test_request_ids_are_ints(bad: Any) -> None:
    e = engine()
    e.submit([1], 2)
    for call in (e.abort, e.output):
        with pytest.raises(RequestStateError, match="request ids are ints"):
            call(bad)
    assert e.has_work


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_running": 0},
        {"max_running": 2.0},
        {"prefill_chunk": True},
        {"prefill_chunk": "8"},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
    ],
)
def test_bad_engine_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(RequestStateError, match=next(iter(kwargs))):
        engine(**kwargs)
