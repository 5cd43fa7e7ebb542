"""Benchmark: a large vocabulary head projected on the CPU, float32 against quantized.

Gemma 3 270M's tied head is a 262144 x 640 matrix, about half of a decode step. Projected
from ``rows`` hidden states: float32 through the engine's fastest MKL form
(``kv_batching._model_forward.project_rows``), MLX's own ``mx.quantized_matmul`` on the same
head quantized (8 or 4 bits, groups of 32), and ``kv_metal_kernels.CpuQuantizedHead``'s
native kernel on those codes. The head is random (the packaged model's ``Q8_0`` table has
the same shape and bits); each time is the median of ``--rounds`` calls, the three forms
alternating, in one process:

    uv run python -m tools.bench_head --markdown docs/results/bench_head.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx

from kv_batching._model_forward import project_rows
from kv_metal_kernels import CpuQuantizedHead
from kv_serve import active_blas
from tools.cli_args import ArgumentParser, add_run_options, positive_int
from tools.harness import Report, quantile

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_head``."""
    parser = ArgumentParser(prog="python -m tools.bench_head", description=__doc__)
    parser.add_argument(
        "--rows",
        nargs="+",
        type=positive_int(256),
        default=[1, 2, 4, 8, 16, 32],
        help="hidden states projected at once (default 1 2 4 8 16 32)",
    )
    parser.add_argument(
        "--bits", nargs="+", type=int, choices=(4, 8), default=[8, 4], help="code widths"
    )
    parser.add_argument(
        "--vocab", type=positive_int(1 << 20), default=262144, help="head rows (262144)"
    )
    parser.add_argument("--hidden", type=positive_int(8192), default=640, help="head columns (640)")
    add_run_options(parser, quick="one round of 1 and 16 rows", rounds=5)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.hidden % 32:
        build_parser().error(f"--hidden must be a multiple of 32 (the groups), got {args.hidden}")
    if args.quick:
        args.rows, args.rounds = [1, 16], 1
    results = Report("A large vocabulary head on the CPU: float32 against quantized")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_head", argv=argv)
    return 0


def _times_ms(calls: dict[str, Callable[[], mx.array]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for name in order:
            tic = time.perf_counter()
            mx.eval(calls[name]())
            times[name].append((time.perf_counter() - tic) * 1e3)
    return {name: quantile(t, 0.5) for name, t in times.items()}


def _run(args: argparse.Namespace) -> None:
    kernel = CpuQuantizedHead()
    print(f"BLAS: {active_blas().describe()}")
    print(f"native kernel: {kernel.library.describe()}")
    weight = mx.random.normal((args.vocab, args.hidden), key=mx.random.key(0)) * 0.05
    mx.eval(weight)
    print()
    print(
        f"head {args.vocab} x {args.hidden}; median of {args.rounds} alternating calls, ms\n\n"
        "| bits | rows | float32 (MKL) | MLX quantized | native kernel | native vs float32 |\n"
        "|---|---|---|---|---|---|"
    )
    for bits in args.bits:
        codes, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
        mx.eval(codes, scales, biases)
        project = kernel.prepare(codes, scales, biases, group_size=32, bits=bits)
        for m in args.rows:
            x = mx.random.normal((m, args.hidden), key=mx.random.key(m))
            mx.eval(x)
            calls: dict[str, Callable[[], mx.array]] = {
                "fp32": partial(project_rows, weight, x),
                "mlx": partial(
                    mx.quantized_matmul,
                    x,
                    codes,
                    scales,
                    biases,
                    transpose=True,
                    group_size=32,
                    bits=bits,
                ),
            }
            if project is not None:
                calls["native"] = partial(project, x)
            got = _times_ms(calls, args.rounds)
            native = got.get("native")
            shown = f"{native:.1f}" if native is not None else "not built"
            ratio = f"{got['fp32'] / native:.2f}x" if native else "-"
            print(f"| {bits} | {m} | {got['fp32']:.1f} | {got['mlx']:.1f} | {shown} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
