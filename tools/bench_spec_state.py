"""Benchmark: speculative verification on a recurrent-state hybrid, in the shared step or not.

There is no real state-hybrid checkpoint on this machine, so the model is one with a
published geometry (:data:`GEOMETRIES`: LFM2-350M, 10 short-convolution and 6 attention
layers, 1024 wide, a 65536-token vocabulary) and mlx-lm's own initial weights. The proposals
are what the model itself would decode (mlx-lm generating each prompt alone, computed first),
right for their first ``--right`` tokens and wrong after, so the acceptance is set, not
hoped for. Modes, in one process, alternating within each round: ``plain`` (no speculation),
``a forward per request`` (each verification a forward of its own, what a state hybrid got
before its mixers ran a step's rows: ``max_batch`` raised to the batch) and ``shared step``
(every proposal a set of rows of the one batched decode forward, the recurrent mixers running
each request's rows in order). Reported: the median over rounds of generated tokens per
second of wall time (prefill included) and of the generation phase, and whether every
request's tokens equal plain decoding's.

    uv run python -m tools.bench_spec_state
    uv run python -m tools.bench_spec_state --batch 1 4 16 --markdown docs/results/bench_spec.md
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_batching import SpeculationConfig
from kv_batching._ragged_state import RaggedStateMixers
from kv_serve import active_blas, build_engine
from kv_testing import mlx_lm_greedy
from tools.cli_args import ArgumentParser, add_run_options
from tools.harness import Report, quantile

__all__ = ["GEOMETRIES", "main"]

#: Published geometries of state hybrids (mlx-lm ``ModelArgs``).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "lfm2-350m": {
        "model_type": "lfm2",
        "vocab_size": 65536,
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 128000,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 1024,
        "block_ff_dim": 6656,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
        "tie_embedding": True,
    },
}


def build_model(name: str) -> nn.Module:
    """The geometry's model with mlx-lm's initial weights (seeded), evaluated."""
    config = GEOMETRIES[name]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


class TruthProposer:
    """Proposes the model's own continuation, right for ``right`` tokens and wrong after."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], right: int, vocab: int) -> None:
        self.truth = truth
        self.right = right
        self.vocab = vocab

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens after ``tokens`` (a prompt and what was decoded after it)."""
        for prompt, continuation in self.truth.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                guess = continuation[done : done + k]
                return [t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(guess)]
        return []


def run(
    model: nn.Module,
    prompts: list[list[int]],
    max_out: int,
    speculation: SpeculationConfig | None,
    shared: bool,
) -> tuple[list[list[int]], float, float, int]:
    """Tokens, wall seconds, decode-step seconds and speculative steps of one engine run."""
    with build_engine(
        model,
        max_running=len(prompts),
        max_context=512,
        prefix_caching=False,
        speculative=speculation,
    ) as engine:
        runner = engine._core.runner
        if speculation is not None and not shared:
            runner.surgery.uninstall(RaggedStateMixers)
        start = time.perf_counter()
        ids = [engine.submit(p, max_out) for p in prompts]
        out = engine.run()
        seconds = time.perf_counter() - start
        stats = engine.stats
        return [out[i] for i in ids], seconds, stats.decode_seconds, stats.speculative_steps


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_spec_state``."""
    parser = ArgumentParser(prog="python -m tools.bench_spec_state", description=__doc__)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="lfm2-350m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-out", type=int, default=32, help="tokens per request (32)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (64)")
    parser.add_argument("--tokens", type=int, default=4, help="proposal length (4)")
    parser.add_argument(
        "--right", type=int, nargs="+", default=[4, 2], help="right tokens per proposal (4 2)"
    )
    add_run_options(parser, quick="batch 1 and 4, 16 tokens, one round", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch, args.max_out, args.rounds = [1, 4], 16, 1
    results = Report("Speculative verification on a state hybrid")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_spec_state", argv=argv)
    return 0


def _run(args: argparse.Namespace) -> None:
    model = build_model(args.geometry)
    vocab = int(GEOMETRIES[args.geometry]["vocab_size"])
    print(
        f"BLAS: {active_blas().describe()}; {args.geometry} geometry, mlx-lm's initial "
        f"weights, fp32, greedy; prompts of {args.prompt} tokens, {args.max_out} out"
    )
    print()
    print(
        "| right / proposed | batch | mode | tok/s | vs plain | generation tok/s | vs plain | "
        "speculative steps | same tokens |\n|---|---|---|---|---|---|---|---|---|"
    )
    for batch in args.batch:
        prompts = [
            [(37 * j + 11 * b + 5) % vocab for j in range(args.prompt)] for b in range(batch)
        ]
        truth = {
            tuple(p): list(mlx_lm_greedy(model, p, args.max_out + args.tokens)) for p in prompts
        }
        for right in args.right:
            proposer = TruthProposer(truth, right, vocab)
            config = SpeculationConfig(
                proposer=proposer,
                num_tokens=args.tokens,
                max_batch=batch,
                shadow=False,
                compare_rates=False,
                cooldown=0,
            )
            modes: dict[str, tuple[SpeculationConfig | None, bool]] = {
                "plain": (None, False),
                "a forward per request": (config, False),
                "shared step": (config, True),
            }
            done: dict[str, list[tuple[list[list[int]], float, float, int]]] = {
                m: [] for m in modes
            }
            for r in range(args.rounds):
                for mode in modes if r % 2 == 0 else reversed(list(modes)):
                    speculation, shared = modes[mode]
                    done[mode].append(run(model, prompts, args.max_out, speculation, shared))
            total = batch * args.max_out
            reference = done["plain"][0][0]
            plain_rate = quantile([total / d[1] for d in done["plain"]], 0.5)
            plain_decode = quantile([(total - batch) / d[2] for d in done["plain"]], 0.5)
            for mode, runs in done.items():
                rate = quantile([total / d[1] for d in runs], 0.5)
                decode = quantile([(total - batch) / d[2] for d in runs], 0.5)
                same = all(d[0] == reference for d in runs) and all(
                    d[0][i] == truth[tuple(p)][: args.max_out]
                    for d in runs
                    for i, p in enumerate(prompts)
                )
                print(
                    f"| {right} / {args.tokens} | {batch} | {mode} | {rate:.1f} | "
                    f"{rate / plain_rate:.2f}x | {decode:.1f} | {decode / plain_decode:.2f}x | "
                    f"{runs[0][3]} | {'yes' if same else 'NO'} |"
                )


if __name__ == "__main__":
    raise SystemExit(main())
