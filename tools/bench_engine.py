"""Benchmark: kv-batching's DecodeEngine against mlx-lm's BatchGenerator in one process.

Both serve the same workload on the same attention-dominated gpt-oss-like model (random
fp32 weights; alternating sliding-window / full layers with attention sinks): requests with
prompts up to ~4k tokens and varied output lengths, at most 16 decoding at once, greedy.
mlx-lm runs first and its peak KV bytes (the batch caches it holds, summed after every
step) size the engine's pool: by default the pool gets half of that, so the engine must
serve the same work in half the KV memory. Reported: throughput (generated tokens per
second of wall time, prefill included), peak KV bytes, p50/p99 step time, token agreement.

    uv run python -m tools.kv bench            # full run (minutes on CPU)
    uv run python -m tools.kv bench --quick    # under a minute
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import mlx.core as mx

from kv_batching import DecodeEngine
from kv_pool import HybridKVPool
from kv_protocol import CacheLayout, KVCacheError, layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model
from tools.cli_args import (
    MAX_LAYERS,
    MAX_PAGE_SIZE,
    MAX_REQUESTS,
    MAX_TOKENS,
    MAX_WORKLOAD_TOKENS,
    ArgumentParser,
    finite_float,
    int_in_range,
    positive_int,
    random_seed,
)


@dataclass
class RunResult:
    """What one system did on the workload."""

    name: str
    seconds: float
    generated: int
    peak_kv_bytes: int
    step_seconds: list[float]
    tokens: dict[int, list[int]]

    @property
    def throughput(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated / self.seconds

    def percentile(self, q: float) -> float:
        """Step time percentile in milliseconds."""
        ordered = sorted(self.step_seconds)
        index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return 1000 * ordered[index]


def build_model(*, num_layers: int, window: int, vocab: int) -> Any:
    """A gpt-oss-like model whose cost is dominated by attention over long contexts."""
    return build_tiny_model(
        "gpt_oss",
        window=window,
        num_layers=num_layers,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=2,
        num_experts_per_tok=1,
    )


def workload(
    n: int, *, max_prompt: int, min_out: int, max_out: int, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens) pairs; prompt lengths log-uniform in 16..max_prompt.

    A ``max_prompt`` below 16 makes every prompt ``max_prompt`` tokens long.
    """
    rng = random.Random(seed)
    out = []
    shortest = min(16, max_prompt)
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(shortest), math.log(max_prompt))))
        out.append(([rng.randrange(vocab) for _ in range(length)], rng.randint(min_out, max_out)))
    return out


def _cache_bytes(caches: Any) -> int:
    total = 0
    for cache in caches or []:
        total += int(getattr(cache, "nbytes", 0) or 0)
    return total


def run_mlx_lm(model: Any, requests: list[tuple[list[int], int]], running: int) -> RunResult:
    """mlx-lm's BatchGenerator with at most ``running`` sequences decoding."""
    from mlx_lm.generate import BatchGenerator  # imported here: a bad option fails fast

    gen = BatchGenerator(
        model,
        completion_batch_size=running,
        prefill_batch_size=min(8, running),
        prefill_step_size=512,
    )
    uids = gen.insert([p for p, _ in requests], [m for _, m in requests])
    index = {uid: i for i, uid in enumerate(uids)}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    remaining = set(uids)
    steps: list[float] = []
    peak = 0
    start = time.perf_counter()
    while remaining:
        tic = time.perf_counter()
        _, responses = gen.next()
        steps.append(time.perf_counter() - tic)
        for r in responses:
            tokens[index[r.uid]].append(r.token)
            if r.finish_reason is not None:
                remaining.discard(r.uid)
        held = _cache_bytes(gen._generation_batch.prompt_cache) + _cache_bytes(
            gen._prompt_batch.prompt_cache
        )
        peak = max(peak, held)
    seconds = time.perf_counter() - start
    gen.close()
    generated = sum(len(t) for t in tokens.values())
    return RunResult("mlx-lm BatchGenerator", seconds, generated, peak, steps, tokens)


def run_engine(
    model: Any,
    requests: list[tuple[list[int], int]],
    running: int,
    *,
    budget_bytes: int,
    page_size: int,
    chunk: int,
    fused: str,
) -> tuple[RunResult, HybridKVPool, DecodeEngine]:
    """kv-batching's DecodeEngine on a HybridKVPool of ``budget_bytes``."""
    layout = layout_from_model(model)
    longest = max(len(p) + m for p, m in requests)
    pool = HybridKVPool.from_budget(
        layout,
        budget_bytes,
        max_context=longest,
        concurrency=running,
        page_size=page_size,
        prefill_chunk=chunk,
    )
    engine = build_engine(
        model, pool=pool, fused_rope=fused, max_running=running, prefill_chunk=chunk
    )
    ids = [engine.submit(p, m) for p, m in requests]
    steps: list[float] = []
    start = time.perf_counter()
    while engine.has_work:
        tic = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - tic)
    seconds = time.perf_counter() - start
    out = {i: list(engine.output(rid).tokens) for i, rid in enumerate(ids)}
    capacity = sum(s.num_pages * s.bytes_per_page for s in pool.memory_report().sub_pools)
    generated = sum(len(t) for t in out.values())
    return (
        RunResult("kv-batching DecodeEngine", seconds, generated, capacity, steps, out),
        pool,
        engine,
    )


def memcpy_bandwidth() -> float:
    """GB/s of a large device copy, measured now (the KV read-bandwidth yardstick)."""
    a = mx.random.normal((64 * 1024 * 1024 // 4,))
    mx.eval(a)
    best = math.inf
    for _ in range(5):
        tic = time.perf_counter()
        b = a + 0
        mx.eval(b)
        best = min(best, time.perf_counter() - tic)
    return 2 * a.nbytes / best / 1e9


def decode_kv_bytes_read(layout: CacheLayout, requests: list[tuple[list[int], int]]) -> int:
    """KV bytes the decode steps of ``requests`` must read at least (what attention sees).

    The token generated at position ``p`` by a decode step attends to ``p + 1`` keys in a full
    layer and ``min(p + 1, window)`` in a sliding one (the first generated token comes from
    prefill and is not counted).
    """
    total = 0
    for prompt, max_tokens in requests:
        for position in range(len(prompt), len(prompt) + max_tokens - 1):
            for layer_id in layout.attention_layer_ids:
                window = layout.window(layer_id)
                keys = position + 1 if window is None else min(position + 1, window)
                total += keys * layout.geometry(layer_id).bytes_per_token
    return total


def machine_description() -> str:
    """One line naming this machine and the MLX build."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, mlx {version('mlx')} "
        f"({mx.default_device()}), mlx-lm {version('mlx-lm')}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.kv bench``, each checked while parsing."""
    parser = ArgumentParser(prog="python -m tools.kv bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workload, under a minute")
    parser.add_argument(
        "--requests",
        type=positive_int(MAX_REQUESTS),
        default=None,
        help=f"number of requests, 1..{MAX_REQUESTS} (default 48, quick 16)",
    )
    parser.add_argument(
        "--max-prompt",
        type=positive_int(MAX_TOKENS),
        default=None,
        help=f"longest prompt, 1..{MAX_TOKENS} tokens (default 3800, quick 1024)",
    )
    parser.add_argument(
        "--running",
        type=positive_int(MAX_REQUESTS),
        default=16,
        help="most requests decoding at once (default 16)",
    )
    parser.add_argument(
        "--layers",
        type=int_in_range(
            2, MAX_LAYERS, why="; layers alternate sliding/full, so 2 is the fewest with a full one"
        ),
        default=4,
        help=f"model layers, alternating sliding/full, 2..{MAX_LAYERS} (default 4)",
    )
    parser.add_argument(
        "--window",
        type=positive_int(MAX_TOKENS),
        default=128,
        help="sliding window (default 128)",
    )
    parser.add_argument(
        "--page-size",
        type=positive_int(MAX_PAGE_SIZE),
        default=16,
        help=f"pool page size, 1..{MAX_PAGE_SIZE} (default 16)",
    )
    parser.add_argument(
        "--chunk", type=positive_int(MAX_TOKENS), default=512, help="prefill chunk (default 512)"
    )
    parser.add_argument(
        "--kv-fraction",
        type=finite_float(0.0, 1.0, min_inclusive=False),
        default=0.5,
        help="engine pool budget as a fraction in (0, 1] of mlx-lm's measured peak KV "
        "(default 0.5)",
    )
    parser.add_argument(
        "--fused-rope",
        default="off",
        choices=["off", "auto", "reference", "metal", "cuda"],
        help="fused RoPE + pool-scatter kernel (default off)",
    )
    parser.add_argument(
        "--seed", type=random_seed, default=0, help="workload seed, 0..2**32-1 (default 0)"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="also print the results as a Markdown section"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run both systems, print the comparison; returns the exit status.

    A bad option is one ``error:`` line and status 2 before anything runs; a pool the
    ``--kv-fraction`` makes too small for the workload is one ``error:`` line and status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    n, max_prompt, _, max_out = _workload_shape(args)
    if n * (max_prompt + max_out) > MAX_WORKLOAD_TOKENS:
        parser.error(
            f"{n} requests of up to {max_prompt} prompt tokens are more than "
            f"{MAX_WORKLOAD_TOKENS} tokens in all; ask for fewer (--requests) or shorter "
            "(--max-prompt) requests"
        )
    try:
        _run(args, argv)
    except KVCacheError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _workload_shape(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """Requests, longest prompt, fewest and most output tokens of the run ``args`` ask for."""
    n = args.requests or (16 if args.quick else 48)
    max_prompt = args.max_prompt or (1024 if args.quick else 3800)
    min_out, max_out = (8, 48) if args.quick else (16, 192)
    return n, max_prompt, min_out, max_out


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    n, max_prompt, min_out, max_out = _workload_shape(args)
    vocab = 512

    model = build_model(num_layers=args.layers, window=args.window, vocab=vocab)
    requests = workload(
        n, max_prompt=max_prompt, min_out=min_out, max_out=max_out, vocab=vocab, seed=args.seed
    )
    print(
        f"workload: {n} requests, prompts {min(len(p) for p, _ in requests)}.."
        f"{max(len(p) for p, _ in requests)} tokens, outputs {min_out}..{max_out}, "
        f"at most {args.running} running; model gpt_oss-like {args.layers} layers, "
        f"window {args.window}, 8 q / 2 kv heads x 64, fp32"
    )
    # Warm both paths (JIT / compile) on a throwaway request.
    run_mlx_lm(model, requests[:1], args.running)
    base = run_mlx_lm(model, requests, args.running)
    budget = int(base.peak_kv_bytes * args.kv_fraction)
    mine, pool, engine = run_engine(
        model,
        requests,
        args.running,
        budget_bytes=budget,
        page_size=args.page_size,
        chunk=args.chunk,
        fused=args.fused_rope,
    )
    agree = sum(
        sum(a == b for a, b in zip(base.tokens[i], mine.tokens[i], strict=False))
        for i in base.tokens
    )
    total = sum(len(t) for t in base.tokens.values())
    print(
        f"\n{'':26s} {'tok/s':>9s} {'peak KV MiB':>11s} {'p50 ms':>8s} {'p99 ms':>8s} {'steps':>6s}"
    )
    for r in (base, mine):
        print(
            f"{r.name:26s} {r.throughput:9.1f} {r.peak_kv_bytes / 2**20:11.2f} "
            f"{r.percentile(0.5):8.2f} {r.percentile(0.99):8.2f} {len(r.step_seconds):6d}"
        )
    print(
        f"\nratios (engine / mlx-lm): throughput {mine.throughput / base.throughput:.2f}x, "
        f"peak KV {mine.peak_kv_bytes / base.peak_kv_bytes:.2f}x"
    )
    peak_used = engine.stats.peak_pages_used
    used_bytes = sum(
        peak_used.get(s.name, 0) * s.bytes_per_page for s in pool.memory_report().sub_pools
    )
    stats = engine.stats
    print(
        f"engine: pool {pool!r}; peak pages used {peak_used} ({used_bytes / 2**20:.2f} MB); "
        f"preemptions {stats.preemptions}; max queue {max(stats.queue_length)}; "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s, "
        f"prefill {stats.prefill_tokens_per_s:.1f} tok/s"
    )
    decode = sorted(stats.decode_step_seconds)
    print(
        f"engine decode step: p50 {1000 * statistics.median(decode):.2f} ms, "
        f"mean batch {statistics.mean(stats.decode_batch_sizes):.1f}"
    )
    print(f"greedy token agreement with mlx-lm: {agree}/{total}")
    kv_read = decode_kv_bytes_read(layout_from_model(model), requests)
    kv_bandwidth = kv_read / stats.decode_seconds / 1e9 if stats.decode_seconds else 0.0
    copy_bandwidth = memcpy_bandwidth()
    print(
        f"achieved KV read bandwidth in decode: {kv_bandwidth:.2f} GB/s "
        f"({kv_read / 2**20:.0f} MiB of KV attended over {stats.decode_seconds:.1f} s of decode; "
        f"a lower bound: decode time includes projections and MLP); memory-copy bandwidth "
        f"measured now: {copy_bandwidth:.1f} GB/s ({100 * kv_bandwidth / copy_bandwidth:.0f}%)"
    )
    if args.markdown:
        command = "uv run python -m tools.kv bench" + (" " + " ".join(argv) if argv else "")
        print(
            "\n".join(
                [
                    "",
                    f"Command: `{command.replace(' --markdown', '')}`  ",
                    f"Machine: {machine_description()}  ",
                    f"Workload: {n} requests, prompts {min(len(p) for p, _ in requests)}.."
                    f"{max(len(p) for p, _ in requests)} tokens, outputs {min_out}..{max_out}, "
                    f"at most {args.running} running; gpt_oss-like model, {args.layers} layers "
                    f"(alternating window {args.window} / full), 8 q / 2 kv heads x 64, fp32",
                    "",
                    "| system | tok/s | peak KV MiB | p50 step ms | p99 step ms |",
                    "|---|---|---|---|---|",
                    *(
                        f"| {r.name} | {r.throughput:.1f} | {r.peak_kv_bytes / 2**20:.2f} | "
                        f"{r.percentile(0.5):.1f} | {r.percentile(0.99):.1f} |"
                        for r in (base, mine)
                    ),
                    f"| **ratio** | **{mine.throughput / base.throughput:.2f}x** | "
                    f"**{mine.peak_kv_bytes / base.peak_kv_bytes:.2f}x** | "
                    f"{mine.percentile(0.5) / base.percentile(0.5):.2f}x | "
                    f"{mine.percentile(0.99) / base.percentile(0.99):.2f}x |",
                    "",
                    f"Greedy tokens identical to mlx-lm: {agree}/{total}. Engine peak KV is its "
                    f"whole pool (pages in use peaked at {used_bytes / 2**20:.2f} MiB). "
                    f"KV read bandwidth achieved in decode: {kv_bandwidth:.2f} GB/s against "
                    f"{copy_bandwidth:.1f} GB/s memory copy measured in the same run.",
                ]
            )
        )


if __name__ == "__main__":
    sys.exit(main())
