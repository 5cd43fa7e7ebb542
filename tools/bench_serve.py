"""HTTP serving benchmark: ``kv-serve serve`` against ``mlx_lm.server`` on one model.

Both servers run as processes on 127.0.0.1 serving the same mlx-lm model directory (for
``gemma3-270m``, the directory it is converted into). A bounded asyncio client sends the
same streamed, greedy ``/v1/completions`` requests at each concurrency level, the two
servers alternating which goes first, and reports per server and level: requests/s, output
tokens/s, time to first token p50/p99, inter-token latency p50/p99, the server
process's peak RSS (sampled every 20 ms) and its RSS once it has been idle for
``--idle-seconds`` after the level (kv-serve gives its pool's buffers back when idle).
``--plot FILE`` draws both against the number of clients (the RSS curve). Tokens are
counted as streamed chunks with text (both servers send one chunk per token, except where a
piece is held back to complete a character).

Two workloads: ``synthetic`` (random words, ``--prompt-words`` long) and ``long`` (the real
English prompts of ``tools.real_prompts`` longer than Gemma 3's 512-token sliding window,
each given a distinct numbered opening so that no server can reuse another request's
prompt cache). ``mlx_lm.server`` gets ``--decode-concurrency`` equal to the largest level, so
that both servers may decode that many requests together.

    uv run python -m tools.bench_serve --model gemma3-270m --concurrency 1 4 16 64
    uv run python -m tools.bench_serve --workload long --concurrency 4 16 --requests 1
    uv run python -m tools.bench_serve --concurrency 1 2 4 8 16 --max-context 4096 \
        --plot docs/images/rss_curve.png

``--kv-serve-weights packaged`` hands kv-serve the packaged GGUF instead, loaded as ``kv-serve
serve`` loads it by default (on the CPU: the GGUF's codes for decode beside float32 weights
for prompts, the 8-bit tied embedding), while ``mlx_lm.server`` keeps the float32 directory.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]

from tools.cli_args import ArgumentParser, add_run_options
from tools.harness import Report, quantile

__all__ = ["main"]

_WORDS = [
    "the",
    "river",
    "rises",
    "in",
    "the",
    "hills",
    "north",
    "of",
    "the",
    "town",
    "and",
    "runs",
    "south",
    "through",
    "farmland",
    "before",
    "it",
    "reaches",
    "the",
    "sea",
    "in",
    "spring",
    "the",
    "water",
    "is",
    "high",
    "and",
    "fast",
    "and",
    "the",
    "old",
    "stone",
    "bridge",
    "near",
    "the",
    "market",
    "is",
    "often",
    "closed",
    "for",
    "a",
    "few",
    "days",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model_dir(name: str) -> Path:
    from kv_serve import GEMMA3_270M, convert_gguf, default_cache_dir
    from kv_serve._load import _packaged_gemma

    if name == GEMMA3_270M:
        cache = default_cache_dir()
        path, sha = _packaged_gemma(cache, None)
        return convert_gguf(path, cache, sha256=sha)
    return Path(name)


@dataclass
class _Server:
    name: str
    command: list[str]
    url: str
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    peak_rss: int = 0
    _sampling: bool = False

    def start(self) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"bench-serve-{self.name}-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def rss(self) -> int:
        """The server's resident set now, its child processes included."""
        assert self.process is not None
        proc = psutil.Process(self.process.pid)
        return int(proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children()))

    def sample(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.peak_rss = max(self.peak_rss, self.rss())
            stop.wait(0.02)


@dataclass
class _Level:
    seconds: float = 0.0
    requests: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    peak_rss: int = 0
    failed: list[str] = field(default_factory=list)


async def _one(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, out: _Level
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    last: float | None = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if not any(c.get("text") for c in data.get("choices", [])):
                continue
            now = time.perf_counter()
            if last is None:
                out.ttft.append(now - start)
            else:
                out.itl.append(now - last)
            last = now
            out.tokens += 1
    out.requests += 1


async def _level(
    url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int
) -> _Level:
    out = _Level()
    queue = list(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def worker() -> None:
            while queue:
                try:
                    await _one(http, model, queue.pop(), max_tokens, out)
                except httpx.HTTPError as exc:
                    out.failed.append(f"{type(exc).__name__}: {exc}")

        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 1800)
        out.seconds = time.perf_counter() - start
    return out


def _prompts(workload: str, count: int, words: int, rng: random.Random) -> list[str]:
    """``count`` prompts of the workload, all different."""
    if workload == "synthetic":
        return [" ".join(rng.choices(_WORDS, k=words)) for _ in range(count)]
    from tools.real_prompts import LONG_PROMPT_NAMES, REAL_PROMPTS

    texts = [REAL_PROMPTS[name] for name in LONG_PROMPT_NAMES]
    return [f"Note {i + 1}. {texts[i % len(texts)]}" for i in range(count)]


def ms(values: list[float], q: float) -> str:
    """The ``q`` quantile of ``values`` (seconds) in whole milliseconds."""
    return f"{quantile(values, q) * 1e3:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print a Markdown table."""
    parser = ArgumentParser(prog="python -m tools.bench_serve", description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="gemma3-270m or an mlx-lm dir")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=2, help="requests per client (2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (32)")
    parser.add_argument("--prompt-words", type=int, default=64, help="words per prompt (64)")
    parser.add_argument(
        "--workload",
        choices=["synthetic", "long"],
        default="synthetic",
        help="synthetic (random words) or long (real prompts past the sliding window)",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="kv-serve's --max-context (1024 for synthetic, 2048 for long)",
    )
    parser.add_argument(
        "--kv-budget-mib", type=int, default=None, help="kv-serve's --kv-budget-mib (its default)"
    )
    parser.add_argument("--servers", nargs="+", default=["kv-serve", "mlx-lm"])
    parser.add_argument(
        "--kv-serve-weights",
        choices=["directory", "packaged"],
        default="directory",
        help="what kv-serve loads: the converted float32 directory both servers get "
        "(default), or the packaged GGUF as `kv-serve serve` loads it by default "
        "(gemma3-270m only; on the CPU its GGUF codes beside float32 weights)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=3.0,
        help="how long a server rests after each level before its idle RSS is read (3)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the RSS curve here (PNG)")
    add_run_options(parser, quick=None)
    args = parser.parse_args(argv)
    max_context = args.max_context or (1024 if args.workload == "synthetic" else 2048)
    if args.kv_serve_weights == "packaged" and args.model != "gemma3-270m":
        parser.error("--kv-serve-weights packaged serves the packaged gemma3-270m only")
    directory = _model_dir(args.model)
    top = max(args.concurrency)
    servers: list[_Server] = []
    for name in args.servers:
        port = _free_port()
        if name == "kv-serve":
            command = [sys.executable, "-m", "kv_serve._cli", "serve", "--model", str(directory)]
            if args.kv_serve_weights == "packaged":
                command[-1] = args.model
                command += ["--served-model-name", str(directory)]
            command += ["--port", str(port), "--max-running", str(top), "--log-level", "error"]
            command += ["--max-queued", str(top * args.requests + 8)]
            command += ["--max-context", str(max_context)]
            if args.kv_budget_mib is not None:
                command += ["--kv-budget-mib", str(args.kv_budget_mib)]
        elif name == "mlx-lm":
            # kv_serve's fast BLAS for mlx-lm too (loaded before mlx is imported).
            launch = "import kv_serve as k; k.load_fast_blas(); import mlx_lm.server as s; s.main()"
            command = [sys.executable, "-c", launch, "--model", str(directory)]
            command += ["--port", str(port), "--log-level", "ERROR"]
            command += ["--decode-concurrency", str(top)]
        else:
            parser.error(f"unknown server {name!r}")
        servers.append(_Server(name, command, f"http://127.0.0.1:{port}"))
    rng = random.Random(0)
    rows: list[str] = []
    curve: dict[str, list[tuple[int, float, float]]] = {s.name: [] for s in servers}
    try:
        for server in servers:
            server.start()
            # One warm-up request each (graph compilation, first allocations).
            asyncio.run(_level(server.url, str(directory), ["warm up"], 1, 4))
        for index, concurrency in enumerate(args.concurrency):
            prompts = _prompts(args.workload, concurrency * args.requests, args.prompt_words, rng)
            order = servers if index % 2 == 0 else servers[::-1]
            for server in order:
                server.peak_rss = 0
                stop = threading.Event()
                sampler = threading.Thread(target=server.sample, args=(stop,), daemon=True)
                sampler.start()
                level = asyncio.run(
                    _level(server.url, str(directory), prompts, concurrency, args.max_tokens)
                )
                stop.set()
                sampler.join()
                time.sleep(args.idle_seconds)
                idle = server.rss()
                curve[server.name].append((concurrency, server.peak_rss / 2**20, idle / 2**20))
                rows.append(
                    f"| {server.name} | {concurrency} | {level.requests}/{len(prompts)} | "
                    f"{level.requests / level.seconds:.2f} | "
                    f"{level.tokens / level.seconds:.1f} | "
                    f"{ms(level.ttft, 0.5)} / {ms(level.ttft, 0.99)} | "
                    f"{ms(level.itl, 0.5)} / {ms(level.itl, 0.99)} | "
                    f"{server.peak_rss / 2**20:.0f} | {idle / 2**20:.0f} |"
                )
                print(rows[-1], flush=True)
                if level.failed:
                    print(f"{server.name}: {len(level.failed)} failed: {level.failed[0]}")
                    assert server.log is not None
                    print("".join(server.log.read_text().splitlines(True)[-20:]), flush=True)
    finally:
        for server in servers:
            server.stop()
    results = Report("HTTP serving: kv-serve against mlx_lm.server")
    with results.capturing():
        print()
        shape = f"{args.prompt_words}-word" if args.workload == "synthetic" else "long real"
        print(
            f"{args.model}: {shape} prompts, {args.max_tokens} tokens each, "
            f"{args.requests} requests per client, greedy, streamed"
        )
        print(
            "| server | clients | done | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms "
            "| peak RSS MiB | idle RSS MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(row)
    results.write(args.markdown, prog="tools.bench_serve", argv=argv)
    if args.plot is not None:
        shape = f"{args.prompt_words}-word" if args.workload == "synthetic" else "long real"
        _plot(args.plot, curve, f"{args.model}, {shape} prompts, {args.max_tokens} tokens out")
    return 0


def _plot(path: Path, curve: dict[str, list[tuple[int, float, float]]], title: str) -> None:
    """Peak and idle RSS against the number of clients, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, points in curve.items():
        points = sorted(points)
        clients = [p[0] for p in points]
        (line,) = ax.plot(clients, [p[1] for p in points], marker="o", label=f"{name} peak")
        ax.plot(
            clients,
            [p[2] for p in points],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{name} idle after",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients (requests running)")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Server RSS against load\n{title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
