"""Benchmark: prefix caching, the engine with and without it against mlx-lm, in one process.

Two workloads, greedy, on tiny models with random fp32 weights: a gpt-oss-like (alternating
sliding-window / full layers, sinks) and a Gemma-3-like (five sliding layers per full one)
attention model, and three recurrent-state hybrids: Qwen3-Next-like (gated delta-net linear
attention, one full layer in two), LFM2-like (short convolutions, one full layer in two) and
Nemotron-H-like (Mamba-2 with a full attention layer and an MLP per two of them), whose
prefix hits resume from recurrent-state snapshots:

1. ``shared``: 32 requests sharing a 2048-token system prompt, each with its own 64-token
   question, all submitted at once;
2. ``chat``: 8 conversations of 8 turns; each turn's prompt is the previous prompt, its answer
   and a new 32-token message, the 8 conversations' turn ``t`` submitted together.

Each system runs the workload alone, in alternating order over ``--rounds``: the engine with
prefix caching, without it, and mlx-lm's ``BatchGenerator`` with its ``LRUPromptCache`` used
the way ``mlx_lm.server`` uses it (nearest cached prefix fetched before insert, caches stored
when a request finishes). Reported: time to first token (p50, from submission), total time,
the engine's reused prompt tokens, the recurrent-state snapshots it holds at the end (count
and bytes), and whether the greedy tokens agree.

    uv run python -m tools.bench_prefix            # both workloads, the attention models
    uv run python -m tools.bench_prefix --model state   # the three state hybrids
    uv run python -m tools.bench_prefix --quick    # small sizes, under a minute
    uv run python -m tools.bench_prefix --quick --model gemma3-270m   # the trained model
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kv_serve import active_blas, build_engine
from kv_testing import build_tiny_model
from tools.cli_args import ArgumentParser, add_run_options, add_workload_options, positive_int
from tools.harness import MlxLmBatch, Report, quantile

VOCAB = 256


@dataclass(frozen=True)
class Shape:
    """Sizes of the two workloads."""

    system: int = 2048
    questions: int = 32
    question: int = 64
    conversations: int = 8
    turns: int = 8
    message: int = 32


@dataclass
class Run:
    """What one system did on one workload."""

    name: str
    seconds: float
    ttft: list[float]
    tokens: list[list[int]]
    hit_tokens: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0

    @property
    def ttft_p50_ms(self) -> float:
        """Median time to first token in milliseconds."""
        return 1000 * quantile(self.ttft, 0.5)


#: The recurrent-state hybrids: (zoo architecture, settings over the zoo's tiny config).
STATE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-next-like": (
        "qwen3_next",
        {
            "num_hidden_layers": 8,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
    ),
    "lfm2-like": (
        "lfm2",
        {
            "num_hidden_layers": 8,
            "block_dim": 128,
            "block_ff_dim": 256,
            "layer_types": ["conv", "full_attention"] * 4,
        },
    ),
    "nemotron-h-like": (
        "nemotron_h",
        {
            "num_hidden_layers": 8,
            "hybrid_override_pattern": ["M", "*", "M", "-"] * 2,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
        },
    ),
}


def build_state_models() -> dict[str, Any]:
    """The three recurrent-state hybrids (hidden 128, 8 heads of 32, 8 layers, vocab 256)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_map

    from kv_testing import ZOO, zoo_config

    models = {}
    for name, (arch, settings) in STATE_MODELS.items():
        config = zoo_config(arch)
        config.update(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=VOCAB,
            **settings,
        )
        module = importlib.import_module(f"mlx_lm.models.{ZOO[arch].module}")
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(config))
        model.update(
            tree_map(
                lambda p: (
                    mx.random.normal(p.shape) * 0.2 if mx.issubdtype(p.dtype, mx.floating) else p
                ),
                model.parameters(),
            )
        )
        mx.eval(model.parameters())
        models[name] = model
    return models


def build_models() -> dict[str, Any]:
    """The gpt-oss-like and the Gemma-3-like model (window 128)."""
    common: dict[str, Any] = {
        "hidden_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    return {
        "gpt-oss-like": build_tiny_model(
            "gpt_oss",
            window=128,
            num_layers=8,
            vocab_size=VOCAB,
            head_dim=64,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            **common,
        ),
        "gemma3-like": build_tiny_model(
            "gemma3_text",
            window=128,
            num_layers=6,
            vocab_size=VOCAB,
            head_dim=64,
            intermediate_size=128,
            **common,
        ),
    }


def shared_prompts(shape: Shape, seed: int) -> list[list[int]]:
    """``questions`` prompts: one system prompt, then each request's own question."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(shape.system)]
    return [
        system + [rng.randrange(VOCAB) for _ in range(shape.question)]
        for _ in range(shape.questions)
    ]


def engine_run(model: Any, batches: list[list[list[int]]], max_tokens: int, *, cached: bool) -> Run:
    """The engine on ``batches``: each submitted together and run to the end before the next."""
    longest = max(len(p) for batch in batches for p in batch) + max_tokens
    engine = build_engine(
        model, max_running=16, max_context=longest, prefill_chunk=512, prefix_caching=cached
    )
    ttft: list[float] = []
    tokens: list[list[int]] = []
    start = time.perf_counter()
    with engine:
        for batch in batches:
            submitted = time.perf_counter()
            ids = [engine.submit(p, max_tokens) for p in batch]
            first: dict[int, float] = {}
            while engine.has_work:
                for rid in engine.step():
                    first.setdefault(rid, time.perf_counter() - submitted)
            ttft += [first[i] for i in ids]
            tokens += [list(engine.output(i).tokens) for i in ids]
        hits = engine.stats.prefix_hit_tokens
        kept = engine.memory_report().state_snapshots
    name = "engine, prefix caching" if cached else "engine, no prefix caching"
    seconds = time.perf_counter() - start
    if kept is None:
        return Run(name, seconds, ttft, tokens, hits)
    return Run(name, seconds, ttft, tokens, hits, kept.snapshots, kept.bytes)


def mlx_lm_run(model: Any, batches: list[list[list[int]]], max_tokens: int) -> Run:
    """mlx-lm's BatchGenerator on ``batches`` with one ``LRUPromptCache`` across them.

    Used the way ``mlx_lm.server`` uses it: the nearest cached prefix is fetched before a
    prompt is inserted, and a finished request's caches are stored.
    """
    from mlx_lm.models.cache import LRUPromptCache

    prompt_cache = LRUPromptCache(max_size=64)
    ttft: list[float] = []
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for batch in batches:
        driver = MlxLmBatch(model, running=16, prompt_cache=prompt_cache)
        for i, prompt in enumerate(batch):
            driver.submit(i, prompt, max_tokens)
        driver.run()
        driver.close()
        ttft += [driver.token_times[i][0] for i in range(len(batch))]
        tokens += [driver.tokens[i] for i in range(len(batch))]
    return Run("mlx-lm BatchGenerator + LRUPromptCache", time.perf_counter() - start, ttft, tokens)


def chat_batches(model: Any, shape: Shape, seed: int, answer: int) -> list[list[list[int]]]:
    """The chat workload's turns; each answer (``answer`` tokens) comes from the engine.

    Greedy, so every system generates the same answer to the same prompt.
    """
    rng = random.Random(seed)
    convs = [
        [rng.randrange(VOCAB) for _ in range(shape.message)] for _ in range(shape.conversations)
    ]
    batches: list[list[list[int]]] = []
    with build_engine(model, max_running=16, max_context=4096, prefix_caching=True) as engine:
        for _ in range(shape.turns):
            batches.append([list(c) for c in convs])
            ids = [engine.submit(c, answer) for c in convs]
            engine.run()
            convs = [
                c
                + list(engine.output(i).tokens)
                + [rng.randrange(VOCAB) for _ in range(shape.message)]
                for c, i in zip(convs, ids, strict=True)
            ]
    return batches


def compare(model: Any, batches: list[list[list[int]]], max_tokens: int, rounds: int) -> list[Run]:
    """Every system on the workload, ``rounds`` times in alternating order; best total each."""
    systems = ["cached", "uncached", "mlx-lm"]
    best: dict[str, Run] = {}
    for r in range(rounds):
        order = systems if r % 2 == 0 else list(reversed(systems))
        for system in order:
            if system == "mlx-lm":
                run = mlx_lm_run(model, batches, max_tokens)
            else:
                run = engine_run(model, batches, max_tokens, cached=system == "cached")
            if system not in best or run.seconds < best[system].seconds:
                best[system] = run
    return [best[s] for s in systems]


def report(title: str, runs: list[Run], results: Report) -> None:
    """Print one workload's table; keep it as a Markdown table in ``results``."""
    base = runs[0].tokens
    rows = []
    print(f"\n{title}")
    print(
        f"{'system':42s} {'TTFT p50':>10s} {'total':>9s} {'reused':>8s} {'snapshots':>18s} "
        f"{'tokens':>7s}"
    )
    for run in runs:
        same = "same" if run.tokens == base else "DIFFER"
        # mlx-lm does not report what its prompt cache reused.
        reused = "n/a" if run.name.startswith("mlx-lm") else str(run.hit_tokens)
        kept = f"{run.snapshots}, {run.snapshot_bytes / 2**20:.2f} MiB" if run.snapshots else "-"
        rows.append(
            f"| {run.name} | {run.ttft_p50_ms:.1f} ms | {run.seconds:.2f} s | {reused} | {kept} "
            f"| {same} |"
        )
        print(
            f"{run.name:42s} {run.ttft_p50_ms:8.1f}ms {run.seconds:8.2f}s {reused:>8s} "
            f"{kept:>18s} {same:>7s}"
        )
    cached, uncached = runs[0], runs[1]
    summary = (
        f"TTFT p50: {uncached.ttft_p50_ms / cached.ttft_p50_ms:.1f}x lower with prefix caching "
        f"than without; {runs[2].ttft_p50_ms / cached.ttft_p50_ms:.1f}x lower than mlx-lm"
    )
    print(summary)
    table = (
        "| system | TTFT p50 | total | reused | state snapshots kept | tokens |\n"
        "|---|---|---|---|---|---|\n"
    )
    results.keep(f"### {title}\n\n{table}" + "\n".join(rows) + f"\n\n{summary}")


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = ArgumentParser(prog="python -m tools.bench_prefix", description=__doc__)
    parser.add_argument(
        "--workload", choices=("shared", "chat", "both"), default="both", help="(both)"
    )
    parser.add_argument(
        "--model",
        choices=(
            "gpt-oss-like",
            "gemma3-like",
            "both",
            "gemma3-270m",
            *STATE_MODELS,
            "state",
        ),
        default="both",
        help="the two tiny attention models (both), the three state hybrids (state), one of "
        "them, or the trained Gemma 3 270M (token ids drawn at random below 256, as for the "
        "tiny ones)",
    )
    parser.add_argument("--max-tokens", type=positive_int(256), default=8, help="per request (8)")
    parser.add_argument(
        "--system", type=positive_int(8192), default=None, help="shared prompt tokens (2048)"
    )
    parser.add_argument(
        "--questions", type=positive_int(256), default=None, help="shared-prompt requests (32)"
    )
    add_workload_options(parser)
    add_run_options(parser, quick="small sizes (under a minute)", rounds=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    args = build_parser().parse_args(argv)
    shape = (
        Shape(system=256, questions=8, question=32, conversations=2, turns=3, message=16)
        if args.quick
        else Shape()
    )
    if args.system is not None:
        shape = replace(shape, system=args.system)
    if args.questions is not None:
        shape = replace(shape, questions=args.questions)
    print(f"BLAS: {active_blas().describe()}; {shape}")
    if args.model == "gemma3-270m":
        from kv_serve import load_model

        # Float32 throughout: mlx-lm's side runs the same model (see tools/anchor.py).
        models = {"gemma3-270m": load_model("gemma3-270m", gguf_weights="dequantize")[0]}
    elif args.model == "state" or args.model in STATE_MODELS:
        models = build_state_models()
    else:
        models = build_models()
    names = list(models) if args.model in ("both", "state") else [args.model]
    results = Report("Prefix caching: the engine with and without it, and mlx-lm")
    results.keep(
        f"Workload sizes: {shape}; greedy, at most 16 decoding; each system alone, "
        f"{args.rounds} rounds in alternating order, the better round shown"
    )
    for name in names:
        model = models[name]
        if args.workload in ("shared", "both"):
            batches = [shared_prompts(shape, args.seed)]
            title = f"{name}: {shape.questions} requests, {shape.system}-token shared prefix"
            report(title, compare(model, batches, args.max_tokens, args.rounds), results)
        if args.workload in ("chat", "both"):
            batches = chat_batches(model, shape, args.seed, args.max_tokens)
            title = f"{name}: {shape.conversations} conversations x {shape.turns} turns"
            report(title, compare(model, batches, args.max_tokens, args.rounds), results)
    results.write(args.markdown, prog="tools.bench_prefix", argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
