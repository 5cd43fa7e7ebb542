"""``kv-serve serve`` on two tensor-parallel ranks: plain processes on loopback (ring backend).

Each test starts rank 0 and rank 1 as ``mlx.launch`` would (``MLX_HOSTFILE`` + ``MLX_RANK``),
sends concurrent streamed requests to rank 0 (one aborted mid-stream, one longer than the
sliding window, one sampled with a seed) and checks every token against one process serving
the unsharded model; each rank's pool holds its own KV heads. Then it stops the group: by
SIGINT (both ranks exit 0) or by killing the follower (rank 0 exits non-zero, quickly).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kv_serve import RANK_LOST_EXIT, build_engine, load_model, stop_token_ids
from kv_testing import save_tiny_model_dir, save_zoo_model_dir

PAGE_SIZE = 4
MAX_CONTEXT = 256
MAX_RUNNING = 8
PREFILL_CHUNK = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(command: list[str], tmp: Path) -> list[subprocess.Popen[bytes]]:
    """``command`` as ranks 0 and 1 of a loopback group, their output piped."""
    hosts = tmp / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    return [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(rank)},
        )
        for rank in range(2)
    ]


@dataclass
class Group:
    url: str
    ranks: list[subprocess.Popen[bytes]]
    logs: list[Path]
    model_dir: Path


def start_group(model_dir: Path, tmp: Path) -> Group:
    hosts = tmp / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    port = free_port()
    command = [sys.executable, "-m", "kv_serve._cli", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--served-model-name", "tiny", "--log-level", "warning"]
    command += ["--page-size", str(PAGE_SIZE), "--max-context", str(MAX_CONTEXT)]
    command += ["--max-running", str(MAX_RUNNING), "--rank-timeout", "20"]
    command += ["--prefill-chunk", str(PREFILL_CHUNK)]
    ranks, logs = [], []
    for rank in range(2):
        env = {**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(rank)}
        log = tmp / f"rank{rank}.log"
        logs.append(log)
        with log.open("wb") as out:
            ranks.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    group = Group(f"http://127.0.0.1:{port}", ranks, logs, model_dir)
    deadline = time.monotonic() + 120
    while True:
        for rank, process in enumerate(ranks):
            if process.poll() is not None:
                stop_group(group)
                raise AssertionError(f"rank {rank} exited: {logs[rank].read_text()}")
        if time.monotonic() > deadline:
            stop_group(group)
            raise AssertionError(f"the group did not come up: {logs[0].read_text()}")
        try:
            if httpx.get(group.url + "/health", timeout=1).status_code == 200:
                return group
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop_group(group: Group) -> None:
    for process in group.ranks:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def one_rank_tokens(model_dir: Path, requests: list[dict[str, Any]]) -> tuple[list[Any], int]:
    """Each request's tokens from one process on the unsharded model, and its pool's bytes."""
    model, tokenizer = load_model(model_dir)
    engine = build_engine(
        model,
        page_size=PAGE_SIZE,
        max_running=MAX_RUNNING,
        max_context=MAX_CONTEXT,
        prefill_chunk=PREFILL_CHUNK,
    )
    stops = stop_token_ids(tokenizer)
    out = []
    for body in requests:
        rid = engine.submit(
            body["prompt"],
            body["max_tokens"],
            temperature=body.get("temperature", 0.0),
            seed=body.get("seed"),
            stop_tokens=stops,
        )
        engine.run()
        out.append(list(engine.output(rid).tokens))
    return out, engine.memory_report().pool.bytes_total


async def stream(http: httpx.AsyncClient, body: dict[str, Any], cut: int | None) -> list[int]:
    """The streamed token ids of one completion; ``cut``: close after that many chunks."""
    tokens: list[int] = []
    chunks = 0
    request = {"model": "tiny", "stream": True, "return_token_ids": True, **body}
    async with http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
            chunks += 1
            if cut is not None and chunks >= cut:
                break
    return tokens


def requests_for(vocab: int) -> list[dict[str, Any]]:
    long_prompt = [(7 * i + 3) % (vocab - 10) + 10 for i in range(40)]  # > the window
    return [
        {"prompt": long_prompt, "max_tokens": 24, "temperature": 0},
        {"prompt": [11, 12, 13, 14, 15], "max_tokens": 40, "temperature": 0},  # aborted
        {"prompt": [20, 21, 22, 23, 24, 25, 26], "max_tokens": 16, "temperature": 0.9, "seed": 7},
        {"prompt": long_prompt[:9], "max_tokens": 12, "temperature": 0},
    ]


def metric(url: str, name: str) -> int:
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^{name} (\d+)$", text, re.M)
    assert found, text
    return int(found.group(1))


def check_group_matches_one_rank(group: Group, *, kv_share: float) -> None:
    model, tokenizer = load_model(group.model_dir)
    vocab = len(tokenizer)
    del model
    bodies = requests_for(vocab)
    expected, one_rank_bytes = one_rank_tokens(group.model_dir, bodies)

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=group.url, timeout=60) as http:
            cuts = [None, 3, None, None]
            streams = (stream(http, b, c) for b, c in zip(bodies, cuts, strict=True))
            return list(await asyncio.gather(*streams))

    got = asyncio.run(run())
    assert got[0] == expected[0]
    assert 0 < len(got[1]) < len(expected[1]) and got[1] == expected[1][: len(got[1])]
    assert got[2] == expected[2]
    assert got[3] == expected[3]
    # The abort reached both ranks: nothing runs, and the group still serves.
    deadline = time.monotonic() + 20
    while metric(group.url, "kv_serve_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(group.url, "kv_serve_requests_running") == 0
    again = asyncio.run(_again(group.url, bodies[3]))
    assert again == expected[3]
    assert metric(group.url, "kv_serve_world_size") == 2
    leader_bytes = metric(group.url, "kv_serve_pool_kv_bytes")
    assert leader_bytes == int(one_rank_bytes * kv_share)
    for log in group.logs:  # loaded lazily, sharded, and the shards checked against the whole
        assert "model sharded over 2 ranks (its probe logits equal)" in log.read_text()
    follower = re.search(r"KV pool (\d+) bytes", group.logs[1].read_text())
    assert follower is not None, group.logs[1].read_text()
    assert int(follower.group(1)) == leader_bytes


async def _again(url: str, body: dict[str, Any]) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await stream(http, body, None)


@pytest.fixture
def tmp_dir(tmp_path: Path) -> Path:
    return tmp_path


def test_gpt_oss_like_two_ranks_then_sigint_stops_both(tmp_dir: Path) -> None:
    model_dir = save_zoo_model_dir(tmp_dir / "model", "gpt_oss")
    group = start_group(model_dir, tmp_dir)
    try:
        check_group_matches_one_rank(group, kv_share=0.5)  # 2 of 4 KV heads... per rank
        group.ranks[0].send_signal(signal.SIGINT)
        assert group.ranks[0].wait(30) == 0, group.logs[0].read_text()
        assert group.ranks[1].wait(30) == 0, group.logs[1].read_text()
    finally:
        stop_group(group)


def test_gemma3_like_replicated_kv_head_then_killed_follower_ends_leader(
    tmp_dir: Path,
) -> None:
    # One KV head, as Gemma 3 270M: both ranks keep it (replicated), the query heads split.
    model_dir = save_tiny_model_dir(tmp_dir / "model", "gemma3_text", num_key_value_heads=1)
    group = start_group(model_dir, tmp_dir)
    try:
        check_group_matches_one_rank(group, kv_share=1.0)
        group.ranks[1].kill()
        start = time.monotonic()
        status = group.ranks[0].wait(30)
        assert status == RANK_LOST_EXIT, group.logs[0].read_text()
        assert time.monotonic() - start < 30
        assert "exiting with status 3" in group.logs[0].read_text()
    finally:
        stop_group(group)


def test_state_hybrid_qwen3_5_two_ranks(tmp_dir: Path) -> None:
    model_dir = save_zoo_model_dir(tmp_dir / "model", "qwen3_5")
    group = start_group(model_dir, tmp_dir)
    try:
        check_group_matches_one_rank(group, kv_share=0.5)
        # A constrained request: its grammar travels to the follower as text.
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "yes or no?"}],
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            },
        }
        answer = httpx.post(group.url + "/v1/chat/completions", json=body, timeout=60).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", answer
        assert set(json.loads(choice["message"]["content"])) == {"ok"}
        check_group_matches_one_rank(group, kv_share=0.5)  # both ranks still in step
    finally:
        stop_group(group)


def test_a_model_without_a_sharding_rule_is_refused_on_every_rank(tmp_dir: Path) -> None:
    model_dir = save_tiny_model_dir(tmp_dir / "model", "olmo3")
    command = [sys.executable, "-m", "kv_serve._cli", "serve", "--model", str(model_dir)]
    processes = spawn_ranks([*command, "--port", str(free_port())], tmp_dir)
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 2, out
        assert b"olmo3 layer 0's q_norm normalises across heads" in out, out


RANK_SCRIPT = """
import sys, time
import mlx.core as mx
from kv_serve import init_ranks
ranks = init_ranks(timeout=3.0, heartbeat=0.5)
mine = [1, 2, 3] if ranks.is_leader else [9, 9, 9]
agreed = ranks.tokens(mx.array(mine, dtype=mx.uint32))
print("tokens", agreed.tolist(), agreed.dtype, flush=True)
heard = ranks.broadcast([7, -2**31, 2**31 - 1] if ranks.is_leader else None, "a message")
print("heard", heard, flush=True)
print("min", ranks.all_min([ranks.rank + 5, 10 - ranks.rank], "pages"), flush=True)
if not ranks.is_leader:
    time.sleep(60)  # alive but stuck: the leader's watchdog must end it
ranks.broadcast([1], "a message nobody answers")
print("not reached", flush=True)
"""


def test_rank_group_agrees_and_a_stuck_peer_ends_the_leader(tmp_dir: Path) -> None:
    processes = spawn_ranks([sys.executable, "-c", RANK_SCRIPT], tmp_dir)
    try:
        start = time.monotonic()
        out, _ = processes[0].communicate(timeout=60)
        text = out.decode()
        assert processes[0].returncode == RANK_LOST_EXIT, text
        assert time.monotonic() - start < 30
        assert "tokens [1, 2, 3] mlx.core.uint32" in text
        assert f"heard [7, {-(2**31)}, {2**31 - 1}]" in text
        assert "min [5, 9]" in text
        assert "a message nobody answers" in text and "not reached" not in text
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
    follower = processes[1].stdout.read().decode() if processes[1].stdout else ""
    assert "tokens [1, 2, 3]" in follower and f"heard [7, {-(2**31)}" in follower


PROBE_SCRIPT = """
import sys
import mlx.core as mx
from kv_protocol import UnsupportedModelError
from kv_serve import init_ranks, shard_model
import kv_serve._sharding as sharding
from kv_testing import build_tiny_model, mlx_lm_greedy
ranks = init_ranks(timeout=20.0)
arch = sys.argv[1]
if arch == "olmo3":  # its norms span every head: the rule's check let through
    sharding._norm_across_heads = lambda attention, head_dim: None
if arch == "gemma3_text":  # every rank keeps KV head 0: rank 1's queries read the wrong one
    sharding._splits_kv = lambda kv, ranks: False
    keep = sharding._keep_rows
    sharding._keep_rows = lambda projection, start, count: keep(projection, 0, count)
model = build_tiny_model(arch)
prompt = list(range(3, 20))
whole = mlx_lm_greedy(model, prompt, 8)
try:
    shard_model(model, ranks.group)
except UnsupportedModelError as error:
    print("refused:", error, flush=True)
    raise SystemExit(0)
print("same tokens", mlx_lm_greedy(model, prompt, 8) == whole, flush=True)
"""


@pytest.mark.parametrize("arch", ["cohere2", "olmo3", "gemma3_text"])
def test_the_probe_passes_a_rule_that_fits_and_refuses_one_that_does_not(
    tmp_dir: Path, arch: str
) -> None:
    processes = spawn_ranks([sys.executable, "-c", PROBE_SCRIPT, arch], tmp_dir)
    for process in processes:
        out, _ = process.communicate(timeout=120)
        text = out.decode()
        assert process.returncode == 0, text
        if arch == "cohere2":  # plain attention and a gated MLP: sharded here, exactly
            assert "same tokens True" in text, text
        else:  # rules that do not fit: the probe refuses them on every rank alike
            assert f"refused: sharding {arch} over 2 ranks changed its logits" in text, text
