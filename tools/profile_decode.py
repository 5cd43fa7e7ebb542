"""Profile: where a batched decode step of Gemma 3 270M spends its time on this machine.

For each batch size the engine decodes ``B`` requests (128-token random prompts, greedy,
prefix caching off) and reports its mean decode step and the part spent waiting for MLX's
evaluation (the rest is host work: Python, scheduling, page tables, graph building). Then the
step's parts run alone on the model's own modules with the step's shapes (``B`` rows of one
token): the vocabulary head (the tied 262144 x 640 embedding, as mlx-lm calls it, ``h @ W.T``;
in the other operand order, ``(W @ h.T).T``; and as the engine projects on the CPU,
``project_rows``: that order, one row padded to two, 6-112 rows padded and in vocabulary
slices), the
attention projections, the MLPs of all 18 layers (mlx-lm's modules, and with the engine's
vectorised activation, ``FastGatedMLP``), and the greedy pick over the vocabulary (the
argmax of the logits, or the native head's integer screen, which picks a greedy step's tokens
without them: what the engine runs where every row is greedy); the table marks the variants
the engine does not use. Each part is one evaluation of all
its layers' work, the best of ``--repeats``. Attention over the pages is the step's device
time minus that of the same step with the paged kernel's work swapped for an identity after
the engine is built (:func:`attention_cost`). The model is loaded as ``kv-serve`` loads
it: on the CPU its 8-bit tied head is projected by the native kernel and its other linear
layers read their codes for decode steps (``load_model``'s ``"dual"``), and the native
kernels' evaluation counts as device time. What nothing covers (norms, RoPE, the pool
writes, sampling bookkeeping) is the step minus their sum. ``--lengths`` sets the prompts
(the real prompts' lengths give a ragged batch, whose attention costs more).

A second table times the same step from inside: the native kernels' calls as they run in the
engine's decode steps (the graph calls' timing, ``GraphCalls.set_timing``: a clock read either
side of each kernel call, summed by node), the host's part, and what remains of the device
time (MLX's own operations, its scheduling of the step's few hundred nodes, the kernels'
input copies).

With ``--weights-bits 8`` / ``4`` the model's weights are quantized at load (MLX's affine
quantization, ``kv_serve.load_model(weights_bits=)``), with ``--gguf-kept`` the GGUF's own
blocks stay quantized (``load_model(gguf_weights="keep")``), and only the engine's step is
timed, beside the same step with fp32 weights (one process, alternating): what quantized
weights cost or save on this backend.

    uv run python -m tools.profile_decode                    # B = 1, 4, 16
    uv run python -m tools.profile_decode --weights-bits 8 4
    uv run python -m tools.profile_decode --gguf-kept
    uv run python -m tools.profile_decode --batches 4 --markdown docs/results/profile_decode.md
    uv run python -m tools.profile_decode --batches 16 --lengths 6,14,20,130,147,170,840,1251
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from tools.cli_args import (
    ArgumentParser,
    add_run_options,
    int_in_range,
    int_list,
    positive_int,
)
from tools.harness import Report

PROMPT = 128
DECODE = 32


def best_seconds(work: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` evaluations of ``work()`` (after one warm-up)."""
    import mlx.core as mx

    mx.eval(work())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(work())
        times.append(time.perf_counter() - start)
    return min(times)


#: Part names of the head and MLP variants, and which the engine uses on the CPU.
MLX_LM_HEAD = "vocabulary head, h @ W.T (mlx-lm)"
WHOLE_HEAD = "vocabulary head, (W @ h.T).T whole"
ENGINE_HEAD = "vocabulary head, project_rows (the engine)"
KERNEL_HEAD = "vocabulary head, 8-bit through the native kernel (logits)"
GREEDY_HEAD = "vocabulary head's greedy pick, the native kernel's integer screen"
ARGMAX = "greedy pick (argmax over 262144)"
MLX_LM_MLPS = "MLPs (18 layers), mlx-lm's modules"
FAST_MLPS = "MLPs (18 layers), vectorised activation (the engine)"


def parts(model: Any, batch: int, repeats: int) -> dict[str, float]:
    """Seconds of each part of a decode step of ``batch`` rows, run alone."""
    import mlx.core as mx
    import mlx.nn as nn

    from kv_batching._fast_mlp import fast_mlps, patch_model_mlps, unpatch_model_mlps
    from kv_batching._model_forward import project_rows
    from kv_metal_kernels import CpuQuantizedHead, select_kernels

    layers = model.model.layers
    embedding = model.model.embed_tokens
    quantized = isinstance(embedding, nn.QuantizedEmbedding)
    width = embedding.weight.shape[1] * (32 // embedding.bits if quantized else 1)
    hidden = mx.random.normal((batch, 1, width))
    inner = layers[0].mlp.down_proj.weight.shape[1]
    heads = layers[0].self_attn.o_proj.weight.shape[1]
    mlp_in = mx.random.normal((batch, 1, width))
    o_in = mx.random.normal((batch, 1, heads))
    mx.eval(hidden, mlp_in, o_in)
    weight = model.model.embed_tokens.weight
    rows = hidden.reshape(batch, width)

    def projections() -> list[Any]:
        out = []
        for layer in layers:
            attn = layer.self_attn
            out += [attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)]
            out.append(attn.o_proj(o_in))
        return out

    def mlps() -> list[Any]:
        return [layer.mlp(mlp_in) for layer in layers]

    # The engine's activation: the kernel set's native one where it builds (else compiled).
    activation = select_kernels().gated_activation

    def fast() -> list[Any]:
        with fast_mlps(model, kernel=activation):
            return [layer.mlp(mlp_in) for layer in layers]

    del inner
    measured: dict[str, float] = {}
    if quantized:
        # The 8-bit tied head: MLX's own quantized product is slow on the CPU (bench_head);
        # the engine projects it through the native kernel.
        project = CpuQuantizedHead().prepare(
            embedding.weight,
            embedding.scales,
            embedding.biases,
            group_size=embedding.group_size,
            bits=embedding.bits,
        )
        assert project is not None, "the native CPU kernel does not build here"
        logits = project(rows)
        measured[KERNEL_HEAD] = best_seconds(lambda: project(rows), repeats)
        if project.greedy(rows) is not None:
            # A greedy step's tokens without the logits (AVX-512 VNNI).
            measured[GREEDY_HEAD] = best_seconds(lambda: project.greedy(rows), repeats)
    else:
        logits = embedding.as_linear(hidden)
        mx.eval(logits)
        measured[MLX_LM_HEAD] = best_seconds(lambda: embedding.as_linear(hidden), repeats)
        measured[WHOLE_HEAD] = best_seconds(lambda: (weight @ rows.T).T, repeats)
        measured[ENGINE_HEAD] = best_seconds(lambda: project_rows(weight, rows), repeats)
    measured["attention projections (q, k, v, o; 18 layers)"] = best_seconds(projections, repeats)
    measured[MLX_LM_MLPS] = best_seconds(mlps, repeats)
    if patch_model_mlps(model):
        try:
            measured[FAST_MLPS] = best_seconds(fast, repeats)
        finally:
            unpatch_model_mlps(model)
    measured[ARGMAX] = best_seconds(lambda: mx.argmax(logits, axis=-1), repeats)
    return measured


def engine_step(
    model: Any,
    batch: int,
    seed: int,
    *,
    lengths: Sequence[int] = (PROMPT,),
    attention: bool = True,
) -> tuple[float, float, set[str]]:
    """The engine's decode step at ``batch`` rows: mean seconds, device part, variants used.

    Row ``i``'s prompt has ``lengths[i % len(lengths)]`` random tokens. The last names the
    head and MLP variants of :func:`parts` the engine runs. ``attention=False`` replaces the
    paged attention kernel's work by its query (an identity) once the engine is built (so
    the build-time probes still choose the step's paths as usual): the difference is what
    attention over the pages costs a step (the tokens are then not the model's).
    """
    from kv_serve import build_engine

    rng = random.Random(seed)
    sizes = [lengths[i % len(lengths)] for i in range(batch)]
    prompts = [[rng.randrange(1000, 200000) for _ in range(n)] for n in sizes]
    with build_engine(
        model, max_running=batch, max_context=max(sizes) + DECODE, prefix_caching=False
    ) as engine:
        if not attention:
            kernel: Any = engine._core.runner.kernels.attention
            # The reference's rows call, or the CPU kernel's (same arguments).
            kernel._attend_rows = kernel._attend = _query_only
        for prompt in prompts:
            engine.submit(prompt, DECODE)
        engine.run()
        stats = engine.stats
        steps = max(stats.decode_steps, 1)
        head = ENGINE_HEAD if engine._core.runner.decode_forward is not None else MLX_LM_HEAD
        # Every step greedy: the screen picks the tokens where it serves, else the logits'
        # argmax.
        used = {GREEDY_HEAD} if stats.greedy_head_steps == steps else {KERNEL_HEAD, head, ARGMAX}
        used.add(FAST_MLPS if engine._core.runner.fast_mlps else MLX_LM_MLPS)
        return stats.decode_seconds / steps, stats.decode_device_seconds / steps, used


#: What each native kernel's graph node computes in a decode step.
KERNEL_PARTS = {
    "KvQuantizedLinear": "linear layers' products (native kernel over the GGUF's codes)",
    "KvQuantizedRows": "products through the head kernel's layout (its logits; linear layers "
    "where the linear kernel does not build)",
    "KvGreedyRows": "vocabulary head's greedy pick (integer screen)",
    "KvPagedAttention": "attention over the pages",
    "KvRmsNorm": "RMS norms",
    "KvNormRope": "q/k norms with RoPE",
    "KvGatedActivation": "MLP activations",
    "KvScatterRows": "K/V rows written to the pool",
}


def kernel_times(
    model: Any, batch: int, seed: int, *, lengths: Sequence[int] = (PROMPT,)
) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """The engine's decode steps timed from inside.

    Seconds a step, its device part, and each native kernel's (seconds, calls) a step,
    over the steps after every prompt's prefill (the graph calls' timing; empty where
    they are not available).
    """
    from kv_metal_kernels._graph_call import graph_calls
    from kv_serve import build_engine

    calls = graph_calls()
    rng = random.Random(seed)
    sizes = [lengths[i % len(lengths)] for i in range(batch)]
    prompts = [[rng.randrange(1000, 200000) for _ in range(n)] for n in sizes]
    with build_engine(
        model, max_running=batch, max_context=max(sizes) + DECODE, prefix_caching=False
    ) as engine:
        ids = [engine.submit(prompt, DECODE) for prompt in prompts]
        while not all(engine.output(i).tokens for i in ids):
            engine.step()
        stats = engine.stats
        before = stats.decode_steps, stats.decode_seconds, stats.decode_device_seconds
        calls.take_timing()
        calls.set_timing(True)
        try:
            engine.run()
        finally:
            calls.set_timing(False)
        timed = calls.take_timing()
        steps = max(stats.decode_steps - before[0], 1)
        step = (stats.decode_seconds - before[1]) / steps
        device = (stats.decode_device_seconds - before[2]) / steps
    return step, device, {name: (t / steps, n / steps) for name, (t, n) in timed.items()}


def _print_kernel_times(
    step: float, device: float, kernels: dict[str, tuple[float, float]]
) -> None:
    print("\nInside the engine's step (the native kernels timed where they run):\n")
    print("| part | ms | calls a step | share of the step |")
    print("|---|---|---|---|")
    print(
        f"| host (not waiting for MLX) | {1000 * (step - device):.1f} | | "
        f"{100 * (step - device) / step:.0f}% |"
    )
    inside = 0.0
    for name, (seconds, count) in sorted(kernels.items(), key=lambda item: -item[1][0]):
        inside += seconds
        label = KERNEL_PARTS.get(name, name)
        print(f"| {label} | {1000 * seconds:.1f} | {count:.0f} | {100 * seconds / step:.0f}% |")
    rest = device - inside
    print(
        f"| the rest of the device time (MLX's own operations and scheduling, the kernels' "
        f"input copies) | {1000 * rest:.1f} | | {100 * rest / step:.0f}% |"
    )


def _query_only(q: Any, k_pool: Any, v_pool: Any, *args: Any, **kwargs: Any) -> Any:
    """An attention kernel's rows call that returns the queries: the step without attention.

    One element of each pool is added (times zero), so the step's pool writes are still
    evaluated: the difference is the attention alone.
    """
    import mlx.core as mx

    for pool in (k_pool, v_pool):
        if isinstance(pool, mx.array):
            q = q + 0 * pool[0, 0, 0].astype(q.dtype)
    return q


def attention_cost(model: Any, batch: int, seed: int, lengths: Sequence[int]) -> float | None:
    """Seconds of a decode step's attention over the pages: steps with and without it.

    Two runs of each, alternating, the faster of each kept; ``None`` when the engine's
    attention kernel is neither the reference nor the CPU one (whose work can be swapped
    out).
    """
    from kv_metal_kernels import CpuPagedAttention, ReferencePagedAttention
    from kv_serve import build_engine

    with build_engine(model, max_running=1, max_context=64, prefix_caching=False) as probe:
        kernel = probe._core.runner.kernels.attention
        if not isinstance(kernel, (ReferencePagedAttention, CpuPagedAttention)):
            return None
    with_attention: list[float] = []
    without: list[float] = []
    for _ in range(2):
        with_attention.append(engine_step(model, batch, seed, lengths=lengths)[1])
        without.append(engine_step(model, batch, seed, lengths=lengths, attention=False)[1])
    return max(0.0, min(with_attention) - min(without))


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = ArgumentParser(prog="python -m tools.profile_decode", description=__doc__)
    parser.add_argument(
        "--batches",
        type=int_list(1, 64),
        default=[1, 4, 16],
        help="decode batch sizes, comma-separated (1,4,16)",
    )
    parser.add_argument(
        "--repeats", type=positive_int(100), default=5, help="timings per part, best kept (5)"
    )
    parser.add_argument(
        "--lengths",
        type=int_list(1, 8192),
        default=[PROMPT],
        help=f"prompt lengths in tokens, comma-separated, taken by the rows in turn ({PROMPT}); "
        "e.g. the real prompts' 6,7,14,15,16,20,114,130,136,147,162,170,737,840,1138,1251",
    )
    parser.add_argument(
        "--seed", type=int_in_range(0, 2**31 - 1), default=0, help="prompt seed (0)"
    )
    parser.add_argument(
        "--weights-bits",
        nargs="+",
        choices=("4", "8"),
        default=None,
        help="compare the engine's step with weights quantized to these bits against fp32",
    )
    parser.add_argument(
        "--gguf-kept",
        action="store_true",
        help="compare the engine's step with the GGUF's own blocks kept quantized "
        "(load_model(gguf_weights='keep')) against fp32",
    )
    add_run_options(parser, quick=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Profile the decode step and print one table per batch size."""
    args = build_parser().parse_args(argv)
    from kv_serve import active_blas, load_fast_blas, load_model

    load_fast_blas()
    if args.weights_bits or args.gguf_kept:
        return _quantized(args)
    model, _ = load_model("gemma3-270m")
    report = Report("Where a decode step of Gemma 3 270M goes")
    with report.capturing():
        shown = ", ".join(str(n) for n in args.lengths)
        print(f"BLAS: {active_blas().describe()}; prompts of {shown} tokens, {DECODE} decoded")
        for batch in args.batches:
            measured = parts(model, batch, args.repeats)
            step, device, used = engine_step(model, batch, args.seed, lengths=args.lengths)
            attention = attention_cost(model, batch, args.seed, args.lengths)
            variants = {
                MLX_LM_HEAD,
                WHOLE_HEAD,
                ENGINE_HEAD,
                KERNEL_HEAD,
                GREEDY_HEAD,
                ARGMAX,
                MLX_LM_MLPS,
                FAST_MLPS,
            }
            print(f"\n### B = {batch}: engine decode step {1000 * step:.1f} ms\n")
            print("| part | ms | share of the step |")
            print("|---|---|---|")
            print(
                f"| host (not waiting for MLX) | {1000 * (step - device):.1f} | "
                f"{100 * (step - device) / step:.0f}% |"
            )
            counted = 0.0
            for name, seconds in measured.items():
                share = f"{100 * seconds / step:.0f}%"
                if name in variants and name not in used:
                    share = "(not what the engine runs)"
                else:
                    counted += seconds
                print(f"| {name} | {1000 * seconds:.1f} | {share} |")
            if attention is not None:
                counted += attention
                print(
                    f"| attention over the pages (the step with and without the paged "
                    f"kernel's work) | {1000 * attention:.1f} | {100 * attention / step:.0f}% |"
                )
            rest = device - counted
            print(
                f"| the rest of the device time (norms, RoPE, pool writes, parts measured "
                f"alone faster than in the step) | {1000 * rest:.1f} | {100 * rest / step:.0f}% |"
            )
            timed_step, timed_device, kernels = kernel_times(
                model, batch, args.seed, lengths=args.lengths
            )
            if kernels:
                _print_kernel_times(timed_step, timed_device, kernels)
    report.write(args.markdown, prog="tools.profile_decode", argv=argv)
    return 0


def _quantized(args: argparse.Namespace) -> int:
    """The engine's decode step with fp32 and with quantized weights, alternating."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kv_serve import active_blas, load_model

    models = {"fp32": load_model("gemma3-270m", gguf_weights="dequantize")[0]}
    for bits in args.weights_bits or []:
        models[f"{bits}-bit"] = load_model("gemma3-270m", weights_bits=int(bits))[0]
    if args.gguf_kept:
        kept = load_model("gemma3-270m", gguf_weights="keep")[0]
        models["GGUF blocks kept (Q8_0 / Q5_0 / Q4_K; Q6_K as fp32)"] = kept
    report = Report("Where a decode step of Gemma 3 270M goes")
    with report.capturing():
        print(f"BLAS: {active_blas().describe()}; device {mx.default_device()}")
        print(f"prompts of {PROMPT} tokens, {DECODE} decoded; best of {args.repeats} runs\n")
        print(
            "| weights | weight MiB | "
            + " | ".join(f"B = {b}: step ms (tok/s)" for b in args.batches)
            + " |"
        )
        print("|---|---|" + "---|" * len(args.batches))
        best: dict[tuple[str, int], float] = {}
        for r in range(args.repeats):
            names = list(models) if r % 2 == 0 else list(reversed(models))
            for name in names:
                for batch in args.batches:
                    step = engine_step(models[name], batch, args.seed)[0]
                    key = (name, batch)
                    best[key] = min(best.get(key, step), step)
        for name, model in models.items():
            flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
            nbytes = sum(v.nbytes for _, v in flat)
            cells = [
                f"{1000 * best[(name, b)]:.0f} ({b / best[(name, b)]:.1f})" for b in args.batches
            ]
            print(f"| {name} | {nbytes / 2**20:.0f} | " + " | ".join(cells) + " |")
    report.write(args.markdown, prog="tools.profile_decode", argv=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
