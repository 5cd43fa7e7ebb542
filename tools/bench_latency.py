"""Benchmark: inter-token latency of streaming requests while long prompts keep arriving.

``--streams`` requests with short prompts decode long outputs; while they do, ``--arrivals``
prompts of ``--long-min``..``--long-max`` tokens arrive, one each time the first stream has
produced another ``--every`` tokens. Reported per system: the gaps between consecutive tokens
of the streams (p50, p90, p99, max and p99 / p50), the long prompts' time to first token,
the wall time, and whether every request's greedy tokens equal mlx-lm's. Systems, in one
process on the same model and BLAS: mlx-lm's ``BatchGenerator`` (each ``next()`` decodes, then
prefills up to ``--chunk`` tokens of each of up to 8 prompts), the engine prefilling ``--chunk``
tokens a step, and the engine once per ``--stall`` value as its ``prefill_stall`` (a step's
prefill bounded to that many times its decode). Rounds alternate the order.

    uv run python -m tools.bench_latency
    uv run python -m tools.bench_latency --quick
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_protocol import KVCacheError
from kv_serve import build_engine
from tools.cli_args import (
    MAX_REQUESTS,
    MAX_TOKENS,
    ArgumentParser,
    add_engine_options,
    add_model_options,
    add_run_options,
    add_workload_options,
    positive_int,
)
from tools.harness import MlxLmBatch, Report, build_model, machine_description, quantile

VOCAB = 512


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Stream requests present from the start and long prompts arriving at stream tokens."""

    streams: list[tuple[list[int], int]]
    arrivals: list[tuple[list[int], int]]
    #: Arrival ``k`` is submitted once stream 0 has produced ``arrive_at[k]`` tokens.
    arrive_at: list[int]

    @property
    def requests(self) -> list[tuple[list[int], int]]:
        """Every request: the streams, then the arrivals."""
        return [*self.streams, *self.arrivals]


@dataclass
class LatencyRun:
    """What one system did: token times per request (seconds since the run started)."""

    name: str
    seconds: float
    token_times: dict[int, list[float]]
    submitted_at: dict[int, float]
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def gaps(self, requests: Sequence[int]) -> list[float]:
        """Seconds between consecutive tokens of ``requests``."""
        out: list[float] = []
        for i in requests:
            times = self.token_times[i]
            out += [b - a for a, b in itertools.pairwise(times)]
        return out

    def first_token_seconds(self, requests: Sequence[int]) -> list[float]:
        """Seconds from submission to the first token of ``requests``."""
        return [self.token_times[i][0] - self.submitted_at[i] for i in requests]


def make_workload(args: argparse.Namespace) -> Workload:
    """The seeded workload ``args`` describe."""
    rng = random.Random(args.seed)
    streams = [
        ([rng.randrange(VOCAB) for _ in range(rng.randint(64, 256))], args.stream_tokens)
        for _ in range(args.streams)
    ]
    arrivals = [
        (
            [rng.randrange(VOCAB) for _ in range(rng.randint(args.long_min, args.long_max))],
            args.long_tokens,
        )
        for _ in range(args.arrivals)
    ]
    arrive_at = [args.every * (k + 1) for k in range(args.arrivals)]
    return Workload(streams=streams, arrivals=arrivals, arrive_at=arrive_at)


def run_mlx_lm(model: Any, work: Workload, running: int, chunk: int) -> LatencyRun:
    """mlx-lm's BatchGenerator; arrivals inserted between ``next()`` calls."""
    driver = MlxLmBatch(model, running=running, prefill_step=chunk)
    for i, (prompt, max_tokens) in enumerate(work.streams):
        driver.submit(i, prompt, max_tokens)
    arrived = 0
    while driver.has_work:
        while arrived < len(work.arrivals) and len(driver.tokens[0]) >= work.arrive_at[arrived]:
            prompt, max_tokens = work.arrivals[arrived]
            driver.submit(len(work.streams) + arrived, prompt, max_tokens)
            arrived += 1
        driver.step()
        if not driver.has_work and arrived < len(work.arrivals):
            raise KVCacheError("the streams finished before every arrival; lower --every")
    seconds = driver.elapsed()
    driver.close()
    return LatencyRun(
        "mlx-lm BatchGenerator",
        seconds,
        driver.token_times,
        driver.submitted_at,
        driver.tokens,
    )


def run_engine(
    model: Any, work: Workload, running: int, chunk: int, stall: float | None, page_size: int
) -> LatencyRun:
    """The engine; arrivals submitted between steps."""
    longest = max(len(p) + m for p, m in work.requests)
    engine = build_engine(
        model,
        max_running=running,
        max_context=longest,
        page_size=page_size,
        prefill_chunk=chunk,
        prefill_stall=stall,
        prefix_caching=False,
    )
    try:
        rids: dict[int, int] = {}
        times: dict[int, list[float]] = {i: [] for i in range(len(work.requests))}
        submitted: dict[int, float] = {}
        start = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(work.streams):
            rids[engine.submit(prompt, max_tokens)] = i
            submitted[i] = time.perf_counter() - start
        arrived = 0
        generated0 = 0
        while engine.has_work or arrived < len(work.arrivals):
            while arrived < len(work.arrivals) and generated0 >= work.arrive_at[arrived]:
                prompt, max_tokens = work.arrivals[arrived]
                i = len(work.streams) + arrived
                rids[engine.submit(prompt, max_tokens)] = i
                submitted[i] = time.perf_counter() - start
                arrived += 1
            if not engine.has_work:
                raise KVCacheError("the streams finished before every arrival; lower --every")
            produced = engine.step()
            now = time.perf_counter() - start
            for rid, new in produced.items():
                times[rids[rid]] += [now] * len(new)
            generated0 = len(times[0])
        seconds = time.perf_counter() - start
        tokens = {i: list(engine.output(rid).tokens) for rid, i in rids.items()}
    finally:
        engine.close()
    name = "kv-batching DecodeEngine" + (
        f", prefill_stall={stall:g}" if stall is not None else f", {chunk}-token chunks"
    )
    return LatencyRun(name, seconds, times, submitted, tokens)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_latency``, each checked while parsing."""
    parser = ArgumentParser(
        prog="python -m tools.bench_latency", description=__doc__.splitlines()[0]
    )
    work = add_workload_options(parser)
    work.add_argument(
        "--streams", type=positive_int(MAX_REQUESTS), default=8, help="decoding requests (8)"
    )
    work.add_argument(
        "--stream-tokens",
        type=positive_int(MAX_TOKENS),
        default=None,
        help="tokens each stream generates (default 224, quick 96)",
    )
    work.add_argument(
        "--arrivals",
        type=positive_int(MAX_REQUESTS),
        default=None,
        help="long prompts arriving while the streams decode (default 6, quick 2)",
    )
    work.add_argument(
        "--long-min", type=positive_int(MAX_TOKENS), default=2048, help="shortest (2048)"
    )
    work.add_argument(
        "--long-max", type=positive_int(MAX_TOKENS), default=4096, help="longest (4096)"
    )
    work.add_argument(
        "--long-tokens",
        type=positive_int(MAX_TOKENS),
        default=16,
        help="tokens each long prompt generates (16)",
    )
    work.add_argument(
        "--every",
        type=positive_int(MAX_TOKENS),
        default=None,
        help="stream tokens between arrivals (default 32, quick 32)",
    )
    add_model_options(parser)
    add_engine_options(parser, stall=[2.0, 4.0])
    add_run_options(parser, quick="a small workload (about a minute)", rounds=1)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the systems on the workload and print the latency table; the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.long_min > args.long_max:
        parser.error(f"need --long-min <= --long-max, got {args.long_min} > {args.long_max}")
    if args.stream_tokens is None:
        args.stream_tokens = 96 if args.quick else 224
    if args.arrivals is None:
        args.arrivals = 2 if args.quick else 6
    if args.every is None:
        args.every = 32
    if args.quick:
        args.long_min, args.long_max = min(args.long_min, 1024), min(args.long_max, 2048)
    try:
        _run(args, argv)
    except KVCacheError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    work = make_workload(args)
    model = build_model(num_layers=args.layers, window=args.window, vocab=VOCAB)
    streams = list(range(len(work.streams)))
    arrivals = list(range(len(work.streams), len(work.requests)))
    print(f"Machine: {machine_description()}")
    described = (
        f"workload: {len(streams)} streams (prompts 64..256, {args.stream_tokens} tokens each); "
        f"{len(arrivals)} prompts of {args.long_min}..{args.long_max} tokens "
        f"({args.long_tokens} tokens each) arriving every {args.every} stream tokens; "
        f"gpt_oss-like, {args.layers} layers (window {args.window} / full), fp32; "
        f"chunk {args.chunk}, at most {args.running} running"
    )
    print(described)
    systems: dict[str, Any] = {
        "mlx-lm": lambda: run_mlx_lm(model, work, args.running, args.chunk),
        "chunks": lambda: run_engine(model, work, args.running, args.chunk, None, args.page_size),
    }
    for stall in args.stall:
        systems[f"stall {stall}"] = functools.partial(
            run_engine, model, work, args.running, args.chunk, stall, args.page_size
        )
    # Warm every path on a throwaway workload of one stream and no arrival.
    warm = Workload(streams=work.streams[:1], arrivals=[], arrive_at=[])
    run_mlx_lm(model, warm, args.running, args.chunk)
    run_engine(model, warm, args.running, args.chunk, args.stall[0], args.page_size)
    runs: dict[str, list[LatencyRun]] = {key: [] for key in systems}
    order = list(systems)
    for round_index in range(args.rounds):
        for key in order if round_index % 2 == 0 else order[::-1]:
            runs[key].append(systems[key]())
    base = runs["mlx-lm"][0].tokens
    results = Report("Decode that does not stall: inter-token latency while long prompts arrive")
    results.keep(described)
    with results.capturing():
        print()
        print(
            "| system | ITL p50 ms | p90 ms | p99 ms | max ms | p99 / p50 | long-prompt TTFT "
            "p50 s | wall s | tokens equal mlx-lm |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for key in order:
            gaps = [g for run in runs[key] for g in run.gaps(streams)]
            ttft = [t for run in runs[key] for t in run.first_token_seconds(arrivals)]
            wall = statistics.mean(run.seconds for run in runs[key])
            same = sum(
                run.tokens[i] == base[i] for run in runs[key] for i in range(len(work.requests))
            )
            total = len(runs[key]) * len(work.requests)
            p50 = quantile(gaps, 0.5)
            print(
                f"| {runs[key][0].name} | {1000 * p50:.1f} | {1000 * quantile(gaps, 0.9):.1f} | "
                f"{1000 * quantile(gaps, 0.99):.1f} | {1000 * max(gaps):.1f} | "
                f"{quantile(gaps, 0.99) / p50:.2f}x | {quantile(ttft, 0.5):.2f} | "
                f"{wall:.1f} | {same}/{total} |"
            )
    results.write(args.markdown, prog="tools.bench_latency", argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
