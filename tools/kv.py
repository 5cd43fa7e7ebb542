"""Command-line entry point of the toolkit: ``python -m tools.kv [command] [options]``.

Commands:
  layout   print the KV-cache layout (layer kinds, pool indices, KV bytes per token) of a
           published model configuration, an embedded tiny architecture or a local mlx-lm
           model directory; nothing is downloaded and no weights are loaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

__all__ = ["build_parser", "main"]

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class CliError(Exception):
    """A user error reported as one line on stderr with exit status 2."""


def _layout_command(args: argparse.Namespace) -> int:
    from kv_protocol import KVCacheError, layout_from_model
    from tools.model_configs import (
        REAL_MODEL_CONFIGS,
        lazy_model_from_config,
        lazy_model_from_directory,
    )
    from tools.tiny_models import build_tiny_model

    if args.model is not None:
        path = Path(args.model)
        if not path.is_dir():
            raise CliError(f"--model {path}: no such directory")
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m tools.kv``."""
    from tools.model_configs import REAL_MODEL_CONFIGS
    from tools.tiny_models import ARCHITECTURES

    parser = argparse.ArgumentParser(
        prog="python -m tools.kv",
        description="Hybrid KV-cache toolkit for MLX: layouts, demo and benchmark.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command")
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
    source.add_argument("--model", metavar="PATH", help="a local mlx-lm model directory")
    layout.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="KV dtype used for the byte counts (default: %(default)s)",
    )
    layout.add_argument(
        "--context",
        type=int,
        nargs="*",
        default=[8192, 32768],
        metavar="TOKENS",
        help="context lengths to report KV bytes for (default: 8192 32768)",
    )
    layout.set_defaults(handler=_layout_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        status: int = args.handler(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
