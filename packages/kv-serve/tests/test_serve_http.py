"""The OpenAI-compatible server against the official ``openai`` client on 127.0.0.1.

A tiny random-weight Gemma 3 style hybrid (sliding + full layers) with the tiny byte-level
tokenizer of kv-testing. Every greedy answer is compared with the offline engine serving the
same prompt alone (a second, identical model instance: the oracle never shares the served
model's thread). Servers are started and stopped by the fixtures (uvicorn on a thread).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import httpx
import mlx.nn as nn
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from serve_support import Serve, pages_used, wait_idle
from serve_support import openai_client as client

from kv_batching import DecodeEngine
from kv_pool import HybridKVPool
from kv_protocol import KVCache, KVPool, LayoutError, Reservation, layout_from_model
from kv_serve import build_engine, build_kernels, generate, pool_backed_cache, stop_token_ids
from kv_serve._server import KVServer, RunningServer
from kv_serve._server_text import CompletionText, IncrementalDecoder
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-gemma3"
PAGE = 4
CONTEXT = 256


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def new_model() -> nn.Module:
    return build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=len(tokenizer()))


@cache
def oracle_model() -> nn.Module:
    return new_model()


@cache
def eos() -> frozenset[int]:
    return frozenset(stop_token_ids(tokenizer()))


@cache
def offline(ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The offline engine's greedy tokens for ``ids`` alone."""
    engine = build_engine(
        oracle_model(), max_running=1, max_context=len(ids) + max_tokens, page_size=PAGE
    )
    rid = engine.submit(list(ids), max_tokens, stop_tokens=eos())
    engine.run()
    return engine.output(rid).tokens


def encode(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in tokenizer().encode(text))


def chat_ids(messages: Any) -> tuple[int, ...]:
    return tuple(
        int(i) for i in tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    )


def text_of(tokens: tuple[int, ...] | list[int]) -> str:
    return str(tokenizer().decode([t for t in tokens if t not in eos()]))


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    return serve(
        new_model(),
        tokenizer(),
        model_name=MODEL,
        max_running=16,
        max_queued=256,
        max_context=CONTEXT,
        page_size=PAGE,
        prefill_chunk=32,
    )


# ---------------------------------------------------------------------- text pieces


def test_incremental_decoder_never_splits_a_character_and_equals_full_decode() -> None:
    tok = tokenizer()
    text = "Caf\u00e9 3\u20ac \U0001f600 \u65e5\u672c the river"
    ids = [int(i) for i in tok.encode(text)]
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == str(tok.decode(ids))
    assert not any("\ufffd" in p for p in pieces)
    # Random byte-level streams: the pieces always add up to the full decode.
    rng = random.Random(0)
    for _ in range(50):
        stream = [rng.randrange(6, len(tok)) for _ in range(rng.randrange(1, 30))]
        decoder = IncrementalDecoder(tok)
        pieces = [decoder.push(t) for t in stream] + [decoder.flush()]
        assert "".join(pieces) == str(tok.decode(stream))


def test_completion_text_cuts_stop_strings_across_token_boundaries() -> None:
    tok = tokenizer()
    ids = [int(i) for i in tok.encode("the river rises in the hills")][1:]
    text = CompletionText(tok, stop=["rises"], eos_ids=eos())
    sent = "".join(text.push([t]) for t in ids) + text.finish()
    assert sent == "the river " and text.stopped
    full = [str(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert text.completion_tokens == next(k for k, t in enumerate(full) if "rises" in t)
    held = CompletionText(tok, stop=["xyz"], eos_ids=eos())
    assert held.push([int(i) for i in tok.encode("abcx")][1:]) == "abc"  # "x" may start "xyz"
    assert held.finish() == "x" and not held.stopped


# ---------------------------------------------------------------------- endpoints


def test_models_health_and_metrics(served: RunningServer) -> None:
    models = client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    text = httpx.get(served.url + "/metrics").text
    for name in (
        "kv_serve_requests_running",
        "kv_serve_requests_queued",
        'kv_serve_pool_pages_used{sub_pool="full"}',
        'kv_serve_pool_pages_total{sub_pool="sliding-w8"}',
        'kv_serve_pool_kv_bits{sub_pool="full"} 0',
        "kv_serve_prompt_tokens_total",
        "kv_serve_generation_tokens_total",
        "kv_serve_request_latency_seconds_bucket",
        "kv_serve_time_to_first_token_seconds_count",
    ):
        assert name in text, name
    # An attention-only model holds no recurrent state.
    assert "\nkv_serve_state_bytes 0\n" in text
    # The pool's buffers hold at most its cap (they grow with use).
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("kv_serve_pool_kv_bytes ", "kv_serve_pool_committed_bytes "))
    }
    assert 0 < values["kv_serve_pool_committed_bytes"] <= values["kv_serve_pool_kv_bytes"]
    assert "\nkv_serve_prefix_cache_hit_tokens_total " in text


PROMPT = "The river rises in the hills"


def test_completion_greedy_equals_the_offline_engine(served: RunningServer) -> None:
    expected = offline(encode(PROMPT), 20)
    out = client(served).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert tuple(choice.token_ids) == expected  # type: ignore[attr-defined]
    assert choice.text == text_of(expected)
    assert choice.text == "".join(
        generate(oracle_model(), tokenizer(), PROMPT, max_tokens=20, temperature=0.0)
    )
    assert choice.finish_reason == ("stop" if expected[-1] in eos() else "length")
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        len(encode(PROMPT)),
        len(expected),
    )
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_seeded_sampled_completion_is_reproducible(served: RunningServer) -> None:
    def sample(seed: int, stream: bool) -> str:
        common: Any = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
        if stream:
            pieces = client(served).completions.create(**common, seed=seed, stream=True)
            return "".join(chunk.choices[0].text for chunk in pieces if chunk.choices)
        text: str = client(served).completions.create(**common, seed=seed).choices[0].text
        return text

    first = sample(7, stream=False)
    assert sample(7, stream=True) == first  # same seed, same text, streamed or not
    assert len({first, sample(8, stream=False), sample(9, stream=False)}) > 1
    assert sample(-5, stream=False) == sample(-5, stream=True)  # OpenAI's signed int64 seeds
    too_large = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "seed": 2**63}
    assert httpx.post(served.url + "/v1/completions", json=too_large).status_code == 400


def test_completion_stream_equals_the_offline_engine(served: RunningServer) -> None:
    expected = offline(encode(PROMPT), 20)
    stream = client(served).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    pieces: list[str] = []
    tokens: list[int] = []
    reasons: list[str | None] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            tokens += getattr(choice, "token_ids", None) or []
            reasons.append(choice.finish_reason)
    assert tuple(tokens) == expected
    assert "".join(pieces) == text_of(expected)
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens == len(expected)


def test_token_id_prompts_are_served(served: RunningServer) -> None:
    ids = [1, 40, 41, 42, 43]
    out = client(served).completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert tuple(out.choices[0].token_ids) == offline(tuple(ids), 6)  # type: ignore[attr-defined]


MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where does the river run?"},
]


def test_chat_greedy_and_stream_equal_the_offline_engine(served: RunningServer) -> None:
    expected = offline(chat_ids(MESSAGES), 16)
    c = client(served)
    out = c.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert tuple(out.choices[0].token_ids) == expected  # type: ignore[attr-defined]
    assert out.choices[0].message.content == text_of(expected)
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens == len(chat_ids(MESSAGES))
    one_turn: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi there"}]
    alone = "".join(generate(oracle_model(), tokenizer(), "hi there", max_tokens=9, chat=True))
    pieces = []
    for chunk in c.chat.completions.create(
        model=MODEL,
        messages=one_turn,
        max_tokens=9,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == alone


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(served: RunningServer) -> None:
    wait_idle(served)
    # A prompt no other test sends: its first run finds nothing past the template's start.
    turn: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about the lighthouse keeper's seven cats."}
    ]
    ids = chat_ids(turn)
    c = client(served)
    runs = []
    for stream in (False, False, True):
        if stream:
            chunks = list(
                c.chat.completions.create(
                    model=MODEL,
                    messages=turn,
                    max_tokens=4,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = c.chat.completions.create(
                model=MODEL, messages=turn, max_tokens=4, temperature=0
            ).usage
        assert usage is not None and usage.prompt_tokens == len(ids)
        assert usage.prompt_tokens_details is not None
        runs.append(usage.prompt_tokens_details.cached_tokens)
    # Repeated, the prompt is served from whole pages but the one its last token is in.
    assert runs[1] == runs[2] == PAGE * ((len(ids) - 1) // PAGE)
    assert runs[0] is not None and runs[0] < runs[1]
    completion = client(served).completions.create(
        model=MODEL, prompt=[list(ids), list(ids)], max_tokens=2, temperature=0
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 2 * runs[1]


def stop_case(ids: tuple[int, ...], max_tokens: int) -> tuple[str, str, int]:
    """A stop string from the oracle's text, the text before it, and tokens up to it."""
    tokens = offline(ids, max_tokens)
    full = text_of(tokens)
    for k in range(2, len(tokens)):
        piece = str(tokenizer().decode([tokens[k]]))
        if len(piece) >= 1 and piece.isascii() and piece.isprintable() and piece.strip():
            stop = text_of(tokens[k - 1 : k + 1]) if len(piece) == 1 else piece
            if stop.isascii() and stop.isprintable():
                break
    else:
        pytest.skip("the oracle text has no printable token to stop on")
    cut = full.index(stop)
    used = next(j for j in range(len(tokens) + 1) if stop in text_of(tokens[:j]))
    return stop, full[:cut], used


def test_stop_strings_end_the_text_before_them(served: RunningServer) -> None:
    prompt = "In spring the water is high"
    stop, before, used = stop_case(encode(prompt), 40)
    c = client(served)
    out = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\u0000never"]
    )
    assert out.choices[0].text == before
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == used
    pieces = []
    reason = None
    for chunk in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True
    ):
        for choice in chunk.choices:
            pieces.append(choice.text)
            reason = choice.finish_reason or reason
    assert "".join(pieces) == before and reason == "stop"
    wait_idle(served)


# ---------------------------------------------------------------------- errors


def post(running: RunningServer, path: str, body: Any, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        running.url + path, content=content, headers={"Content-Type": "application/json"}
    )


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= error.keys()
    if param is not None:
        assert error["param"] == param


GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({**GOOD, "prompt": None}, 400, "prompt"),
        ({k: v for k, v in GOOD.items() if k != "model"}, 400, "model"),
        ({**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": -3}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 10**12}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": CONTEXT}, 400, "max_tokens"),  # prompt + max_tokens > context
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "temperature": -1}, 400, "temperature"),
        ({**GOOD, "top_p": 0}, 400, "top_p"),
        ({**GOOD, "stop": [1, 2]}, 400, "stop"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "n": 0}, 400, "n"),
        ({**GOOD, "n": 10**6}, 400, "n"),
        ({**GOOD, "prompt": [1, 10**9]}, 400, "prompt"),
        ({**GOOD, "prompt": {"text": "x"}}, 400, "prompt"),
        ({**GOOD, "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_completion_requests(
    served: RunningServer, body: dict[str, Any], status: int, param: str
) -> None:
    assert_error(post(served, "/v1/completions", body), status, param)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        (
            {"model": MODEL, "messages": [{"role": 3, "content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
            400,
            "messages[0].content",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            400,
            "max_tokens",
        ),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)
def test_bad_chat_requests(
    served: RunningServer, body: dict[str, Any], status: int, param: str
) -> None:
    assert_error(post(served, "/v1/chat/completions", body), status, param)


def test_malformed_json_and_unknown_routes(served: RunningServer) -> None:
    assert_error(post(served, "/v1/completions", None, raw=b'{"model": '), 400)
    assert_error(post(served, "/v1/chat/completions", None, raw=b"\xff\xfe"), 400)
    assert_error(post(served, "/v1/completions", None, raw=b"[1, 2]"), 400)
    assert_error(httpx.get(served.url + "/v1/nothing"), 404)
    assert_error(httpx.get(served.url + "/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        client(served).completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client(served).completions.create(model=MODEL, prompt="x", max_tokens=-5)


def test_a_disconnected_stream_is_aborted_and_its_pages_freed(served: RunningServer) -> None:
    wait_idle(served)
    body = {**GOOD, "max_tokens": 200, "stream": True, "prompt": PROMPT}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", served.url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break
        assert any(pages_used(served).values())
    wait_idle(served, timeout=5.0)
    assert served.server.worker.engine is not None
    assert served.server.worker.engine.num_requests == 0


# ---------------------------------------------------------------------- a second server


class Poison:
    """Make the next prefill fail (the engine's prefill cache factory raises once), and stall
    the engine thread on demand: with ``stall`` set, the first step that produces a token
    closes ``gate`` and the next step waits until the test opens it again."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.stall = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def gated(self, step: Callable[[], dict[int, list[int]]]) -> Callable[[], dict[int, list[int]]]:
        """``step`` behind the gate."""

        def gated_step() -> dict[int, list[int]]:
            assert self.gate.wait(60), "the test never opened the gate"
            produced = step()
            if produced and self.stall.is_set():
                self.stall.clear()
                self.gate.clear()
            return produced

        return gated_step

    def factory(self, pool: KVPool, reservation: Reservation, layer_id: int) -> KVCache:
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("injected prefill failure")
        return pool_backed_cache(pool, reservation, layer_id)


SMALL_PAGES = 80  # 79 usable pages of 4 tokens per sub-pool: at most 316 tokens of full context


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[RunningServer, Poison]]:
    poison = Poison()
    model = new_model()

    def make_engine() -> DecodeEngine:
        layout = layout_from_model(model)
        pool = HybridKVPool(layout, num_pages=SMALL_PAGES, page_size=PAGE)
        kernels = build_kernels(model, layout)
        engine = DecodeEngine(model, pool, kernels, poison.factory, max_running=1, prefill_chunk=32)
        engine.step = poison.gated(engine.step)  # type: ignore[method-assign]
        return engine

    server = KVServer(
        model,
        build_tiny_tokenizer(chat_template=False),
        model_name=MODEL,
        max_queued=1,
        max_context=1024,
        make_engine=make_engine,
    )
    with server.running() as running:
        yield running, poison


def test_no_chat_template_is_a_clear_400(small: tuple[RunningServer, Poison]) -> None:
    running, _ = small
    response = post(
        running,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert_error(response, 400, "messages")
    assert "no chat template" in response.json()["error"]["message"]


def test_a_prompt_that_can_never_fit_the_pool_is_refused_at_once(
    small: tuple[RunningServer, Poison],
) -> None:
    running, _ = small
    start = time.monotonic()
    response = post(running, "/v1/completions", {**GOOD, "prompt": "x" * 300, "max_tokens": 100})
    assert_error(response, 400, "max_tokens")
    assert "never fit" in response.json()["error"]["message"]
    assert time.monotonic() - start < 5.0
    assert running.server.worker.snapshot().active == 0


def test_full_queue_is_429_and_an_engine_failure_is_500_for_that_request_only(
    small: tuple[RunningServer, Poison],
) -> None:
    running, poison = small
    long_ids = encode(PROMPT)
    expected = offline(long_ids, 150)

    async def refuse(body: dict[str, Any]) -> httpx.Response:
        # Its own client (own connection pool): the refusal shares nothing client-side with
        # the requests still open. It needs no engine work, so a hang is a server bug: show
        # every thread's stack and whether the server still answers a fresh connection.
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as own:
            try:
                return await own.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                faulthandler.dump_traceback(all_threads=True)
                health: int | str
                try:
                    health = httpx.get(running.url + "/health", timeout=5).status_code
                except httpx.HTTPError as probe:
                    health = repr(probe)
                worker = running.server.worker
                raise AssertionError(
                    f"the refusal got no answer in 30 s; /health on a new connection: {health}; "
                    f"waiting {worker.waiting}, {worker.snapshot()}"
                ) from None

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=60) as http,
            httpx.AsyncClient(base_url=running.url, timeout=60) as second,
        ):
            body = {**GOOD, "prompt": PROMPT, "max_tokens": 150, "stream": True}
            body["return_token_ids"] = True
            # The engine stalls after the first token until the queue checks are done, so
            # the first request cannot finish (and free the queue) before them.
            poison.stall.set()
            async with http.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()
                tokens: list[int] = []
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        tokens += choice.get("token_ids") or []
                        break
                # One request runs (max_running=1); one more may wait (max_queued=1).
                waiting = asyncio.ensure_future(second.post("/v1/completions", json=GOOD))
                deadline = time.monotonic() + 10
                while running.server.worker.waiting < 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                refused = await refuse(GOOD)
                assert_error(refused, 429)
                assert refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                # The waiting one is served after the first: poison it, it alone fails.
                poison.armed.set()
                poison.gate.set()
                failed = await waiting
                assert_error(failed, 500)
                assert "injected prefill failure" in failed.json()["error"]["message"]
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        data = json.loads(line[6:])
                        assert "error" not in data
                        tokens += data["choices"][0].get("token_ids") or []
            assert tuple(tokens) == expected
            # A streamed request that fails before its first token gets its status too.
            poison.armed.set()
            streamed = await http.post("/v1/completions", json={**GOOD, "stream": True})
            assert_error(streamed, 500)
            after = await http.post("/v1/completions", json={**GOOD, "return_token_ids": True})
            assert after.status_code == 200
            assert tuple(after.json()["choices"][0]["token_ids"]) == offline(encode("hello"), 4)

    try:
        # Generous: a hang still fails, a loaded 2-core machine does not.
        asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        poison.stall.clear()
        poison.gate.set()
    wait_idle(running)
    text = httpx.get(running.url + "/metrics").text
    assert 'kv_serve_requests_rejected_total{status="429"} 1' in text
    assert 'kv_serve_requests_rejected_total{status="500"} 2' in text


# ---------------------------------------------------------------------- quantized pages


def test_a_server_with_quantized_pages_serves_what_the_offline_engine_does() -> None:
    model = build_tiny_model(
        "gemma3_text", window=8, num_layers=4, vocab_size=len(tokenizer()), head_dim=32
    )
    engine = build_engine(
        model, max_running=1, max_context=64, page_size=PAGE, kv_bits=4, kv_group_size=32
    )
    ids = encode(PROMPT)
    rid = engine.submit(list(ids), 12, stop_tokens=eos())
    engine.run()
    expected = engine.output(rid).tokens
    engine.close()
    server = KVServer(
        model,
        tokenizer(),
        model_name=MODEL,
        max_running=4,
        max_context=64,
        page_size=PAGE,
        kv_bits=4,
        kv_group_size=32,
    )
    with server.running() as running:
        out = client(running).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert tuple(out.choices[0].token_ids) == expected  # type: ignore[attr-defined]
        metrics = httpx.get(running.url + "/metrics").text
    assert 'kv_serve_pool_kv_bits{sub_pool="full"} 4' in metrics
    assert 'kv_serve_pool_kv_bits{sub_pool="sliding-w8"} 4' in metrics
    with pytest.raises(LayoutError, match="kv_bits must be one of"):
        KVServer(model, tokenizer(), model_name=MODEL, kv_bits=6)
