"""The server on a model with recurrent STATE layers: prefix reuse through state snapshots.

A tiny random-weight Qwen3-Next style hybrid (gated delta-net and full attention) with the tiny
byte-level tokenizer of kv-testing, driven by the official ``openai`` client. Answers equal
mlx-lm generating each prompt alone; ``/metrics`` shows the snapshots and their hits.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kv_protocol import RequestStateError
from kv_serve import stop_token_ids
from kv_serve._server import KVServer
from kv_testing import build_tiny_tokenizer, build_zoo_model, mlx_lm_greedy

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def metric(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} not in /metrics")


def test_requests_sharing_a_prompt_start_resume_from_snapshots() -> None:
    tokenizer = build_tiny_tokenizer()
    model = build_zoo_model("qwen3_next", vocab_size=len(tokenizer))
    oracle = build_zoo_model("qwen3_next", vocab_size=len(tokenizer))
    eos = frozenset(stop_token_ids(tokenizer))
    server = KVServer(
        model,
        tokenizer,
        model_name="tiny-qwen3-next",
        max_running=4,
        max_context=512,
        page_size=8,
        prefill_chunk=64,
        state_snapshot_interval=32,
        state_cache_bytes=2**20,
    )
    prompts = [SYSTEM + question for question in ("Where?", "When did it start?", "Why?")]
    encoded = [[int(i) for i in tokenizer.encode(p)] for p in prompts]
    shared = next(i for i, (a, b, c) in enumerate(zip(*encoded, strict=False)) if not a == b == c)
    with server.running() as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
        for prompt in prompts:
            done = client.completions.create(
                model="tiny-qwen3-next", prompt=prompt, max_tokens=6, temperature=0
            )
            ids = [int(i) for i in tokenizer.encode(prompt)]
            want = []
            for token in mlx_lm_greedy(oracle, ids, 6):
                want.append(token)
                if token in eos:
                    break
            assert done.usage is not None and done.usage.completion_tokens == len(want)
            assert done.usage.prompt_tokens == len(ids)
            assert done.choices[0].text == tokenizer.decode([t for t in want if t not in eos])
        text = httpx.get(running.url + "/metrics").text
    assert metric(text, "kv_serve_state_snapshot_hits_total") == 2
    # Each later prompt resumes at least at the last multiple of the interval it shares.
    assert metric(text, "kv_serve_prefix_cache_hit_tokens_total") >= 2 * (shared // 32 * 32) > 0
    assert 0 < metric(text, "kv_serve_state_snapshot_bytes") <= 2**20
    assert metric(text, "kv_serve_state_snapshot_budget_bytes") == 2**20
    assert metric(text, "kv_serve_state_snapshots") > 0


def test_a_bad_snapshot_interval_fails_the_start() -> None:
    tokenizer = build_tiny_tokenizer()
    server = KVServer(
        build_zoo_model("lfm2", vocab_size=len(tokenizer)),
        tokenizer,
        model_name="tiny-lfm2",
        page_size=8,
        state_snapshot_interval=12,
    )
    with pytest.raises(RequestStateError, match="not a multiple of the pool's prefix boundary"):
        server.start()
