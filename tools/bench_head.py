"""Benchmark: a large vocabulary head projected on the CPU, float32 against quantized.

Gemma 3 270M's tied head is a 262144 x 640 matrix, about half of a decode step. Projected
from ``rows`` hidden states: float32 through the engine's fastest MKL form
(``kv_batching._model_forward.project_rows``), MLX's own ``mx.quantized_matmul`` on the same
head quantized (8 or 4 bits, groups of 32), and ``kv_metal_kernels.CpuQuantizedHead``'s
native kernel on those codes. The head is random (the packaged model's ``Q8_0`` table has
the same shape and bits); each time is the median of ``--rounds`` calls, the three forms
alternating, in one process.

``--greedy`` measures a greedy step's pick instead, on the packaged Gemma 3 270M's own
8-bit head and its hidden states over the real prompts (``tools/real_prompts.py``; random
rows give flat logits that leave the screen more candidates than a model's do): the
native kernel's logits then MLX's argmax over them, against the kernel's integer screen
(``QuantizedHeadProjection.greedy``), alternating, with the two picks compared:

    uv run python -m tools.bench_head --markdown docs/results/bench_head.md
    uv run python -m tools.bench_head --greedy --markdown docs/results/bench_head_greedy.md
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
from kv_metal_kernels._quantized_head import QuantizedHeadProjection
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
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="a greedy pick on Gemma 3 270M's head: logits + argmax against the screen",
    )
    add_run_options(parser, quick="one round of 1 and 16 rows", rounds=5)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.hidden % 32:
        build_parser().error(f"--hidden must be a multiple of 32 (the groups), got {args.hidden}")
    if args.quick:
        args.rows, args.rounds = [1, 16], 1
    if args.greedy:
        results = Report("A greedy pick over Gemma 3 270M's vocabulary on the CPU")
        with results.capturing():
            _run_greedy(args)
        results.write(args.markdown, prog="tools.bench_head", argv=argv)
        return 0
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


def _argmax_of_logits(project: Callable[[mx.array], mx.array], rows: mx.array) -> mx.array:
    return mx.argmax(project(rows), axis=-1)


def _screened(project: QuantizedHeadProjection, rows: mx.array) -> mx.array:
    picked = project.greedy(rows)
    assert picked is not None
    return picked


def _run_greedy(args: argparse.Namespace) -> None:
    import mlx.nn as nn

    from kv_serve import load_fast_blas, load_model
    from tools.real_prompts import real_prompts

    load_fast_blas()
    print(f"BLAS: {active_blas().describe()}")
    model, tokenizer = load_model("gemma3-270m")
    embedding = model.model.embed_tokens
    biases = getattr(embedding, "biases", None)
    if not isinstance(embedding, nn.QuantizedEmbedding) or biases is None:
        raise SystemExit("the packaged model's head is not affine-quantized on this device")
    project = CpuQuantizedHead().prepare(
        embedding.weight,
        embedding.scales,
        biases,
        group_size=embedding.group_size,
        bits=embedding.bits,
    )
    if project is None or not project.screens:
        raise SystemExit("the native kernel's greedy screen is not built here (AVX-512 VNNI)")
    # The hidden states the head sees: the last 32 positions of each real prompt.
    states = []
    for _, text in real_prompts():
        ids = tokenizer.encode(text)
        states.append(model.model(mx.array([ids]))[0, -32:])
    pool = mx.concatenate(states)
    mx.eval(pool)
    print(f"{embedding.weight.shape[0]} x {pool.shape[1]} head, {embedding.bits}-bit codes")
    print(f"rows: hidden states of the real prompts ({pool.shape[0]} drawn from)\n")
    print(
        f"median of {args.rounds} alternating calls, ms\n\n"
        "| rows | logits + argmax | screen | screen vs logits | same picks |\n"
        "|---|---|---|---|---|"
    )
    for m in args.rows:
        x = pool[mx.arange(m) * (pool.shape[0] // m)]
        mx.eval(x)
        calls: dict[str, Callable[[], mx.array]] = {
            "logits": partial(_argmax_of_logits, project, x),
            "screen": partial(_screened, project, x),
        }
        got = _times_ms(calls, args.rounds)
        same = bool(mx.array_equal(calls["logits"](), calls["screen"]()))
        ratio = got["logits"] / got["screen"]
        print(f"| {m} | {got['logits']:.1f} | {got['screen']:.1f} | {ratio:.2f}x | {same} |")


if __name__ == "__main__":
    sys.exit(main())
