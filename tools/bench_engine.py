"""Benchmark: kv-batching's DecodeEngine against mlx-lm's BatchGenerator in one process.

Both serve the same workload on the same model, greedy, at most 16 decoding at once. By
default the model is an attention-dominated gpt-oss-like one (random fp32 weights;
alternating sliding-window / full layers with attention sinks) with random prompts up to ~4k
tokens; ``--model gemma3-270m`` (or a Gemma 3 ``.gguf``) serves the 16 real English prompts
of :mod:`tools.real_prompts` on the trained model instead. mlx-lm runs first and its peak KV
bytes (the batch caches it holds, summed after every step) size the engine's pool: by
default the pool gets half of that, so the engine must serve the same work in half the KV
memory. The two then alternate (``--rounds``). Reported: throughput (generated tokens per
second of wall time, prefill included), peak KV bytes, the process's peak memory above the
weights (``mx.get_peak_memory()``), p50/p99 step time, token agreement, and the BLAS.

    uv run python -m tools.kv bench            # full run (minutes on CPU)
    uv run python -m tools.kv bench --quick    # under a minute
    uv run python -m tools.kv bench --model gemma3-270m
    uv run python -m tools.kv bench --markdown docs/results/bench_engine.md   # keep the run

The shared pieces (the model, the workload, both systems, the quantile rule, the copy
bandwidth) are in :mod:`tools.harness`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kv_protocol import CacheLayout, KVCacheError, layout_from_model
from kv_serve import active_blas, encode_prompt, load_model
from tools.anchor import anchor_model
from tools.cli_args import (
    MAX_WORKLOAD_TOKENS,
    ArgumentParser,
    add_engine_options,
    add_model_options,
    add_run_options,
    add_trained_model_options,
    add_workload_options,
    finite_float,
)
from tools.harness import (
    BANDWIDTH_UNIT,
    Report,
    RunResult,
    build_model,
    copy_bandwidth,
    gb_per_s,
    measured,
    quantile,
    run_engine,
    run_mlx_lm,
    workload,
)


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


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.kv bench``, each checked while parsing."""
    parser = ArgumentParser(prog="python -m tools.kv bench", description=__doc__.splitlines()[0])
    add_workload_options(
        parser,
        requests="48, quick 16",
        min_prompt=16,
        max_prompt="3800, quick 1024",
        min_out="16, quick 8",
        max_out="192, quick 48",
    )
    add_model_options(parser, sizes=True)
    engine = add_engine_options(parser, stall=None)
    engine.add_argument(
        "--kv-fraction",
        type=finite_float(0.0, 1.0, min_inclusive=False),
        default=0.5,
        help="engine pool budget as a fraction in (0, 1] of mlx-lm's measured peak KV "
        "(default 0.5)",
    )
    engine.add_argument(
        "--pool",
        choices=["fraction", "defaults"],
        default="fraction",
        help="fraction: a preallocated pool of --kv-fraction of mlx-lm's peak KV, prefix "
        "caching off (default); defaults: build_engine's own pool (capped at what --running "
        "requests of the longest request need, growing by slabs, prefix caching on)",
    )
    engine.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="the engine speculates (prompt lookup, build_engine's default switch: verifies "
        "only where it measures that it pays); default off, as build_engine",
    )
    engine.add_argument(
        "--fused-rope",
        default="off",
        choices=["off", "auto", "reference", "metal", "cuda"],
        help="fused RoPE + pool-scatter kernel (default off)",
    )
    add_trained_model_options(
        parser,
        default=None,
        dtype=True,
        help="a trained model with a tokenizer (gemma3-270m, a Gemma 3 .gguf) serving the real "
        "prompts of tools/real_prompts.py instead of the random-weight model",
    )
    add_run_options(parser, quick="small workload, under a minute", rounds=2)
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
    if args.model is not None:
        from tools.real_prompts import REAL_PROMPTS

        # A token holds at least one character (plus BOS): a bound without the tokenizer.
        longest_prompt = 1 + max(len(text) for text in REAL_PROMPTS.values())
        n = args.requests or len(REAL_PROMPTS)
        return (n, longest_prompt, *((8, 32) if args.quick else (32, 96)))
    n = args.requests or (16 if args.quick else 48)
    max_prompt = args.max_prompt or (1024 if args.quick else 3800)
    min_out, max_out = (8, 48) if args.quick else (16, 192)
    min_out = args.min_out or min_out
    max_out = max(min_out, args.max_out or max_out)
    return n, max_prompt, min_out, max_out


@dataclass(frozen=True, kw_only=True)
class EngineReport:
    """What an engine run leaves to report once its pool and engine are gone."""

    pool: str
    peak_pages_used: dict[str, int]
    peak_pages_bytes: int
    preemptions: int
    max_queue: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_step_p50_ms: float
    mean_decode_batch: float
    decode_seconds: float
    decode_device_seconds: float
    prefill_seconds: float
    prefill_device_seconds: float


def _engine_run(
    model: Any, requests: list[tuple[list[int], int]], args: argparse.Namespace, budget: int
) -> tuple[RunResult, EngineReport]:
    result, pool, engine = run_engine(
        model,
        requests,
        args.running,
        budget_bytes=budget,
        page_size=args.page_size,
        chunk=args.chunk,
        fused=args.fused_rope,
        stall=args.stall,
        defaults=args.pool == "defaults",
        speculative=args.speculative,
    )
    stats = engine.stats
    peak_used = stats.peak_pages_used
    report = EngineReport(
        pool=repr(pool),
        peak_pages_used=peak_used,
        peak_pages_bytes=sum(
            peak_used.get(s.name, 0) * s.bytes_per_page for s in pool.memory_report().sub_pools
        ),
        preemptions=stats.preemptions,
        max_queue=stats.max_queue_length,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        decode_step_p50_ms=1000 * quantile(list(stats.decode_step_seconds) or [0.0], 0.5),
        mean_decode_batch=stats.decode_batch_size_total / max(stats.decode_steps, 1),
        decode_seconds=stats.decode_seconds,
        decode_device_seconds=stats.decode_device_seconds,
        prefill_seconds=stats.prefill_seconds,
        prefill_device_seconds=stats.prefill_device_seconds,
    )
    return result, report


def _combine(runs: list[RunResult]) -> RunResult:
    """One system's rounds as one result: mean throughput, highest peaks, all step times."""
    seconds = statistics.mean(r.seconds for r in runs)
    first = runs[0]
    return replace(
        first,
        seconds=seconds,
        peak_kv_bytes=max(r.peak_kv_bytes for r in runs),
        peak_memory_bytes=max(r.peak_memory_bytes for r in runs),
        step_seconds=[t for r in runs for t in r.step_seconds],
        first_token_seconds=[t for r in runs for t in r.first_token_seconds],
    )


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    n, max_prompt, min_out, max_out = _workload_shape(args)
    if args.model is not None:
        from tools.real_prompts import real_prompts

        model, tokenizer = load_model(args.model, dtype=args.dtype)
        anchor = anchor_model(model, args.model, dtype=args.dtype)
        rng = random.Random(args.seed)
        requests = [
            (encode_prompt(tokenizer, text), rng.randint(min_out, max_out))
            for _, text in real_prompts(n)
        ]
        described = (
            f"{args.model} ({args.dtype}); the real English prompts of tools/real_prompts.py"
        )
    else:
        vocab = 512
        model = build_model(
            num_layers=args.layers,
            window=args.window,
            vocab=vocab,
            hidden=args.hidden,
            experts=args.experts,
        )
        anchor = model
        requests = workload(
            n,
            max_prompt=max_prompt,
            min_out=min_out,
            max_out=max_out,
            vocab=vocab,
            seed=args.seed,
            min_prompt=args.min_prompt,
        )
        described = (
            f"gpt_oss-like model, {args.layers} layers (alternating window {args.window} / "
            f"full), hidden {args.hidden}, {args.experts} experts, 8 q / 2 kv heads x 64, fp32"
        )
    if args.stall is not None:
        described += f"; engine prefill_stall={args.stall:g}"
    shape = (
        f"{n} requests, prompts {min(len(p) for p, _ in requests)}.."
        f"{max(len(p) for p, _ in requests)} tokens, outputs {min_out}..{max_out}, "
        f"at most {args.running} running"
    )
    print(f"workload: {shape}; model {described}")
    print(f"BLAS: {active_blas().describe()}")
    # Warm both paths (JIT / compile) on a throwaway request.
    run_mlx_lm(anchor, requests[:1], args.running)
    first, first_peak = measured(lambda: run_mlx_lm(anchor, requests, args.running))
    bases = [replace(first, peak_memory_bytes=first_peak)]
    budget = int(bases[0].peak_kv_bytes * args.kv_fraction)
    _engine_run(model, requests[:1], args, budget)
    mines: list[RunResult] = []
    report: EngineReport | None = None
    # Round 0 is mlx-lm then the engine; each further round reverses the order.
    for round_index in range(args.rounds):
        order = ("engine", "mlx-lm") if round_index % 2 else ("mlx-lm", "engine")
        for system in order:
            if system == "mlx-lm":
                if round_index == 0:
                    continue  # the measured first run above
                base, peak = measured(lambda: run_mlx_lm(anchor, requests, args.running))
                bases.append(replace(base, peak_memory_bytes=peak))
            else:
                (mine, report), peak = measured(lambda: _engine_run(model, requests, args, budget))
                mines.append(replace(mine, peak_memory_bytes=peak))
    assert report is not None
    base, mine = _combine(bases), _combine(mines)
    agree = sum(
        sum(a == b for a, b in zip(base.tokens[i], mine.tokens[i], strict=False))
        for i in base.tokens
    )
    total = sum(len(t) for t in base.tokens.values())
    mib = 2**20
    print(
        f"\n{'':26s} {'tok/s':>9s} {'peak KV MiB':>11s} {'peak mem MiB':>12s} {'p50 ms':>8s} "
        f"{'p99 ms':>8s} {'steps':>6s} {'TTFT p50 s':>10s} {'TTFT p99 s':>10s}"
    )
    for r in (base, mine):
        print(
            f"{r.name:26s} {r.throughput:9.1f} {r.peak_kv_bytes / mib:11.2f} "
            f"{r.peak_memory_bytes / mib:12.2f} {r.step_ms(0.5):8.2f} "
            f"{r.step_ms(0.99):8.2f} {len(r.step_seconds) // args.rounds:6d} "
            f"{r.ttft(0.5):10.2f} {r.ttft(0.99):10.2f}"
        )
    print(
        f"\nratios (engine / mlx-lm), mean of {args.rounds} alternating rounds: throughput "
        f"{mine.throughput / base.throughput:.2f}x, peak KV "
        f"{mine.peak_kv_bytes / base.peak_kv_bytes:.2f}x, peak process memory above the weights "
        f"{mine.peak_memory_bytes / max(base.peak_memory_bytes, 1):.2f}x"
    )
    print(
        f"engine: pool {report.pool}; peak pages used {report.peak_pages_used} "
        f"({report.peak_pages_bytes / mib:.2f} MiB); preemptions {report.preemptions}; max queue "
        f"{report.max_queue}; decode {report.decode_tokens_per_s:.1f} tok/s, "
        f"prefill {report.prefill_tokens_per_s:.1f} tok/s"
    )
    print(
        f"engine decode step: p50 {report.decode_step_p50_ms:.2f} ms, "
        f"mean batch {report.mean_decode_batch:.1f}"
    )

    def split(total: float, device: float) -> str:
        host = max(0.0, total - device)
        share = 100 * host / total if total else 0.0
        return f"{total:.2f} s = host {host:.2f} s ({share:.0f}%) + device {device:.2f} s"

    decode = split(report.decode_seconds, report.decode_device_seconds)
    prefill = split(report.prefill_seconds, report.prefill_device_seconds)
    print(
        "engine time, host (Python, scheduling, page tables, graph building) and device "
        f"(MLX's evaluation and the native CPU kernels): decode {decode}; prefill {prefill}"
    )
    print(f"greedy token agreement with mlx-lm: {agree}/{total}")
    kv_read = decode_kv_bytes_read(layout_from_model(model), requests)
    seconds = report.decode_seconds
    kv_bandwidth = kv_read / seconds if seconds else 0.0
    copy = copy_bandwidth()
    unit = BANDWIDTH_UNIT
    print(
        f"achieved KV read bandwidth in decode: {gb_per_s(kv_bandwidth):.2f} {unit} "
        f"({kv_read / mib:.0f} MiB of KV attended over {seconds:.1f} s of decode; "
        f"a lower bound: decode time includes projections and MLP); memory-copy bandwidth "
        f"measured now: {gb_per_s(copy):.1f} {unit} ({100 * kv_bandwidth / copy:.0f}%)"
    )
    results = Report("Engine against mlx-lm's BatchGenerator")
    what = (
        "what its growing buffers held at the end (build_engine's defaults, prefix caching on)"
        if args.pool == "defaults"
        else "its whole pool"
    )
    results.keep(
        "\n".join(
            [
                f"Workload: {shape}; {described}; mean of {args.rounds} alternating rounds",
                "",
                "| system | tok/s | peak KV MiB | peak memory above weights MiB | "
                "p50 step ms | p99 step ms | TTFT p50 s | TTFT p99 s |",
                "|---|---|---|---|---|---|---|---|",
                *(
                    f"| {r.name} | {r.throughput:.1f} | {r.peak_kv_bytes / mib:.2f} | "
                    f"{r.peak_memory_bytes / mib:.1f} | "
                    f"{r.step_ms(0.5):.1f} | {r.step_ms(0.99):.1f} | "
                    f"{r.ttft(0.5):.2f} | {r.ttft(0.99):.2f} |"
                    for r in (base, mine)
                ),
                f"| **ratio** | **{mine.throughput / base.throughput:.2f}x** | "
                f"**{mine.peak_kv_bytes / base.peak_kv_bytes:.2f}x** | "
                f"**{mine.peak_memory_bytes / max(base.peak_memory_bytes, 1):.2f}x** | "
                f"{mine.step_ms(0.5) / base.step_ms(0.5):.2f}x | "
                f"{mine.step_ms(0.99) / base.step_ms(0.99):.2f}x | "
                f"{mine.ttft(0.5) / max(base.ttft(0.5), 1e-9):.2f}x | "
                f"{mine.ttft(0.99) / max(base.ttft(0.99), 1e-9):.2f}x |",
                "",
                f"Greedy tokens identical to mlx-lm: {agree}/{total}. Engine peak KV is {what} "
                f"(pages in use peaked at {report.peak_pages_bytes / mib:.2f} "
                "MiB); peak memory is `mx.get_peak_memory()` during the run above what was "
                "active before it (the weights). Engine time: decode "
                f"{decode}; prefill {prefill}. KV read bandwidth achieved in decode: "
                f"{gb_per_s(kv_bandwidth):.2f} {unit} against {gb_per_s(copy):.1f} {unit} "
                "memory copy measured in the same run.",
            ]
        )
    )
    results.write(args.markdown, prog="tools.kv bench", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
