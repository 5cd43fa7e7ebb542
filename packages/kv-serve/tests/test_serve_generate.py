"""``generate``, ``complete`` and ``kv-serve generate`` with the sampling fields, on a tiny model.

Oracles: mlx-lm's own logits (log-softmaxed, and its greedy tokens), seeds run one by one,
and the HTTP server's answer to the same fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kv_protocol import RequestStateError
from kv_serve import GenerationStats, KVServer, complete, generate, load_model, stop_token_ids
from kv_serve._cli import main
from kv_testing import mlx_lm_greedy, save_tiny_model_dir

PROMPT = "The river rises in the hills"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = save_tiny_model_dir(tmp_path_factory.mktemp("tiny"))
    model, tokenizer = load_model(path)
    return path, model, tokenizer


def test_generate_logprobs_are_mlx_lms_and_top_k_1_is_greedy(loaded: tuple[Path, Any, Any]) -> None:
    _, model, tokenizer = loaded
    ids = [int(i) for i in tokenizer.encode(PROMPT)]
    stops = stop_token_ids(tokenizer)
    stats = GenerationStats()
    text = "".join(generate(model, tokenizer, PROMPT, max_tokens=8, logprobs=3, stats=stats))
    tokens = [e.token for e in stats.logprobs]
    assert tokens == mlx_lm_greedy(model, ids, 8, stop_tokens=stops)
    assert text == str(tokenizer.decode([t for t in tokens if t not in stops]))
    logits = model(mx.array([ids + tokens]), cache=make_prompt_cache(model))[0]
    rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[len(ids) - 1 :]
    for row, entry in zip(rows, stats.logprobs, strict=False):
        assert entry.logprob == pytest.approx(row[entry.token], abs=2e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(row)[::-1][:3])
    sampled = "".join(
        generate(model, tokenizer, PROMPT, max_tokens=8, temperature=1.5, top_k=1, seed=9)
    )
    assert sampled == text
    with pytest.raises(RequestStateError, match="min_p"):
        next(generate(model, tokenizer, PROMPT, min_p=1.5))


def test_complete_n_equals_generate_with_each_seed_and_the_server(
    loaded: tuple[Path, Any, Any],
) -> None:
    _, model, tokenizer = loaded
    fields: dict[str, Any] = {
        "max_tokens": 10,
        "temperature": 1.0,
        "top_p": 0.9,
        "presence_penalty": 0.5,
    }
    done = complete(model, tokenizer, PROMPT, n=3, seed=40, logprobs=1, **fields)
    alone = ["".join(generate(model, tokenizer, PROMPT, seed=40 + i, **fields)) for i in range(3)]
    assert [c.text for c in done] == alone
    assert len(set(alone)) > 1
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.tokens) for c in done)
    server = KVServer(model, tokenizer, model_name="tiny", max_context=64, page_size=4)
    with server.running() as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model="tiny", prompt=PROMPT, n=3, seed=40, **fields)
    assert [c.text for c in answer.choices] == alone


def test_the_command_prints_n_completions_and_logprobs(
    loaded: tuple[Path, Any, Any], capsys: Any
) -> None:
    path, model, tokenizer = loaded
    argv = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "6"]
    argv += ["--temperature", "1", "--seed", "3", "--top-k", "5", "--min-p", "0.01"]
    argv += ["--repetition-penalty", "1.2", "--frequency-penalty", "0.3"]
    assert main([*argv, "--n", "2", "--logprobs", "1"]) == 0
    out = capsys.readouterr().out
    expected = complete(
        model,
        tokenizer,
        PROMPT,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        top_k=5,
        min_p=0.01,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
    )
    for i, c in enumerate(expected):
        header = (
            f"--- completion {i + 1} of 2 ({len(c.tokens)} tokens, finish: {c.finish_reason}) ---"
        )
        assert f"{header}\n{c.text}\n" in out
    assert out.count("logprobs (token, logprob, alternatives):") == 2
    assert main([*argv, "--logprobs", "0"]) == 0
    single = capsys.readouterr().out
    assert single.startswith(expected[0].text + "\n")
    table = single.split("logprobs (token, logprob, alternatives):\n")[1]
    assert len(table.splitlines()) == len(expected[0].tokens)
