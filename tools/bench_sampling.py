"""Benchmark: what the full sampling pipeline costs a decoding batch.

The same workload decodes twice per round, alternating: greedy, and with every field of the
pipeline on for every request (temperature 0.8, ``top_k`` 40, ``top_p`` 0.95, ``min_p``
0.05, presence 0.5, frequency 0.3 and repetition 1.1 penalties, a logit bias, and
``logprobs=5``). Reported: decode tokens per second of decode time (the engine's own
split of host and device time) and the ratio. Then where the cost goes: the sampler alone
on random logits of the model's vocabulary at the batch size, per step, greedy against each
part switched on in turn.

    uv run python -m tools.bench_sampling
    uv run python -m tools.bench_sampling --model gemma3-270m --requests 16 --max-out 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kv_batching import SamplingParams, vocabulary_size
from kv_batching._sampling import Sampler, SamplingRow
from kv_serve import active_blas, build_engine, encode_prompt, load_model
from tools.cli_args import (
    ArgumentParser,
    add_engine_options,
    add_model_options,
    add_run_options,
    add_trained_model_options,
    add_workload_options,
)
from tools.harness import Report, build_model, quantile, workload
from tools.real_prompts import real_prompts

__all__ = ["FULL", "main"]

#: Every field of the pipeline on.
FULL = SamplingParams(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    logit_bias={1: -2.0, 2: 1.5},
    seed=None,
    logprobs=5,
)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_sampling``."""
    parser = ArgumentParser(prog="python -m tools.bench_sampling", description=__doc__)
    add_trained_model_options(
        parser, default=None, help="gemma3-270m or a model directory (default: random model)"
    )
    add_model_options(parser, layers=4, window=128, sizes=True)
    add_workload_options(parser, requests=16, min_prompt=64, max_prompt=256, min_out=64, max_out=64)
    add_engine_options(parser, running=16, chunk=512)
    add_run_options(parser, quick="8 requests of 16 tokens, one round", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    results = Report("The sampling pipeline's cost")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_sampling", argv=argv)
    return 0


def _model_and_work(args: argparse.Namespace) -> tuple[Any, list[tuple[list[int], int]], str]:
    if args.quick:
        args.requests, args.min_out, args.max_out, args.rounds = 8, 16, 16, 1
    if args.model is None:
        vocab = 4096
        model = build_model(
            num_layers=args.layers,
            window=args.window,
            vocab=vocab,
            hidden=args.hidden,
            experts=args.experts,
        )
        work = workload(
            args.requests,
            min_prompt=args.min_prompt,
            max_prompt=args.max_prompt,
            min_out=args.min_out,
            max_out=args.max_out,
            vocab=vocab,
            seed=args.seed,
        )
        name = f"random gpt_oss-like, {args.layers} layers, vocabulary {vocab}"
        return model, work, name
    model, tokenizer = load_model(args.model)
    texts = [text for _, text in real_prompts()]
    prompts = [encode_prompt(tokenizer, texts[i % len(texts)]) for i in range(args.requests)]
    work = [(p, args.max_out) for p in prompts]
    return model, work, str(args.model)


def _decode_rate(model: Any, work: list[tuple[list[int], int]], args: Any, full: bool) -> float:
    engine = build_engine(
        model,
        max_running=args.running,
        prefill_chunk=args.chunk,
        max_context=max(len(p) + n for p, n in work) + 1,
        record_pages=False,
        prefix_caching=False,
    )
    try:
        for i, (prompt, n) in enumerate(work):
            sampling = SamplingParams(**{**_fields(FULL), "seed": i}) if full else SamplingParams()
            engine.submit(prompt, n, sampling=sampling)
        engine.run()
        stats = engine.stats
        return stats.decode_tokens / stats.decode_seconds
    finally:
        engine.close()


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def _sampler_ms(vocab: int, batch: int, params: SamplingParams, reps: int = 20) -> float:
    """Median milliseconds of one batch's sampling (evaluated) on random logits."""
    sampler = Sampler(0)
    history = list(range(0, vocab, max(1, vocab // 200)))[:200]
    rows = [
        SamplingRow(
            params=params,
            generated=len(history),
            prompt=history,
            output=history[:64],
            stop_tokens=(0,),
        )
        for _ in range(batch)
    ]
    logits = mx.random.normal((batch, vocab))
    mx.eval(logits)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(sampler.sample(logits, rows).arrays())
        times.append(1000 * (time.perf_counter() - tic))
    return quantile(times[2:], 0.5)


def _run(args: argparse.Namespace) -> None:
    model, work, name = _model_and_work(args)
    print(f"model: {name}; BLAS: {active_blas().describe()}")
    print(
        f"workload: {len(work)} requests, prompts {min(len(p) for p, _ in work)}.."
        f"{max(len(p) for p, _ in work)} tokens, {work[0][1]} out each, at most "
        f"{args.running} decoding"
    )
    rates: dict[str, list[float]] = {"greedy": [], "full pipeline": []}
    for _ in range(args.rounds):
        for label, full in (("greedy", False), ("full pipeline", True)):
            rates[label].append(_decode_rate(model, work, args, full))
    greedy = statistics.mean(rates["greedy"])
    piped = statistics.mean(rates["full pipeline"])
    print("\n| sampling | decode tok/s (mean of rounds) | rounds |")
    print("|---|---|---|")
    for label, values in rates.items():
        print(
            f"| {label} | {statistics.mean(values):.1f} | {' '.join(f'{v:.1f}' for v in values)} |"
        )
    print(f"\nfull pipeline / greedy: {piped / greedy:.3f}x decode throughput")
    vocab = vocabulary_size(model) or 0
    batch = min(args.running, len(work))
    parts = {
        "greedy": SamplingParams(),
        "logprobs=5": SamplingParams(logprobs=5),
        "penalties + bias": SamplingParams(
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            logit_bias={1: -2.0},
        ),
        "temperature": SamplingParams(temperature=0.8),
        "temperature + top_k 40": SamplingParams(temperature=0.8, top_k=40),
        "temperature + top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "temperature + min_p": SamplingParams(temperature=0.8, min_p=0.05),
        "everything (seeded rows)": SamplingParams(**{**_fields(FULL), "seed": 7}),
        "everything (engine stream)": FULL,
    }
    print(f"\nThe sampler alone, B={batch}, vocabulary {vocab}, median ms per step:\n")
    print("| rows ask for | ms | p90 ms |")
    print("|---|---|---|")
    for label, params in parts.items():
        samples = [_sampler_ms(vocab, batch, params, reps=8) for _ in range(3)]
        print(f"| {label} | {quantile(samples, 0.5):.2f} | {quantile(samples, 0.9):.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
