"""The greedy oracle: mlx-lm alone, its own caches, one pass or chunks, stops and records."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kv_testing import build_tiny_model, greedy_continue, mlx_lm_greedy

PROMPT = [3, 17, 5, 41, 8, 22, 9, 30, 2, 11, 7]


def test_tokens_are_the_argmax_of_the_whole_context() -> None:
    model = build_tiny_model("gemma3_text", window=4, seed=2)
    tokens = mlx_lm_greedy(model, PROMPT, 6)
    assert len(tokens) == 6
    for i, token in enumerate(tokens):
        logits = model(mx.array([PROMPT + tokens[:i]]))[0, -1]
        assert token == int(mx.argmax(logits))


def test_chunks_and_given_caches_give_the_same_tokens() -> None:
    model = build_tiny_model("gpt_oss", window=4, seed=3)
    whole = mlx_lm_greedy(model, PROMPT, 8)
    caches = make_prompt_cache(model)
    for chunk in (1, 3, 4, len(PROMPT), 100):
        assert mlx_lm_greedy(model, PROMPT, 8, prefill_chunk=chunk) == whole
    assert mlx_lm_greedy(model, PROMPT, 8, caches=caches) == whole
    # The last token is not fed: the caches hold the prompt and all tokens but the last.
    assert caches[1].offset == len(PROMPT) + 7


def test_stop_tokens_and_lengths() -> None:
    model = build_tiny_model("gemma3_text", window=4, seed=2)
    tokens = mlx_lm_greedy(model, PROMPT, 6)
    stop = tokens[2]
    # The first stop token ends the generation and is returned.
    assert mlx_lm_greedy(model, PROMPT, 6, stop_tokens={stop}) == tokens[: tokens.index(stop) + 1]
    assert mlx_lm_greedy(model, PROMPT, 0) == []
    with pytest.raises(ValueError, match="at least one token"):
        mlx_lm_greedy(model, [], 4)
    with pytest.raises(ValueError, match="prefill_chunk"):
        mlx_lm_greedy(model, PROMPT, 4, prefill_chunk=0)


def test_greedy_continue_records_the_logits_of_each_token_fed() -> None:
    model = build_tiny_model("gpt_oss", window=4, seed=3)
    caches = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=caches)
    record: list[mx.array] = []
    tokens = greedy_continue(model, caches, logits, 5, record=record)
    assert tokens == mlx_lm_greedy(model, PROMPT, 5)
    assert len(record) == 4 and all(r.shape == (1, logits.shape[-1]) for r in record)
    assert [int(mx.argmax(r[-1])) for r in record] == tokens[1:]
