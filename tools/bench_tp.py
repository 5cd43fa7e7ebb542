"""Benchmark: tensor parallelism over ``mx.distributed``, one rank against two, on loopback.

Each run is a group of plain processes started as ``mlx.launch`` starts them
(``MLX_HOSTFILE`` + ``MLX_RANK``, ring backend on 127.0.0.1): every rank loads the model,
shards it (``kv_serve.shard_model``) and builds a ``LockstepEngine``; rank 0 submits ``batch``
greedy requests at once (no stop tokens: every request decodes ``--max-out`` tokens) and the
others follow. One rank is the same command without a group. Reported per batch: generated
tokens per second (wall, prefill included), the mean decode step, each rank's KV pool bytes
and peak RSS, and whether two ranks gave one rank's tokens. Ranks alternate in order across
rounds; BLAS threads are split between the ranks (``cores // ranks`` each), so both sides use
the same cores.

On one 2-core machine the point is correctness, not speed: the ranks share the cores and
talk through loopback sockets.

    uv run python -m tools.bench_tp
    uv run python -m tools.bench_tp --batch 1 4 --rounds 2 --markdown docs/results/bench_tp.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.cli_args import ArgumentParser, add_run_options
from tools.harness import Report, quantile

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_tp``."""
    parser = ArgumentParser(prog="python -m tools.bench_tp", description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="the model (gemma3-270m)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes (1 4)")
    parser.add_argument("--max-out", type=int, default=32, help="tokens per request (32)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes (1 2)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    add_run_options(parser, quick="batch 1, 16 tokens, one round", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        _worker(args)
        return 0
    if args.quick:
        args.batch, args.max_out, args.rounds = [1], 16, 1
    results = Report("Tensor parallelism on loopback")
    with results.capturing():
        _run(args, argv)
    results.write(args.markdown, prog="tools.bench_tp", argv=argv)
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(args: argparse.Namespace, ranks: int, folder: Path) -> list[dict[str, Any]]:
    """One group of ``ranks`` processes; each rank's result."""
    command = [sys.executable, "-m", "tools.bench_tp", "--model", args.model]
    command += ["--max-out", str(args.max_out), "--batch", *map(str, args.batch)]
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    env = {**os.environ, "MKL_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
    env["OPENBLAS_NUM_THREADS"] = threads
    if ranks > 1:
        hosts = folder / "hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)]))
        env["MLX_HOSTFILE"] = str(hosts)
    processes = []
    for rank in range(ranks):
        out = folder / f"rank{rank}.json"
        out.unlink(missing_ok=True)
        rank_env = {**env, "MLX_RANK": str(rank)} if ranks > 1 else env
        processes.append((subprocess.Popen([*command, "--worker", str(out)], env=rank_env), out))
    results = []
    for process, out in processes:
        if process.wait(1800) != 0:
            raise SystemExit(f"a rank of the {ranks}-rank run failed (status {process.returncode})")
        results.append(json.loads(out.read_text()))
    return results


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in args.ranks}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            order = list(args.ranks) if r % 2 == 0 else list(reversed(args.ranks))
            for n in order:
                runs[n].append(_launch(args, n, Path(folder)))
    first = runs[args.ranks[0]][0][0]
    print(f"{first['blas']}; model {args.model}, greedy, {args.max_out} tokens a request")
    print()
    print(
        "| ranks | batch | tok/s | decode step ms | KV pool MiB per rank | peak RSS MiB per rank "
        "| same tokens as 1 rank |\n|---|---|---|---|---|---|---|"
    )
    reference = runs[min(args.ranks)][0][0]["batches"]
    for n in args.ranks:
        for i, batch in enumerate(args.batch):
            leaders = [group[0]["batches"][i] for group in runs[n]]
            rate = quantile([b["tokens_out"] / b["seconds"] for b in leaders], 0.5)
            step = quantile([b["decode_step_s"] * 1000 for b in leaders], 0.5)
            pools = "/".join(f"{rank['pool_bytes'] / 2**20:.1f}" for rank in runs[n][0])
            rss = "/".join(
                f"{max(g[k]['peak_rss'] for g in runs[n]) / 2**20:.0f}" for k in range(n)
            )
            same = all(b["tokens"] == reference[i]["tokens"] for b in leaders)
            print(
                f"| {n} | {batch} | {rate:.1f} | {step:.0f} | {pools} | {rss} | "
                f"{'yes' if same else 'NO'} |"
            )


def _worker(args: argparse.Namespace) -> None:
    from kv_serve import (
        LockstepEngine,
        active_blas,
        build_engine,
        init_ranks,
        load_fast_blas,
        load_model,
        shard_model,
    )
    from tools.bench_spec import workload

    load_fast_blas()
    ranks = init_ranks(timeout=600.0)
    # As kv-serve serve does: several ranks read only their share of each tensor.
    model, tokenizer = load_model(args.model, lazy=ranks is not None)
    if ranks is not None:
        shard_model(model, ranks.group)
    prompts = workload(tokenizer, "open", max(args.batch))
    context = max(len(p) for p in prompts) + args.max_out
    engine = build_engine(
        model,
        max_running=max(args.batch),
        max_context=context,
        prefix_caching=False,
        ranks=ranks,
    )
    result: dict[str, Any] = {
        "blas": f"BLAS: {active_blas().describe()}",
        "pool_bytes": engine.memory_report().pool.bytes_total,
        "batches": [],
    }
    if isinstance(engine, LockstepEngine) and not engine.ranks.is_leader:
        engine.follow()
    else:
        warm = engine.submit(prompts[0], 4)
        engine.run()
        engine.release(warm)
        for batch in args.batch:
            steps, seconds = engine.stats.decode_steps, engine.stats.decode_seconds
            start = time.perf_counter()
            ids = [engine.submit(p, args.max_out) for p in prompts[:batch]]
            while any(not engine.is_finished(i) for i in ids):
                engine.step()
            elapsed = time.perf_counter() - start
            tokens = [list(engine.release(i).tokens) for i in ids]
            decode_steps = engine.stats.decode_steps - steps
            result["batches"].append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    "tokens_out": sum(len(t) for t in tokens),
                    "seconds": elapsed,
                    "decode_step_s": (engine.stats.decode_seconds - seconds) / max(1, decode_steps),
                }
            )
    engine.close()
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.worker).write_text(json.dumps(result))


if __name__ == "__main__":
    raise SystemExit(main())
