"""Benchmark: what structured output (a JSON schema per request) costs a decoding batch.

The same workload decodes twice per round, alternating: every request free (greedy), and
every request under a JSON schema (greedy, each its own llguidance matcher, compiled once
before the rounds). The schema asks for a long array of small objects and every request runs
to ``max_tokens`` either way, so both runs decode the same number of tokens in the same
batches. Reported (the median of the rounds): decode tokens per second of decode time and
end-to-end tokens per second (the engine's own measures), their ratios, and per decode step
the host's time filling the masks (which overlaps the device's forward: the logits'
evaluation starts first) against the step's time and the device's wait. Every constrained
output is checked to be a valid prefix of the schema's language by the grammar itself (its
matcher accepted every token).

    uv run python -m tools.bench_structured
    uv run python -m tools.bench_structured --model gemma3-270m --requests 16 --max-out 32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_batching import SamplingParams, vocabulary_size
from kv_serve import active_blas, build_engine, encode_prompt, load_model, stop_token_ids
from kv_serve._structured import GrammarCompiler
from tools.cli_args import (
    ArgumentParser,
    add_engine_options,
    add_model_options,
    add_run_options,
    add_trained_model_options,
    add_workload_options,
)
from tools.harness import Report, build_model, quantile
from tools.real_prompts import real_prompts

__all__ = ["SCHEMA", "main"]

#: Long, so that no request finishes before ``max_tokens``: at least 64 small records.
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_structured``."""
    parser = ArgumentParser(prog="python -m tools.bench_structured", description=__doc__)
    add_trained_model_options(
        parser,
        default=None,
        help="gemma3-270m or a model directory (default: random model, tiny tokenizer)",
    )
    add_model_options(parser, layers=4, window=128, sizes=True)
    add_workload_options(parser, requests=16, max_out=64, seed=False)
    add_engine_options(parser, running=16, chunk=512)
    add_run_options(parser, quick="8 requests of 16 tokens, one round", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    results = Report("Structured output's cost")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_structured", argv=argv)
    return 0


def _model_and_work(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]], str]:
    if args.quick:
        args.requests, args.max_out, args.rounds = 8, 16, 1
    texts = [text for _, text in real_prompts()]
    if args.model is None:
        from kv_testing import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        vocab = len(tokenizer)
        model = build_model(
            num_layers=args.layers,
            window=args.window,
            vocab=vocab,
            hidden=args.hidden,
            experts=args.experts,
        )
        name = f"random gpt_oss-like, {args.layers} layers, tiny BPE tokenizer ({vocab} tokens)"
    else:
        model, tokenizer = load_model(args.model)
        name = str(args.model)
    prompts = [encode_prompt(tokenizer, texts[i % len(texts)]) for i in range(args.requests)]
    return model, tokenizer, prompts, name


@dataclass
class _Run:
    decode_rate: float
    total_rate: float
    step_ms: float
    device_ms: float
    mask_row_us: float


def _decode(model: Any, prompts: list[list[int]], args: Any, make: Any) -> _Run:
    engine = build_engine(
        model,
        max_running=args.running,
        prefill_chunk=args.chunk,
        max_context=max(len(p) for p in prompts) + args.max_out + 1,
        record_pages=False,
        prefix_caching=False,
    )
    try:
        for prompt in prompts:
            # No stop tokens: every request runs to max_tokens (the schema is long enough).
            engine.submit(prompt, args.max_out, sampling=SamplingParams(constraint=make))
        tic = time.perf_counter()
        engine.run()
        elapsed = time.perf_counter() - tic
        for rid in range(len(prompts)):
            out = engine.output(rid)
            if out.finish_reason != "length" or len(out.tokens) != args.max_out:
                raise RuntimeError(f"request {rid} ended early: {out.finish_reason}")
        stats = engine.stats
        steps = max(1, stats.decode_steps)
        return _Run(
            decode_rate=stats.decode_tokens / stats.decode_seconds,
            total_rate=(stats.decode_tokens + len(prompts)) / elapsed,
            step_ms=quantile(list(stats.decode_step_seconds), 0.5) * 1000,
            device_ms=1000 * stats.decode_device_seconds / steps,
            mask_row_us=1e6 * stats.mask_seconds / max(1, stats.masks_filled),
        )
    finally:
        engine.close()


def _run(args: argparse.Namespace) -> None:
    model, tokenizer, prompts, name = _model_and_work(args)
    print(f"model: {name}; BLAS: {active_blas().describe()}")
    print(
        f"workload: {len(prompts)} requests, prompts {min(len(p) for p in prompts)}.."
        f"{max(len(p) for p in prompts)} tokens, {args.max_out} out each, at most "
        f"{args.running} decoding; schema: an array of at least 64 small objects"
    )
    vocab = vocabulary_size(model) or 0
    tic = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, stop_token_ids(tokenizer))
    wrap = time.perf_counter() - tic
    tic = time.perf_counter()
    make = compiler.json_schema(SCHEMA)
    compile_s = time.perf_counter() - tic
    print(
        f"llguidance: tokenizer view of {vocab} tokens {wrap * 1000:.0f} ms (once per server), "
        f"schema compiled in {compile_s * 1000:.1f} ms (once per request)"
    )
    runs: dict[str, list[_Run]] = {"free (greedy)": [], "JSON schema (greedy)": []}
    for _ in range(args.rounds):
        runs["free (greedy)"].append(_decode(model, prompts, args, None))
        runs["JSON schema (greedy)"].append(_decode(model, prompts, args, make))
    print(
        "\n| requests (median of rounds) | decode tok/s | end-to-end tok/s | decode step p50 ms "
        "| device wait ms / step | host mask us / row | decode tok/s by round |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, values in runs.items():
        print(
            f"| {label} | {quantile([r.decode_rate for r in values], 0.5):.1f} "
            f"| {quantile([r.total_rate for r in values], 0.5):.1f} "
            f"| {quantile([r.step_ms for r in values], 0.5):.2f} "
            f"| {quantile([r.device_ms for r in values], 0.5):.2f} "
            f"| {quantile([r.mask_row_us for r in values], 0.5):.0f} "
            f"| {' '.join(f'{r.decode_rate:.1f}' for r in values)} |"
        )
    free = runs["free (greedy)"]
    constrained = runs["JSON schema (greedy)"]
    decode = quantile([r.decode_rate for r in constrained], 0.5) / quantile(
        [r.decode_rate for r in free], 0.5
    )
    total = quantile([r.total_rate for r in constrained], 0.5) / quantile(
        [r.total_rate for r in free], 0.5
    )
    rows = min(args.running, len(prompts))
    mask = quantile([r.mask_row_us for r in constrained], 0.5) * rows / 1000
    forward = quantile([r.step_ms for r in free], 0.5)
    print(
        f"\nJSON schema / free: {decode:.3f}x decode throughput, {total:.3f}x end to end "
        f"(cost {100 * (1 - decode):.1f}% of decode throughput; goal <= 15%)"
    )
    print(
        f"host mask time per step of {rows} rows: {mask:.2f} ms, {100 * mask / forward:.1f}% "
        f"of a free decode step (p50 {forward:.2f} ms), and overlapped with the forward"
    )


if __name__ == "__main__":
    raise SystemExit(main())
