"""Benchmark: the packaged Gemma 3 270M with the native CPU kernels on and off, alternating.

Each round runs one process per setting (``KV_CPU_KERNELS`` is read when the kernels are
built, so a setting needs its own process), in alternating order, on the BLAS kv-serve
loads. A process times the prefill of one ``--prompt``-token random prompt (the engine's
default chunks) and the decode of ``--tokens`` tokens at each ``--batch`` size after
16-token prompts (steps timed from the first token of every request), greedy, prefix
caching off. Reported: tokens per second, each round's value; and the CPU's vector flags,
since the kernels' tiles depend on them (AVX-512, or AVX2's 8-lane halves).

    uv run python -m tools.bench_cpu_kernels
    uv run python -m tools.bench_cpu_kernels --markdown docs/results/bench_cpu_kernels.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tools.bench_cpu_linear import cpu_flags

SETTINGS = ("auto", "off")


def measure(prompt: int, tokens: int, batches: Sequence[int]) -> dict[str, float]:
    """The prefill and decode speeds of this process (tokens per second)."""
    import kv_serve

    kv_serve.load_fast_blas()
    from kv_serve import build_engine, load_model

    model, tokenizer = load_model("gemma3-270m")
    vocab = len(tokenizer)
    rng = random.Random(0)
    out: dict[str, float] = {}
    ids = [rng.randrange(2, vocab) for _ in range(prompt)]
    with build_engine(model, max_running=1, max_context=prompt + 8, prefix_caching=False) as e:
        start = time.perf_counter()
        rid = e.submit(ids, 1)
        while not e.is_finished(rid):
            e.step()
        out[f"prefill {prompt}"] = prompt / (time.perf_counter() - start)
    for batch in batches:
        prompts = [[rng.randrange(2, vocab) for _ in range(16)] for _ in range(batch)]
        with build_engine(
            model, max_running=batch, max_context=32 + tokens, prefix_caching=False
        ) as e:
            rids = [e.submit(p, tokens + 1) for p in prompts]
            while not all(e.output(r).tokens for r in rids):
                e.step()
            start = time.perf_counter()
            before = sum(len(e.output(r).tokens) for r in rids)
            while not all(e.is_finished(r) for r in rids):
                e.step()
            made = sum(len(e.output(r).tokens) for r in rids) - before
            out[f"decode B={batch}"] = made / (time.perf_counter() - start)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prefill prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per request")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", metavar="FILE.md", help="also write the table there")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.prompt, args.tokens, args.batch)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            command = [sys.executable, "-m", "tools.bench_cpu_kernels", "--child"]
            command += ["--prompt", str(args.prompt), "--tokens", str(args.tokens), "--batch"]
            command += [str(b) for b in args.batch]
            env = {**os.environ, "KV_CPU_KERNELS": setting}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, kernels {setting}: {runs[setting][-1]}", file=sys.stderr)
    names = list(runs[SETTINGS[0]][0])
    lines = [
        f"Gemma 3 270M (the packaged GGUF), CPU flags: {cpu_flags() or 'unknown'}; "
        f"tokens per second, each round ({args.rounds}, settings alternating)",
        "",
        "| | kernels on | kernels off (`KV_CPU_KERNELS=off`) |",
        "|---|---|---|",
    ]
    for name in names:
        cells = [" / ".join(f"{run[name]:.1f}" for run in runs[s]) for s in SETTINGS]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        shown = " ".join(["uv run python -m tools.bench_cpu_kernels", *(argv or sys.argv[1:])])
        Path(args.markdown).write_text(
            f"# Native CPU kernels on and off\n\n{time.strftime('%Y-%m-%d')}: `{shown}`\n\n"
            + table
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
