"""Benchmark: Gemma 3 270M's decode step for each ``load_model(gguf_weights=...)`` choice.

The packaged GGUF loaded three ways: ``dequantize`` (every tensor float32), ``embedding``
(the tied ``Q8_0`` head kept as 8-bit groups for the native head kernel) and ``dual`` (that,
and every other linear layer also as the kernel's codes for products of up to
``kernel_max_rows`` rows). For each batch size ``B`` an engine per model (``build_engine``
defaults, prefix caching off) takes ``B`` prompts of 128 random tokens; once each has its
first token, the engines' decode steps alternate (order reversed every round, in one
process) and the median step is reported, with the tokens compared against
``dequantize``'s and the weights' bytes (parameters plus the kernel's codes):

    uv run python -m tools.bench_gguf_weights --markdown docs/results/bench_gguf_weights.md
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from tools.cli_args import ArgumentParser, add_run_options, positive_int
from tools.harness import Report, quantile

__all__ = ["main"]

CHOICES = ("dequantize", "embedding", "dual")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_gguf_weights``."""
    parser = ArgumentParser(prog="python -m tools.bench_gguf_weights", description=__doc__)
    parser.add_argument(
        "--batch",
        nargs="+",
        type=positive_int(64),
        default=[1, 4, 8, 16],
        help="requests decoding at once (default 1 4 8 16)",
    )
    parser.add_argument(
        "--choices", nargs="+", choices=CHOICES, default=list(CHOICES), help="weights compared"
    )
    parser.add_argument("--prompt", type=positive_int(4096), default=128, help="prompt tokens")
    add_run_options(parser, quick="B = 1 and 4, 6 steps", rounds=30)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch, args.rounds = [1, 4], 6
    results = Report("Gemma 3 270M's decode step by GGUF weight choice")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_gguf_weights", argv=argv)
    return 0


def _weight_mib(model: Any) -> float:
    """The bytes the model holds: its resident parameters and its kernel layers' codes.

    A kernel layer's float32 weight that ``load_model`` left unevaluated (the kernel takes
    every float32 row: ``kv_serve._load.resident_parameters``) is not held.
    """
    from kv_serve._kernel_linears import KernelLinear
    from kv_serve._load import resident_parameters

    total = int(sum(v.nbytes for v in resident_parameters(model)))
    total += sum(m.codes_nbytes for _, m in model.named_modules() if isinstance(m, KernelLinear))
    return total / 2**20


def _run(args: argparse.Namespace) -> None:
    from kv_metal_kernels import CpuQuantizedHead
    from kv_serve import active_blas, build_engine, load_model

    print(f"BLAS: {active_blas().describe()}")
    print(f"native kernel: {CpuQuantizedHead().library.describe()}")
    choices = list(dict.fromkeys(["dequantize", *args.choices]))
    models = {c: load_model("gemma3-270m", gguf_weights=c)[0] for c in choices}
    print()
    print(
        f"{args.prompt}-token random prompts; median of {args.rounds} alternating decode steps, "
        "ms (tok/s = B / step)\n"
    )
    print("| B | " + " | ".join(f"{c} ms (tok/s)" for c in choices) + " | tokens |")
    print("|---|" + "---|" * (len(choices) + 1))
    rng = random.Random(0)
    for batch in args.batch:
        prompts = [[rng.randrange(2, 262144) for _ in range(args.prompt)] for _ in range(batch)]
        engines = {
            c: build_engine(
                m,
                max_running=batch,
                max_context=args.prompt + args.rounds + 8,
                prefix_caching=False,
            )
            for c, m in models.items()
        }
        try:
            ids = {c: [e.submit(p, args.rounds + 4) for p in prompts] for c, e in engines.items()}
            for c, e in engines.items():
                while not all(e.output(i).tokens for i in ids[c]):
                    e.step()
            times: dict[str, list[float]] = {c: [] for c in engines}
            for r in range(args.rounds):
                for c in choices if r % 2 == 0 else choices[::-1]:
                    tic = time.perf_counter()
                    engines[c].step()
                    times[c].append((time.perf_counter() - tic) * 1e3)
            tokens = {c: [e.output(i).tokens for i in ids[c]] for c, e in engines.items()}
        finally:
            for e in engines.values():
                e.close()
        same = all(t == tokens["dequantize"] for t in tokens.values())
        cells = []
        for c in choices:
            step = quantile(times[c], 0.5)
            cells.append(f"{step:.1f} ({batch * 1e3 / step:.1f})")
        print(f"| {batch} | " + " | ".join(cells) + f" | {'same' if same else 'DIFFER'} |")
    print()
    print(
        "Weights (parameters and the kernel's codes): "
        + ", ".join(f"{c} {_weight_mib(m):.0f} MiB" for c, m in models.items())
    )


if __name__ == "__main__":
    sys.exit(main())
