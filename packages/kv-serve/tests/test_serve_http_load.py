"""Load: 64 concurrent streaming clients, random disconnects and bad requests, several rounds.

Every client that stays connected must get its whole answer, token-identical to the offline
engine serving its prompt alone; afterwards every page is free, the engine keeps no request,
and the server's memory does not grow from round to round. The pool is small enough that
requests queue and get preempted.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from functools import cache
from typing import Any

import httpx
import mlx.core as mx
import mlx.nn as nn
import psutil  # type: ignore[import-untyped]
import pytest
from serve_support import Serve, wait_idle

from kv_batching import DecodeEngine
from kv_serve import build_engine, stop_token_ids
from kv_serve._server import RunningServer
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny"
PAGE = 4
#: The completion lengths clients ask for.
MAX_TOKENS = (6, 12, 24)
CLIENTS = 64
ROUNDS = 4
WORDS = tuple(
    [
        "the",
        "river",
        "rises",
        "in",
        "hills",
        "north",
        "of",
        "town",
        "and",
        "runs",
        "south",
        "to",
        "sea",
        "water",
        "bridge",
    ]
)


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def new_model() -> nn.Module:
    return build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=len(tokenizer()))


def prompts() -> list[str]:
    rng = random.Random(7)
    return [" ".join(rng.choices(WORDS, k=rng.randrange(2, 30))) for _ in range(12)]


@cache
def oracle_model() -> nn.Module:
    return new_model()


@cache
def offline_longest(ids: tuple[int, ...]) -> tuple[int, ...]:
    """The offline engine's greedy tokens for the prompt alone, at the longest length asked."""
    longest = max(MAX_TOKENS)
    engine = build_engine(
        oracle_model(), max_running=1, max_context=len(ids) + longest, page_size=PAGE
    )
    stops = frozenset(stop_token_ids(tokenizer()))
    rid = engine.submit(list(ids), longest, stop_tokens=stops)
    engine.run()
    return engine.output(rid).tokens


def offline(ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    # Greedy decoding of a prompt alone is the same token by token whatever the length
    # asked: a shorter request's answer is the longest one's first tokens (a stop token
    # ends both at the same place).
    return offline_longest(ids)[:max_tokens]


def ids_of(prompt: str, chat: bool) -> tuple[int, ...]:
    tok = tokenizer()
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tuple(int(i) for i in tok.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(int(i) for i in tok.encode(prompt))


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = new_model()

    def make_engine() -> DecodeEngine:
        # 120 pages of 4 tokens per sub-pool: far less than 16 requests at their peak, so
        # requests wait for pages and the newest running ones get preempted.
        return build_engine(model, num_pages=120, page_size=PAGE, max_running=16, prefill_chunk=32)

    return serve(
        model,
        tokenizer(),
        model_name=MODEL,
        max_queued=256,
        max_context=256,
        make_engine=make_engine,
    )


BAD: list[tuple[bytes, int]] = [
    (b'{"model": "tiny", "prompt": ', 400),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -1}).encode(), 400),
    (json.dumps({"model": "nope", "prompt": "x", "max_tokens": 4}).encode(), 404),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**9}).encode(), 400),
    (json.dumps({"model": "tiny", "prompt": 5}).encode(), 400),
]


async def client(http: httpx.AsyncClient, rng: random.Random, texts: list[str]) -> str:
    """One client; returns what it did ("ok", "gone", "bad")."""
    if rng.random() < 0.15:
        raw, status = rng.choice(BAD)
        response = await http.post(
            "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == status, response.text
        assert "error" in response.json()
        return "bad"
    chat = rng.random() < 0.3
    prompt = rng.choice(texts)
    max_tokens = rng.choice(MAX_TOKENS)
    leave_after = rng.randrange(1, 5) if rng.random() < 0.25 else None
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tokens: list[int] = []
    chunks = 0
    finish = None
    done = False
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            assert "error" not in data, data
            for choice in data["choices"]:
                tokens += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return "gone"
    assert done
    expected = offline(ids_of(prompt, chat), max_tokens)
    assert tuple(tokens) == expected, (prompt, chat, max_tokens)
    assert finish in ("stop", "length")
    return "ok"


async def one_round(url: str, seed: int, texts: list[str]) -> dict[str, int]:
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) for _ in range(CLIENTS)]
    limits = httpx.Limits(max_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def start(s: int) -> str:
            await asyncio.sleep(random.Random(s).random() * 0.2)  # staggered arrivals
            return await client(http, random.Random(s), texts)

        outcomes = await asyncio.wait_for(asyncio.gather(*(start(s) for s in seeds)), 120)
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def test_64_concurrent_streams_with_disconnects_and_bad_requests(served: RunningServer) -> None:
    texts = prompts()
    for text in texts:  # the oracles, computed before the load (never beside the engine)
        for chat in (False, True):
            offline_longest(ids_of(text, chat))
    process = psutil.Process()
    rss: list[int] = []
    active: list[int] = []
    totals: dict[str, int] = {}
    start = time.monotonic()
    for round_index in range(ROUNDS):
        counts = asyncio.run(one_round(served.url, round_index, texts))
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        wait_idle(served)
        gc.collect()
        rss.append(process.memory_info().rss)
        active.append(mx.get_active_memory())
    elapsed = time.monotonic() - start
    assert totals.get("ok", 0) > CLIENTS * ROUNDS // 2 and totals.get("gone", 0) > 0
    assert totals.get("bad", 0) > 0
    engine = served.server.worker.engine
    assert engine is not None
    assert engine.num_requests == 0
    assert engine.stats.preemptions > 0 or engine.stats.max_queue_length > 0
    # Continuous batching across HTTP requests: many decoded in one step.
    assert engine.stats.max_decode_batch_size >= 8
    print(f"\n{totals}; RSS MiB per round {[r // 2**20 for r in rss]}; {elapsed:.1f} s")
    assert len(engine.stats.queue_length) <= engine.stats.steps
    # Memory: after the first (warm-up) round, neither MLX's live buffers nor the process
    # grow with more rounds of the same load.
    assert max(active[1:]) - min(active[1:]) < 256 * 1024, active
    assert rss[-1] - rss[1] < 48 * 2**20, [r // 2**20 for r in rss]
    text = httpx.get(served.url + "/metrics").text
    assert 'kv_serve_pool_pages_used{sub_pool="full"} 0' in text
    assert "kv_serve_requests_running 0" in text and "kv_serve_requests_queued 0" in text
    assert elapsed < 150
