"""``kv-serve serve`` as a process: a tiny mlx-lm model directory served on 127.0.0.1.

The command a user runs, answered like ``curl`` and the ``openai`` client would ask it;
greedy answers equal the offline engine on the same directory; the server process's memory
does not grow over repeated rounds of concurrent requests; SIGINT stops it cleanly.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil  # type: ignore[import-untyped]
import pytest

from kv_serve import build_engine, load_model, stop_token_ids
from kv_testing import save_tiny_model_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    command = [sys.executable, "-m", "kv_serve._cli", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--served-model-name", "tiny", "--max-context", "256"]
    command += ["--page-size", "4", "--max-running", "8", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else b""
            assert time.monotonic() < deadline, "kv-serve serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Any:
    model, tokenizer = load_model(model_dir)
    stops = stop_token_ids(tokenizer)

    def run(ids: list[int], max_tokens: int) -> list[int]:
        engine = build_engine(model, max_running=1, max_context=len(ids) + max_tokens)
        rid = engine.submit(ids, max_tokens, stop_tokens=stops)
        engine.run()
        return list(engine.output(rid).tokens)

    return run, tokenizer


def test_curl_style_request_and_openai_client(
    server: tuple[str, subprocess.Popen[bytes]], oracle: Any
) -> None:
    url, _ = server
    run, tokenizer = oracle
    # What the README's curl example sends.
    body = {"model": "tiny", "prompt": "The river", "max_tokens": 12, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == run([int(i) for i in tokenizer.encode("The river")], 12)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Where does the river run?"}]
    ids = [int(i) for i in tokenizer.apply_chat_template(messages, add_generation_prompt=True)]
    expected = run(ids, 10)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Where does the river run?"}],
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert out.choices[0].token_ids == expected  # type: ignore[attr-defined]
    text = str(tokenizer.decode([t for t in expected if t not in stop_token_ids(tokenizer)]))
    assert out.choices[0].message.content == text
    metrics = httpx.get(url + "/metrics").text
    assert "kv_serve_requests_running 0" in metrics


async def _round(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"request {i} about the river",
                "max_tokens": 8 + i % 9,
                "temperature": 0,
                "stream": i % 2 == 0,
            }
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)


def test_server_process_memory_is_flat_across_rounds(
    server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = server
    proc = psutil.Process(process.pid)
    rss = []
    for _ in range(4):
        asyncio.run(_round(url, 32))
        rss.append(proc.memory_info().rss)
    growth = rss[-1] - rss[1]
    assert growth < 32 * 2**20, [r // 2**20 for r in rss]
    metrics = httpx.get(url + "/metrics").text
    assert 'kv_serve_pool_pages_used{sub_pool="full"} 0' in metrics
    assert "kv_serve_engine_requests 0" in metrics


def test_sigint_stops_the_server(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    _, process = server
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 0
