"""Benchmark: speculative decoding by prompt lookup against plain decoding, on a real model.

Two workloads of greedy requests on Gemma 3 270M (a base model, so the prompts are completions):
``rewrite`` (a passage, then "the same text, copied word for word" and its first words: the
output repeats the prompt, which n-gram proposals predict) and ``open`` (the opening of a story
or an essay: open-ended text). Each batch size runs the plain engine, the engine with
``speculative="ngram"`` (its default switch: beside other requests a request verifies its
proposals, as extra rows of the shared decode step, only while at least ``min_acceptance``
of its proposed tokens are accepted) and, above batch 1, the same with every proposal
verified (``min_acceptance=0``, no shadowing: to show where it stops paying); at batch 1,
mlx-lm's own greedy decoding too (``kv_testing.mlx_lm_greedy``: mlx-lm's model on its own
caches; mlx-lm has speculative decoding only with a draft model, and none batched). All in
one process, same BLAS, modes alternating within each round; reported: the median over
rounds of generated tokens per second (wall time from submission to the last token, prefill
included) and of the generation phase alone (tokens of the decode steps per second of
decode-step time, verifications included: the prompts' prefill is the same in every mode),
the speedups over plain, the acceptance rate, and whether every request's tokens equal plain
decoding's.

    uv run python -m tools.bench_spec
    uv run python -m tools.bench_spec --batch 1 2 4 16 --markdown docs/results/bench_spec.md
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_batching import NgramProposer, SpeculationConfig
from kv_serve import (
    NGRAM_SPECULATIVE_TOKENS,
    active_blas,
    build_engine,
    encode_prompt,
    load_model,
    stop_token_ids,
)
from tools.anchor import anchor_model
from tools.cli_args import ArgumentParser, add_run_options
from tools.harness import Report, quantile
from tools.real_prompts import PASSAGES

__all__ = ["OPENINGS", "main", "workload"]

#: Open-ended openings (the ``open`` workload), one per request (cycled).
OPENINGS = (
    "Once upon a time, in a small village by the mountains,",
    "The most important invention of the last hundred years is",
    "When I was a child, my grandmother used to tell me",
    "There are three reasons why cities should plant more trees. First,",
    "The history of the bicycle begins in",
    "On the morning of the storm, the harbour was",
    "A good teacher is someone who",
    "The first thing you notice when you walk into the old library is",
)


def workload(tokenizer: Any, name: str, n: int) -> list[list[int]]:
    """``n`` prompts of workload ``name`` (``rewrite`` or ``open``), cycling their sources."""
    prompts = []
    for i in range(n):
        if name == "rewrite":
            passage = PASSAGES[i % len(PASSAGES)]
            head = " ".join(passage.split()[:3])
            text = f"Text: {passage}\n\nThe same text, copied word for word:\n\nText: {head}"
        else:
            text = OPENINGS[i % len(OPENINGS)]
        prompts.append(encode_prompt(tokenizer, text))
    return prompts


@dataclass
class Run:
    """One mode's run of one batch: its tokens, wall time and speculation counters."""

    tokens: list[list[int]]
    seconds: float
    proposed: int = 0
    accepted: int = 0
    #: The engine's time in decode steps (verifications included); ``None`` for mlx-lm.
    decode_seconds: float | None = None
    #: Tokens the decode steps produced (each prompt's first token comes from its prefill).
    decode_tokens: int = 0

    @property
    def rate(self) -> float:
        """Generated tokens per second of wall time."""
        return sum(len(t) for t in self.tokens) / self.seconds

    @property
    def decode_rate(self) -> float | None:
        """Tokens of the decode steps per second of decode-step time (the generation phase)."""
        if not self.decode_seconds:
            return None
        return self.decode_tokens / self.decode_seconds


def run_engine(
    model: Any,
    prompts: list[list[int]],
    max_out: int,
    stops: set[int],
    speculation: SpeculationConfig | None,
) -> Run:
    """All ``prompts`` submitted at once to a fresh engine, run to the end."""
    with build_engine(
        model,
        max_running=len(prompts),
        max_context=1024,
        prefix_caching=False,
        speculative=speculation,
    ) as engine:
        start = time.perf_counter()
        ids = [engine.submit(p, max_out, stop_tokens=stops) for p in prompts]
        out = engine.run()
        seconds = time.perf_counter() - start
        stats = engine.stats
        tokens = [out[i] for i in ids]
        return Run(
            tokens,
            seconds,
            stats.speculative_proposed,
            stats.speculative_accepted,
            decode_seconds=stats.decode_seconds,
            decode_tokens=sum(len(t) for t in tokens) - len(tokens),
        )


def run_mlx_lm(model: Any, prompts: list[list[int]], max_out: int, stops: set[int]) -> Run:
    """mlx-lm's own greedy decoding on its caches, one prompt after the other.

    ``kv_testing.mlx_lm_greedy`` (mlx-lm's model on mlx-lm's caches, one token a forward,
    stopping at a stop token).
    """
    from kv_testing import mlx_lm_greedy

    tokens: list[list[int]] = []
    start = time.perf_counter()
    for prompt in prompts:
        tokens.append(list(mlx_lm_greedy(model, prompt, max_out, stop_tokens=stops)))
    return Run(tokens, time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_spec``."""
    parser = ArgumentParser(prog="python -m tools.bench_spec", description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="the model (gemma3-270m)")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[1, 4, 16], help="batch sizes (1 4 16)"
    )
    parser.add_argument("--max-out", type=int, default=64, help="tokens per request (64)")
    parser.add_argument(
        "--tokens",
        type=int,
        default=NGRAM_SPECULATIVE_TOKENS,
        help=f"the longest proposal, 1..16 ({NGRAM_SPECULATIVE_TOKENS}, build_engine's default)",
    )
    parser.add_argument(
        "--workload", nargs="+", choices=("rewrite", "open"), default=["rewrite", "open"]
    )
    add_run_options(parser, quick="batch 1 and 4, 32 tokens, one round", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batch, args.max_out, args.rounds = [1, 4], 32, 1
    results = Report("Speculative decoding (prompt lookup)")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_spec", argv=argv)
    return 0


def _run(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.model)
    anchor = anchor_model(model, args.model)
    stops = stop_token_ids(tokenizer)
    default = SpeculationConfig(proposer=NgramProposer(), num_tokens=args.tokens)
    print(f"BLAS: {active_blas().describe()}; model {args.model}, greedy, {args.max_out} tokens")
    print()
    print(
        "| workload | batch | mode | tok/s | vs plain | generation tok/s | vs plain | "
        "accepted / proposed | same tokens |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for name in args.workload:
        for batch in args.batch:
            prompts = workload(tokenizer, name, batch)
            modes: dict[str, Any] = {"plain": None, "ngram": default}
            if batch > 1:
                modes["ngram, every proposal verified"] = SpeculationConfig(
                    proposer=NgramProposer(),
                    num_tokens=args.tokens,
                    max_batch=batch,
                    min_acceptance=0.0,
                    shadow=False,
                    compare_rates=False,
                )
            if batch == 1:
                modes["mlx-lm greedy"] = "mlx-lm"
            runs: dict[str, list[Run]] = {mode: [] for mode in modes}
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    config = modes[mode]
                    if config == "mlx-lm":
                        runs[mode].append(run_mlx_lm(anchor, prompts, args.max_out, stops))
                    else:
                        runs[mode].append(run_engine(model, prompts, args.max_out, stops, config))
            plain_rate = quantile([run.rate for run in runs["plain"]], 0.5)
            plain_decode = quantile([run.decode_rate or 0.0 for run in runs["plain"]], 0.5)
            reference = runs["plain"][0].tokens
            for mode, done in runs.items():
                rate = quantile([run.rate for run in done], 0.5)
                proposed = sum(run.proposed for run in done)
                accepted = sum(run.accepted for run in done)
                share = f"{accepted} / {proposed}" if proposed else "-"
                same = all(run.tokens == reference for run in done)
                decode = [run.decode_rate for run in done if run.decode_rate is not None]
                generation = "- | -"
                if decode and plain_decode:
                    phase = quantile(decode, 0.5)
                    generation = f"{phase:.1f} | {phase / plain_decode:.2f}x"
                print(
                    f"| {name} | {batch} | {mode} | {rate:.1f} | {rate / plain_rate:.2f}x | "
                    f"{generation} | {share} | {'yes' if same else 'NO'} |"
                )


if __name__ == "__main__":
    raise SystemExit(main())
