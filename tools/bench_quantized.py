"""Quantized KV pages: accuracy on a trained model, and capacity at a fixed KV budget.

``accuracy`` (Gemma 3 270M, fp32 weights, the pool's pages fp32 / 8-bit / 4-bit):

1. mean loss (nats/token) of the longest shipped prompt of :mod:`tools.real_prompts` (about
   1250 tokens, past the 512-token window), prefilled through the pool in chunks so later
   chunks read quantized K/V of earlier ones; mlx-lm's own caches give the reference;
2. greedy agreement over ``--tokens`` generated tokens on the 16 real prompts against the
   unquantized pool: *teacher-forced* (the quantized pool is fed the unquantized run's
   tokens; the share of positions where its greedy choice is the same token) and
   *free-running* (the share of positions equal in the two generations, which stops
   counting at the first difference since the texts then differ).

``capacity`` (a gpt-oss-like tiny model, random fp32 weights, a long-context workload): one KV
budget for every system; how many requests of the workload's longest context fit in it (the
pool: pages of every sub-pool; mlx-lm: its measured per-request cache bytes), then the
workload served at that concurrency: throughput, process peak memory above the weights, and
tokens equal to the unquantized engine's. mlx-lm's ``BatchGenerator`` keeps its caches
unquantized (its quantized cache is neither batchable nor available for sliding layers).

    uv run python -m tools.bench_quantized accuracy            # Gemma 3 270M (minutes)
    uv run python -m tools.bench_quantized capacity            # tiny model (minutes)
    uv run python -m tools.bench_quantized capacity --quick
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kv_batching._cache_nesting import CacheNesting
from kv_caches import PoolBackedKVCache
from kv_pool import HybridKVPool, pages_per_request
from kv_protocol import KVCacheError, KVQuantization, layout_from_model
from kv_serve import active_blas, build_engine, build_pool, encode_prompt, load_model
from kv_testing import mlx_lm_greedy
from tools.cli_args import (
    ArgumentParser,
    add_engine_options,
    add_model_options,
    add_run_options,
    add_trained_model_options,
    add_workload_options,
    positive_int,
)
from tools.harness import Report, build_model, measured, run_mlx_lm, workload
from tools.real_prompts import REAL_PROMPTS, real_prompts

#: (label, bits) of the systems compared; ``None`` is the unquantized pool.
SETTINGS: tuple[tuple[str, int | None], ...] = (("fp32", None), ("8-bit", 8), ("4-bit", 4))


# ---------------------------------------------------------------------------- accuracy


def pool_logits(
    model: Any, tokens: Sequence[int], *, bits: int | None, group_size: int, chunk: int
) -> mx.array:
    """``(T, vocab)`` logits of ``tokens`` prefilled through a pool in ``chunk``-token pieces."""
    layout = layout_from_model(model)
    pool = build_pool(
        layout,
        max_running=1,
        max_context=len(tokens),
        prefill_chunk=chunk,
        kv_bits=bits,
        kv_group_size=group_size,
    )
    pool.add_request(0)
    flat = [
        PoolBackedKVCache(pool, 0, i) if i in layout.attention_layer_ids else None
        for i in range(layout.num_layers)
    ]
    caches = CacheNesting.from_model(model).nest(flat)
    pieces = []
    for start in range(0, len(tokens), chunk):
        piece = mx.array(list(tokens[start : start + chunk]))[None]
        logits = model(piece, cache=caches)[0].astype(mx.float32)
        mx.eval(logits)
        pieces.append(logits)
    pool.free_request(0)
    return mx.concatenate(pieces, axis=0)


def mean_loss(logits: mx.array, tokens: Sequence[int]) -> float:
    """Mean next-token cross-entropy (nats) of ``tokens[1:]`` under ``logits[:-1]``."""
    targets = mx.array(list(tokens[1:]))
    logprobs = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, targets[:, None], axis=-1)
    return float(-mx.mean(picked))


def engine_generations(
    model: Any,
    prompts: list[list[int]],
    tokens: int,
    *,
    bits: int | None,
    group_size: int,
    chunk: int,
) -> list[list[int]]:
    """Greedy ``tokens`` continuations of ``prompts``, served together by one engine."""
    engine = build_engine(
        model,
        max_running=len(prompts),
        max_context=max(len(p) for p in prompts) + tokens,
        prefill_chunk=chunk,
        record_pages=False,
        kv_bits=bits,
        kv_group_size=group_size,
    )
    ids = [engine.submit(p, tokens) for p in prompts]
    out = engine.run()
    engine.close()
    return [out[i] for i in ids]


def free_running_agreement(mine: list[int], reference: list[int]) -> int:
    """Positions equal before the first difference."""
    same = 0
    for a, b in zip(mine, reference, strict=True):
        if a != b:
            break
        same += 1
    return same


def run_accuracy(args: argparse.Namespace) -> int:
    """The accuracy table on a trained model."""
    print(f"BLAS: {active_blas().describe()}", flush=True)
    # Float32 weights throughout: mlx-lm's side runs the same model (see tools/anchor.py).
    model, tokenizer = load_model(args.model, dtype="float32", gguf_weights="dequantize")
    passage_name = max(REAL_PROMPTS, key=lambda n: len(REAL_PROMPTS[n]))
    passage = encode_prompt(tokenizer, REAL_PROMPTS[passage_name])
    prompts = [encode_prompt(tokenizer, text) for _, text in real_prompts()][: args.prompts]
    described = (
        f"model {args.model}; passage {passage_name!r} ({len(passage)} tokens, chunks of "
        f"{args.chunk}); {len(prompts)} prompts of {min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens, {args.tokens} generated; groups of {args.group_size}"
    )
    print(described, flush=True)
    caches = make_prompt_cache(model)
    reference_logits = []
    for start in range(0, len(passage), args.chunk):
        piece = mx.array(passage[start : start + args.chunk])[None]
        reference_logits.append(model(piece, cache=caches)[0].astype(mx.float32))
    reference_loss = mean_loss(mx.concatenate(reference_logits, axis=0), passage)
    print(f"mlx-lm's own caches: loss {reference_loss:.4f} nats/token", flush=True)

    generations: dict[str, list[list[int]]] = {}
    rows = []
    for label, bits in SETTINGS:
        tic = time.perf_counter()
        logits = pool_logits(
            model, passage, bits=bits, group_size=args.group_size, chunk=args.chunk
        )
        loss = mean_loss(logits, passage)
        generations[label] = engine_generations(
            model, prompts, args.tokens, bits=bits, group_size=args.group_size, chunk=args.chunk
        )
        forced = free = 0
        if bits is not None:
            for prompt, reference in zip(prompts, generations["fp32"], strict=True):
                full = prompt + reference
                greedy = mx.argmax(
                    pool_logits(
                        model, full, bits=bits, group_size=args.group_size, chunk=args.chunk
                    ),
                    axis=-1,
                ).tolist()
                assert isinstance(greedy, list)
                # Logits at position p predict token p + 1: the generated ones start at len(prompt).
                forced += sum(
                    int(greedy[len(prompt) - 1 + i] == token) for i, token in enumerate(reference)
                )
            for mine, reference in zip(generations[label], generations["fp32"], strict=True):
                free += free_running_agreement(mine, reference)
        total = len(prompts) * args.tokens
        rows.append((label, loss, forced / total, free / total, time.perf_counter() - tic))
        print(f"  {label}: done in {rows[-1][4]:.1f} s", flush=True)

    fp_loss = rows[0][1]
    results = Report("Quantized KV pages: accuracy on a trained model")
    results.keep(f"{described}; mlx-lm's own caches: loss {reference_loss:.4f} nats/token")
    with results.capturing():
        print(
            "\n| KV pages | loss (nats/token) | vs fp32 | greedy agreement, teacher-forced "
            "| free-running |"
        )
        print("|---|---|---|---|---|")
        for label, loss, forced_share, free_share, _ in rows:
            if label == "fp32":
                print(f"| {label} | {loss:.4f} | - | - | - |")
            else:
                change = 100 * (loss - fp_loss) / fp_loss
                print(
                    f"| {label} | {loss:.4f} | {change:+.2f}% | {100 * forced_share:.1f}% "
                    f"| {100 * free_share:.1f}% |"
                )
    results.write(args.markdown, prog="tools.bench_quantized", argv=args.argv)
    return 0


# ---------------------------------------------------------------------------- capacity


@dataclass
class CapacityRow:
    """One system at the fixed budget."""

    name: str
    fits: int
    seconds: float
    generated: int
    peak_bytes: int
    tokens: dict[int, list[int]]


def pool_concurrency(pool: HybridKVPool, max_context: int, chunk: int) -> int:
    """Requests of ``max_context`` tokens that fit in every sub-pool at their peak."""
    peaks = pages_per_request(
        pool.layout,
        max_context=max_context,
        page_size={s.name: s.page_size for s in pool.sub_pools},
        prefill_chunk=chunk,
    )
    return min((s.num_pages - 1) // peaks[s.name] for s in pool.sub_pools)


def mlx_lm_request_bytes(model: Any, prompt: list[int], max_tokens: int) -> int:
    """Cache bytes mlx-lm holds for one request of this length at its end (its peak)."""
    caches = make_prompt_cache(model)
    mlx_lm_greedy(model, prompt, max_tokens, caches=caches)
    return sum(int(c.nbytes) for c in caches)


def run_capacity(args: argparse.Namespace) -> int:
    """The capacity table on a tiny long-context model."""
    print(f"BLAS: {active_blas().describe()}", flush=True)
    model = build_model(num_layers=args.layers, window=args.window, vocab=256)
    requests = workload(
        args.requests,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        min_out=args.max_out,
        max_out=args.max_out,
        vocab=256,
        seed=args.seed,
    )
    longest = max(len(p) + m for p, m in requests)
    layout = layout_from_model(model)
    budget = args.budget_mib * 2**20
    per_mlx = mlx_lm_request_bytes(model, [1] * (longest - args.max_out), args.max_out)
    described = (
        f"{args.requests} requests, prompts {args.min_prompt}..{args.max_prompt}, "
        f"{args.max_out} out each (longest context {longest}); {args.layers} layers, window "
        f"{args.window}; KV budget {args.budget_mib} MiB; groups of {args.group_size}"
    )
    print(described, flush=True)
    rows: list[CapacityRow] = []
    for label, bits in SETTINGS:
        quant = None if bits is None else KVQuantization(bits=bits, group_size=args.group_size)
        pool = HybridKVPool.from_budget(
            layout,
            budget,
            max_context=longest,
            concurrency=1,
            page_size=16,
            prefill_chunk=args.chunk,
            kv_quantization=quant,
        )
        fits = pool_concurrency(pool, longest, args.chunk)
        running = min(fits, args.requests)
        if running < 1:
            print(f"  {label}: not one request fits in {args.budget_mib} MiB")
            continue
        engine = build_engine(
            model, pool=pool, max_running=running, prefill_chunk=args.chunk, record_pages=False
        )

        def serve(engine: Any = engine) -> tuple[float, dict[int, list[int]]]:
            ids = [engine.submit(p, m) for p, m in requests]
            tic = time.perf_counter()
            out = engine.run()
            return time.perf_counter() - tic, {i: out[rid] for i, rid in enumerate(ids)}

        (seconds, tokens), peak = measured(serve)
        engine.close()
        generated = sum(len(t) for t in tokens.values())
        rows.append(CapacityRow(f"engine, {label} pages", fits, seconds, generated, peak, tokens))
        print(f"  {rows[-1].name}: {fits} fit, {seconds:.1f} s", flush=True)
    fits_mlx = budget // per_mlx
    if fits_mlx >= 1:
        result, peak = measured(lambda: run_mlx_lm(model, requests, min(fits_mlx, args.requests)))
        rows.append(
            CapacityRow(
                "mlx-lm BatchGenerator (fp32 caches)",
                fits_mlx,
                result.seconds,
                result.generated,
                peak,
                result.tokens,
            )
        )
    else:
        print(f"  mlx-lm: one request needs {per_mlx / 2**20:.1f} MiB, more than the budget")

    reference = rows[0].tokens
    results = Report("Quantized KV pages: capacity at a fixed KV budget")
    results.keep(described)
    with results.capturing():
        print(
            "\n| system | requests that fit | throughput tok/s | peak memory above weights MiB "
            "| tokens equal to fp32 engine |"
        )
        print("|---|---|---|---|---|")
        for row in rows:
            same = sum(free_running_agreement(row.tokens[i], reference[i]) for i in reference)
            total = sum(len(t) for t in reference.values())
            print(
                f"| {row.name} | {row.fits} | {row.generated / row.seconds:.1f} | "
                f"{row.peak_bytes / 2**20:.1f} | {same}/{total} |"
            )
    results.write(args.markdown, prog="tools.bench_quantized", argv=args.argv)
    return 0


# ---------------------------------------------------------------------------- command line


def build_parser() -> ArgumentParser:
    """The command line of both benchmarks."""
    top = ArgumentParser(
        prog="python -m tools.bench_quantized", description=__doc__.splitlines()[0]
    )
    commands = top.add_subparsers(dest="command", required=True)
    acc = commands.add_parser("accuracy", help="loss and greedy agreement on a trained model")
    add_trained_model_options(
        acc,
        default="gemma3-270m",
        help="gemma3-270m (default), a Gemma 3 .gguf or an mlx-lm directory",
    )
    acc.add_argument("--tokens", type=positive_int(1024), default=64, help="generated (64)")
    acc.add_argument(
        "--prompts", type=positive_int(16), default=16, help="real prompts generated from (16)"
    )
    acc.add_argument("--group-size", choices=("32", "64", "128"), default="64")
    add_engine_options(acc, running=None, page_size=None, chunk=256)
    add_run_options(acc, quick=None)
    acc.set_defaults(handler=run_accuracy)
    cap = commands.add_parser("capacity", help="requests that fit a KV budget, and throughput")
    cap.add_argument("--budget-mib", type=positive_int(1 << 16), default=24, help="KV MiB (24)")
    cap.add_argument("--group-size", choices=("32", "64", "128"), default="64")
    add_workload_options(cap, requests=32, min_prompt=1024, max_prompt=2048, max_out=32)
    add_model_options(cap)
    add_engine_options(cap, running=None, page_size=None, chunk=512)
    add_run_options(cap, quick="a small run (seconds)")
    cap.set_defaults(handler=run_capacity)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark; bad input is one ``error:`` line and exit status 2."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.group_size = int(args.group_size)
    if getattr(args, "quick", False):
        args.requests, args.min_prompt, args.max_prompt, args.max_out = 6, 64, 256, 8
        args.budget_mib = min(args.budget_mib, 2)
    if getattr(args, "min_prompt", 0) > getattr(args, "max_prompt", math.inf):
        print("error: need --min-prompt <= --max-prompt", file=sys.stderr)
        return 2
    try:
        status: int = args.handler(args)
        return status
    except KVCacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
