"""Benchmark: load time and ``kv_serve.generate`` speed on a real model, one prompt at a time.

Loads the model twice (into a fresh cache directory, so the first load converts the GGUF,
then from that cache), and streams a short and a long prompt of :mod:`tools.real_prompts`
through :func:`kv_serve.generate`, greedy. Reported: load seconds, prefill tok/s (prompt
tokens per second to the first token) and decode tok/s (after the first token), and the
BLAS in use. Run it once with ``KV_SERVE_BLAS=off`` to see MLX's reference BLAS:

    uv run python -m tools.bench_generate
    KV_SERVE_BLAS=off uv run python -m tools.bench_generate
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence

from kv_serve import GenerationStats, active_blas, generate, load_model
from tools.cli_args import (
    MAX_TOKENS,
    ArgumentParser,
    add_run_options,
    add_trained_model_options,
    positive_int,
)
from tools.harness import Report
from tools.real_prompts import REAL_PROMPTS

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_generate``."""
    parser = ArgumentParser(prog="python -m tools.bench_generate", description=__doc__)
    add_trained_model_options(
        parser, default="gemma3-270m", help="gemma3-270m (default) or a Gemma 3 .gguf file"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int(MAX_TOKENS),
        default=64,
        help="tokens generated per prompt (default 64)",
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        choices=sorted(REAL_PROMPTS),
        default=["capital", "notes_six"],
        help="which real prompts (default: capital notes_six)",
    )
    add_run_options(parser, quick=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    results = Report("Load time and generate() speed on a real model")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_generate", argv=argv)
    return 0


def _run(args: argparse.Namespace) -> None:
    print(f"BLAS: {active_blas().describe()}")
    with tempfile.TemporaryDirectory() as cache:
        loads = []
        for _ in range(2):
            tic = time.perf_counter()
            model, tokenizer = load_model(args.model, cache_dir=cache)
            loads.append(time.perf_counter() - tic)
    print(f"load: first (converts) {loads[0]:.1f} s, cached {loads[1]:.1f} s")
    # One throwaway token so that first-call setup is not charged to the first prompt.
    "".join(generate(model, tokenizer, "Hello", max_tokens=2))
    for name in args.prompts:
        stats = GenerationStats()
        text = "".join(
            generate(model, tokenizer, REAL_PROMPTS[name], max_tokens=args.max_tokens, stats=stats)
        )
        print(
            f"{name}: prompt {stats.prompt_tokens} tokens, prefill "
            f"{stats.prefill_tokens_per_s:.1f} tok/s ({stats.first_token_seconds:.2f} s to the "
            f"first token); {stats.generated_tokens} generated, decode "
            f"{stats.decode_tokens_per_s:.1f} tok/s; {' '.join(text.split())[:60]!r}"
        )


if __name__ == "__main__":
    sys.exit(main())
