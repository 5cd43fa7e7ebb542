"""Command-line entry point of the toolkit: ``python -m tools.kv [command] [options]``.

Commands:
  demo     (the default) serve a batch of prompts through the decode engine on the paged
           hybrid pool, verify every request against mlx-lm, report throughput and KV memory
  bench    the engine against mlx-lm's BatchGenerator on the same model and workload
  generate stream the completion of one prompt from a real model (``kv-serve generate``:
           ``--model gemma3-270m --prompt TEXT``)
  serve    an OpenAI-compatible HTTP server of a model (``kv-serve serve``:
           ``--model gemma3-270m [--port 8000]``)
  layout   print the KV-cache layout (layer kinds, pool indices, KV bytes per token) of a
           published model configuration, an embedded tiny architecture or a local mlx-lm
           model directory; nothing is downloaded and no weights are loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from tools.cli_args import (
    MAX_PAGE_SIZE,
    MAX_REQUESTS,
    MAX_TOKENS,
    MAX_WORKLOAD_TOKENS,
    ArgumentParser,
    budget_mib,
    existing_directory,
    markdown_file,
    model_source,
    png_file,
    positive_int,
    random_seed,
)

__all__ = ["build_parser", "main"]

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
#: Context lengths the layout command reports on: positive int32 token positions.
MAX_CONTEXT = 2**31 - 1


class CliError(Exception):
    """A user error reported as one line on stderr with exit status 2."""


def _layout_command(args: argparse.Namespace) -> int:
    from kv_protocol import KVCacheError, layout_from_model
    from kv_testing import build_tiny_model
    from tools.model_configs import (
        REAL_MODEL_CONFIGS,
        lazy_model_from_config,
        lazy_model_from_directory,
    )

    if args.model is not None:
        path = Path(args.model)  # an existing directory (checked while parsing)
        try:
            model = lazy_model_from_directory(path)
        except (FileNotFoundError, ValueError, ImportError, TypeError) as exc:
            raise CliError(f"--model {path}: {exc}") from exc
        name = str(path)
    elif args.arch is not None:
        model = build_tiny_model(args.arch)
        name = f"tiny {args.arch}"
    else:
        model = lazy_model_from_config(REAL_MODEL_CONFIGS[args.config])
        name = args.config
    try:
        layout = layout_from_model(model, dtype=DTYPES[args.dtype])
    except KVCacheError as exc:
        raise CliError(f"{name}: {exc}") from exc
    print(f"model: {name}")
    print(layout.describe())
    full_bytes = layout.full_kv_bytes_per_token()
    print(f"KV bytes per token if every attention layer kept all tokens: {full_bytes}")
    for context in args.context:
        hybrid = 0
        for layer_id in layout.attention_layer_ids:
            window = layout.window(layer_id)
            kept = context if window is None else min(context, window)
            hybrid += kept * layout.geometry(layer_id).bytes_per_token
        print(
            f"  at {context} tokens: hybrid {hybrid / 2**20:.1f} MiB vs full "
            f"{context * full_bytes / 2**20:.1f} MiB per request "
            f"({100 * hybrid / (context * full_bytes):.1f}%)"
        )
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from tools.demo import DemoConfig, DemoError, format_result, result_json, run_demo

    # Each value was checked on its own while parsing (tools.cli_args); what is left are the
    # checks that relate two options, still before anything is built.
    if args.min_prompt is None:
        args.min_prompt = min(8, args.max_prompt)
    if args.min_tokens is None:
        args.min_tokens = min(16, args.max_tokens)
    if args.min_prompt > args.max_prompt:
        raise CliError(
            f"need --min-prompt <= --max-prompt, got {args.min_prompt} > {args.max_prompt}"
        )
    if args.min_tokens > args.max_tokens:
        raise CliError(
            f"need --min-tokens <= --max-tokens, got {args.min_tokens} > {args.max_tokens}"
        )
    if args.requests * (args.max_prompt + args.max_tokens) > MAX_WORKLOAD_TOKENS:
        raise CliError(
            f"--requests {args.requests} x (--max-prompt {args.max_prompt} + --max-tokens "
            f"{args.max_tokens}) is more than {MAX_WORKLOAD_TOKENS} tokens in all; ask for "
            "fewer or shorter requests"
        )
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise CliError(
            "--plot needs matplotlib: install the optional extra with `uv sync --extra plot`"
        )
    config = DemoConfig(
        arch=args.arch,
        model_path=args.model,
        window=args.window,
        requests=args.requests,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        page_size=args.page_size,
        budget_mib=args.budget_mib,
        max_running=args.max_running,
        prefill_chunk=args.prefill_chunk,
        fused_rope=args.fused_rope,
        decode_path=args.decode_path,
        dtype=args.dtype,
        seed=args.seed,
        verify=not args.no_verify,
        plot=args.plot,
        progress=not args.json and not args.quiet,
    )
    from kv_protocol import KVCacheError

    try:
        result = run_demo(config)
    except (DemoError, KVCacheError) as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        print(result_json(result))
    else:
        from tools.harness import Report

        report = Report("Demo: the engine on the hybrid pool, verified against mlx-lm")
        with report.capturing():
            print(format_result(result))
        if args.plot is not None:
            # A link from where the Markdown file lies to the picture.
            where = Path(args.markdown).parent if args.markdown not in (None, "-") else Path()
            picture = Path(os.path.relpath(args.plot, where)).as_posix()
            report.keep(f"![pages per sub-pool and requests over the engine steps]({picture})")
        report.write(args.markdown, prog="tools.kv", argv=args.argv)
    return 1 if result.verified is False else 0


def _bench_command(argv: Sequence[str]) -> int:
    from tools.bench_engine import main as bench_main

    return bench_main(argv)


def _generate_command(argv: Sequence[str]) -> int:
    from kv_serve import cli_main

    return cli_main(["generate", *argv])


def _serve_command(argv: Sequence[str]) -> int:
    from kv_serve import cli_main

    return cli_main(["serve", *argv])


def _add_demo_options(demo: argparse.ArgumentParser) -> None:
    from kv_testing import ARCHITECTURES

    model = demo.add_argument_group("model")
    model.add_argument(
        "--arch",
        choices=ARCHITECTURES,
        default="gpt_oss",
        help="embedded tiny random-weight architecture (default: %(default)s)",
    )
    model.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        type=model_source,
        help="instead of --arch: a local mlx-lm model directory (config.json + *.safetensors; "
        "random prompts), or a trained model with its tokenizer, gemma3-270m or a Gemma 3 "
        ".gguf file (the real English prompts of tools/real_prompts.py; texts printed)",
    )
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights of a gemma3-270m / .gguf model (default: %(default)s; in bfloat16 a "
        "difference after a tie of the top two logits is reported as a tie)",
    )
    model.add_argument(
        "--window",
        type=positive_int(MAX_TOKENS),
        default=32,
        help=f"sliding window of the embedded model, 1..{MAX_TOKENS} (default: %(default)s)",
    )
    work = demo.add_argument_group("workload")
    work.add_argument(
        "--requests",
        type=positive_int(MAX_REQUESTS),
        default=16,
        help=f"number of prompts, 1..{MAX_REQUESTS} (default: %(default)s)",
    )
    work.add_argument(
        "--min-prompt",
        type=positive_int(MAX_TOKENS),
        help="shortest prompt (default: 8, or --max-prompt if that is smaller)",
    )
    work.add_argument(
        "--max-prompt",
        type=positive_int(MAX_TOKENS),
        default=320,
        help=f"longest prompt, 1..{MAX_TOKENS} tokens (default: %(default)s)",
    )
    work.add_argument(
        "--min-tokens",
        type=positive_int(MAX_TOKENS),
        help="fewest tokens to generate (default: 16, or --max-tokens if that is smaller)",
    )
    work.add_argument(
        "--max-tokens",
        type=positive_int(MAX_TOKENS),
        default=64,
        help=f"most tokens to generate, 1..{MAX_TOKENS} (default: %(default)s)",
    )
    work.add_argument(
        "--seed",
        type=random_seed,
        default=0,
        help="workload and model seed, 0..2**32-1 (default: %(default)s)",
    )
    engine = demo.add_argument_group("engine and pool")
    engine.add_argument(
        "--page-size",
        type=positive_int(MAX_PAGE_SIZE),
        default=16,
        help=f"tokens per pool page, 1..{MAX_PAGE_SIZE} (default: %(default)s)",
    )
    engine.add_argument(
        "--budget-mib",
        type=budget_mib,
        help="KV pool budget in MiB, > 0 and at most this machine's memory (default: exactly "
        "what the workload needs at --max-running concurrency)",
    )
    engine.add_argument(
        "--max-running",
        type=positive_int(MAX_REQUESTS),
        default=8,
        help="requests decoded together (default: %(default)s)",
    )
    engine.add_argument(
        "--prefill-chunk",
        type=positive_int(MAX_TOKENS),
        default=128,
        help="prefill chunk in tokens (default: %(default)s)",
    )
    engine.add_argument(
        "--fused-rope",
        choices=["off", "auto", "reference", "metal", "cuda"],
        default="off",
        help="fused RoPE + pool-scatter kernel on full-attention layers (default: off)",
    )
    engine.add_argument(
        "--decode-path",
        choices=["auto", "universal", "fast"],
        default="auto",
        help="decode path of the attention layers: the patched kernels where the probe accepts "
        "a module and the universal pool cache elsewhere (auto, the default), or every layer "
        "on one path",
    )
    out = demo.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON report only")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        type=png_file,
        help="write pages per sub-pool and running requests over the steps (needs matplotlib: "
        "uv sync --extra plot)",
    )
    out.add_argument("--no-verify", action="store_true", help="skip the token check against mlx-lm")
    out.add_argument(
        "--markdown",
        type=markdown_file,
        nargs="?",
        const="-",
        metavar="FILE.md",
        help="also print the report as Markdown, or write it to FILE.md (with the command, "
        "the machine and the date), e.g. docs/results/demo.md",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m tools.kv``."""
    from kv_testing import ARCHITECTURES
    from tools.model_configs import REAL_MODEL_CONFIGS

    parser = ArgumentParser(
        prog="python -m tools.kv",
        description="Hybrid KV-cache toolkit for MLX: layouts, demo and benchmark.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command")
    demo = commands.add_parser(
        "demo",
        prog="python -m tools.kv [demo]",
        epilog="Other commands: `python -m tools.kv bench --help` (the engine against mlx-lm's "
        "BatchGenerator) and `python -m tools.kv layout --help` (a model's KV layout).",
        help="(default) serve prompts through the engine, verify against mlx-lm, report",
        description="Serve a batch of prompts through DecodeEngine on HybridKVPool, check "
        "every request's tokens against mlx-lm generating it alone, and report throughput "
        "and KV memory against a full-KV pool and mlx-lm's caches. Exit status 1 when "
        "verification fails, 2 on bad input.",
    )
    _add_demo_options(demo)
    demo.set_defaults(handler=_demo_command)
    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="the engine against mlx-lm's BatchGenerator (bench --help for its options)",
    )
    bench.set_defaults(handler=_bench_command)
    generate = commands.add_parser(
        "generate",
        add_help=False,
        help="stream one prompt's completion from a real model (generate --help for options)",
    )
    generate.set_defaults(handler=_generate_command)
    serve = commands.add_parser(
        "serve",
        add_help=False,
        help="an OpenAI-compatible HTTP server of a model (serve --help for options)",
    )
    serve.set_defaults(handler=_serve_command)
    layout = commands.add_parser(
        "layout",
        help="print the KV layout of a model",
        description="Print the KV-cache layout of a model: which layers are full, sliding "
        "or state, their pool indices and KV geometry, and the KV bytes per request.",
    )
    source = layout.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        choices=sorted(REAL_MODEL_CONFIGS),
        default="gpt-oss-20b",
        help="a published model configuration (default: %(default)s)",
    )
    source.add_argument(
        "--arch", choices=ARCHITECTURES, help="an embedded tiny random-weight architecture"
    )
    source.add_argument(
        "--model",
        metavar="PATH",
        type=existing_directory,
        help="a local mlx-lm model directory",
    )
    layout.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="KV dtype used for the byte counts (default: %(default)s)",
    )
    layout.add_argument(
        "--context",
        type=positive_int(MAX_CONTEXT),
        nargs="+",
        default=[8192, 32768],
        metavar="TOKENS",
        help=f"context lengths to report KV bytes for, 1..{MAX_CONTEXT} (default: 8192 32768)",
    )
    layout.set_defaults(handler=_layout_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    # `--help` with no command goes to the demo, the default command, so it lists every
    # option; its epilog names the other commands.
    known = {"demo", "bench", "generate", "serve", "layout"}
    if not arguments or arguments[0] not in known:
        arguments.insert(0, "demo")  # the demo is the default command
    if arguments[0] == "bench":
        # The benchmark owns its options (python -m tools.kv bench --help).
        return _bench_command(arguments[1:])
    if arguments[0] == "generate":
        # So does kv-serve's generate (python -m tools.kv generate --help).
        return _generate_command(arguments[1:])
    if arguments[0] == "serve":
        # And kv-serve's serve (python -m tools.kv serve --help).
        return _serve_command(arguments[1:])
    args = parser.parse_args(arguments)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status: int = args.handler(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
