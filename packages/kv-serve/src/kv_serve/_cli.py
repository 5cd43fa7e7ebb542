"""The ``kv-serve`` command line: ``kv-serve generate ...`` and ``kv-serve serve ...``.

Nothing here imports ``mlx`` at module level, so :func:`main` can load the fast BLAS
(:func:`kv_serve.load_fast_blas`) before it is first imported, also under
``python -m kv_serve._cli``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

from ._blas import load_fast_blas
from ._cli_commands import (
    SERVE_MIB_OPTIONS,
    SERVE_PROCESS_OPTIONS,
    generate_command,
    serve_command,
    server_config,
)
from ._extras import MissingExtraError
from ._sizes import DEFAULT_KV_SLAB_BYTES

__all__ = ["SERVE_MIB_OPTIONS", "SERVE_PROCESS_OPTIONS", "main", "parser", "server_config"]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in 0..2**64-1, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an int in 0..2**64-1, got {text!r}")
    return value


def _int_in(low: int, high: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int in {low}..{high}, got {text!r}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an int in {low}..{high}, got {text!r}")
        return value

    return parse  # type: ignore[return-value]


def _number(low: float, high: float, *, low_open: bool = False) -> type[float]:
    def parse(text: str) -> float:
        bracket = "(" if low_open else "["
        wanted = f"a number in {bracket}{low}, {high}]"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse  # type: ignore[return-value]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kv-serve``."""
    top = _Parser(prog="kv-serve", description="Serve hybrid-attention models on MLX.")
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="stream the completion of one prompt")
    gen.add_argument(
        "--model",
        required=True,
        help="an mlx-lm model directory, a Gemma 3 .gguf file, or 'gemma3-270m'",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument(
        "--max-tokens", type=_positive_int, default=128, help="most tokens to generate (128)"
    )
    gen.add_argument(
        "--temperature",
        type=_number(0.0, 100.0),
        default=0.0,
        help="sampling temperature in [0, 100]; 0 is greedy (the default)",
    )
    gen.add_argument(
        "--top-p",
        type=_number(0.0, 1.0, low_open=True),
        default=1.0,
        help="nucleus sampling mass in (0, 1] (1: off)",
    )
    gen.add_argument(
        "--top-k",
        type=_int_in(0, 2**31 - 1),
        default=0,
        help="keep the k most likely tokens (0: off)",
    )
    gen.add_argument(
        "--min-p",
        type=_number(0.0, 1.0),
        default=0.0,
        help="drop tokens less likely than this times the most likely one, in [0, 1] (0: off)",
    )
    gen.add_argument(
        "--repetition-penalty",
        type=_number(0.0, math.inf, low_open=True),
        default=1.0,
        help="divide positive (multiply negative) logits of prompt and output tokens (1: off)",
    )
    gen.add_argument(
        "--presence-penalty",
        type=_number(-2.0, 2.0),
        default=0.0,
        help="OpenAI's presence penalty over the generated tokens, in [-2, 2] (0)",
    )
    gen.add_argument(
        "--frequency-penalty",
        type=_number(-2.0, 2.0),
        default=0.0,
        help="OpenAI's frequency penalty over the generated tokens, in [-2, 2] (0)",
    )
    gen.add_argument(
        "--logprobs",
        type=_int_in(0, 20),
        default=None,
        help="after the text, each token's logprob and this many alternatives (0..20)",
    )
    gen.add_argument(
        "--n",
        type=_int_in(1, 128),
        default=1,
        help="completions of the prompt (the prompt is prefilled once; completion i samples "
        "with seed + i); more than one are printed when all are done (1)",
    )
    gen.add_argument("--seed", type=_seed, default=0, help="sampling seed, 0..2**64-1 (0)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user turn through the model's chat template (a model "
        "without one is refused; see --chat-template)",
    )
    gen.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights of a converted GGUF model (float32: exact, and fastest on CPU)",
    )
    gen.add_argument("--cache-dir", default=None, help="where converted GGUF models are kept")
    _add_chat_template_argument(gen)
    _add_weights_arguments(gen)
    add_kv_quantization_arguments(gen)
    gen.set_defaults(handler=generate_command)
    srv = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)",
        description="Serve a model over HTTP with OpenAI's API (/v1/models, /v1/completions, "
        "/v1/chat/completions, /v1/responses; stream: true for server-sent events), "
        "Anthropic's (/v1/messages), /tokenize, /health and /metrics (Prometheus). One engine "
        "thread batches every request continuously.",
    )
    srv.add_argument(
        "--model",
        required=True,
        help="an mlx-lm model directory, a Gemma 3 .gguf file, or 'gemma3-270m'",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    srv.add_argument("--port", type=_port, default=8000, help="TCP port (8000)")
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: --model as given)",
    )
    srv.add_argument(
        "--kv-budget-mib",
        type=_positive_int,
        default=None,
        help="KV pool size in MiB (default: what --max-running requests of --max-context "
        "tokens need at their peak)",
    )
    srv.add_argument(
        "--kv-slab-mib",
        type=_non_negative_int,
        default=DEFAULT_KV_SLAB_BYTES // 2**20,
        help="the KV pool's buffers grow by slabs of this many MiB per sub-pool as pages are "
        "first needed, up to --kv-budget-mib, and shrink back when the server is idle "
        f"({DEFAULT_KV_SLAB_BYTES // 2**20}; 0 allocates the whole budget at start)",
    )
    srv.add_argument(
        "--max-running", type=_positive_int, default=16, help="requests decoded together (16)"
    )
    srv.add_argument(
        "--max-tokens-default",
        type=_positive_int,
        default=None,
        help="the most tokens a chat request that gives no max_tokens may generate (default: "
        "the context left after its prompt)",
    )
    srv.add_argument(
        "--max-queued",
        type=_positive_int,
        default=128,
        help="sequences (a request's n, over its prompts) that may wait for admission; a "
        "request arriving while that many wait gets 429 (128)",
    )
    srv.add_argument(
        "--max-context",
        type=_positive_int,
        default=4096,
        help="most tokens (prompt + completion) of one request (4096)",
    )
    srv.add_argument(
        "--prefill-chunk", type=_positive_int, default=512, help="prompt tokens per step (512)"
    )
    srv.add_argument(
        "--prefill-stall",
        type=_stall,
        default=3.0,
        help="while requests decode, a step prefills for at most this many times its decode "
        "time, so a long prompt does not stall the streams; 'off' prefills --prefill-chunk "
        "tokens a step whatever decodes (3)",
    )
    srv.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page (16)")
    srv.add_argument("--seed", type=_seed, default=0, help="sampling seed of the engine (0)")
    srv.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights of a converted GGUF model (float32: exact, and fastest on CPU)",
    )
    srv.add_argument("--cache-dir", default=None, help="where converted GGUF models are kept")
    _add_chat_template_argument(srv)
    _add_weights_arguments(srv)
    srv.add_argument(
        "--speculative",
        choices=("ngram",),
        default=None,
        help="speculative decoding: ngram (prompt lookup: greedy requests emit several "
        "tokens a step when their output repeats their text; the same tokens as without)",
    )
    srv.add_argument(
        "--draft-model",
        default=None,
        metavar="NAME_OR_PATH",
        help="speculative decoding with this smaller model's greedy proposals (it must share "
        "the model's tokenizer); instead of --speculative",
    )
    srv.add_argument(
        "--rank-timeout",
        type=_number(1.0, 86400.0),
        default=None,
        metavar="SECONDS",
        help="tensor parallel (started by mlx.launch): how long a rank waits on the others "
        "before it exits with status 3 (60); only with several ranks",
    )
    srv.add_argument(
        "--num-speculative-tokens",
        type=_int_in(1, 16),
        default=None,
        help="the longest proposal, 1..16 (8 with --speculative ngram, 4 with "
        "--draft-model); only with one of them",
    )
    srv.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="prefill every prompt whole instead of reusing cached pages of a shared prefix",
    )
    srv.add_argument(
        "--state-snapshot-interval",
        type=_positive_int,
        default=None,
        help="models with recurrent state layers: tokens between state snapshots for prefix "
        "reuse, a multiple of --page-size (default: the largest multiple up to 256)",
    )
    srv.add_argument(
        "--state-cache-mib",
        type=_non_negative_int,
        default=None,
        help="models with recurrent state layers: MiB the state snapshots may hold (1024; 0 "
        "keeps none, so no prefix of theirs is reused)",
    )
    add_kv_quantization_arguments(srv)
    srv.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (info)",
    )
    srv.set_defaults(handler=serve_command)
    return top


def add_kv_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kv-bits``, ``--kv-group-size`` and ``--kv-quantize``: quantized KV pages."""
    from kv_protocol import KV_QUANT_BITS, KV_QUANT_GROUP_SIZES, KV_QUANT_LAYERS

    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_QUANT_BITS,
        default=None,
        help="store KV pages quantized to this many bits (sliding-window layers too; "
        "default: the model's dtype)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_QUANT_GROUP_SIZES,
        default=64,
        help="values per quantization group along head_dim (64)",
    )
    parser.add_argument(
        "--kv-quantize",
        choices=KV_QUANT_LAYERS,
        default="all",
        help="which layer kinds --kv-bits quantizes (all)",
    )


def _stall(text: str) -> float | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return _number(0.0, math.inf, low_open=True)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of decode times or 'off', got {text!r}"
        ) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def _add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights-bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="quantize the model's weights at load (MLX affine; on the CPU it saves memory "
        "and costs speed)",
    )
    parser.add_argument(
        "--weights-group-size",
        type=int,
        choices=(32, 64, 128),
        default=None,
        help="weights per quantization group (64); with --weights-bits",
    )
    parser.add_argument(
        "--gguf-weights",
        choices=("auto", "keep", "dual", "embedding", "dequantize"),
        default="auto",
        help="a GGUF's quantized blocks: keep those that are exactly MLX affine groups "
        "(Q8_0, Q4_0/1, Q5_0/1, Q4_K); dual: keep the token embedding so (the tied head, 8 "
        "or 4 bits) and the other layers both in float32 (for prompts) and as the native CPU "
        "kernel's codes (for decode steps of up to 32 rows); keep only the embedding; "
        "dequantize them; or auto (the default: keep on a GPU, dual on the CPU where the "
        "native kernel builds, else dequantize)",
    )


def _add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        default="auto",
        metavar="auto|none|NAME|FILE",
        help="the chat template: auto (the model's own; a Gemma 3 GGUF without one, such as "
        "gemma3-270m, gets the shipped gemma3 template with tools), none (chat refused), a "
        "shipped template's name (gemma3) or a Jinja file",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kv-serve``; bad input is one ``error:`` line and exit status 2.

    It first loads the fast BLAS (:func:`kv_serve.load_fast_blas`; a no-op once ``mlx`` is
    imported), so the command's models run on it.
    """
    load_fast_blas()
    from kv_protocol import KVCacheError

    commands = parser()
    args = commands.parse_args(argv)
    speculates = bool(getattr(args, "speculative", None) or getattr(args, "draft_model", None))
    if getattr(args, "num_speculative_tokens", None) is not None and not speculates:
        commands.error(
            "--num-speculative-tokens needs --speculative or --draft-model (it sizes their "
            "proposals)"
        )
    kept = getattr(args, "gguf_weights", "auto")
    if kept in ("keep", "dual", "embedding") and getattr(args, "weights_bits", None):
        commands.error(
            f"--gguf-weights {kept} keeps the GGUF's quantization; --weights-bits quantizes "
            "float weights: give one"
        )
    if getattr(args, "weights_group_size", None) is not None and not args.weights_bits:
        commands.error("--weights-group-size needs --weights-bits (it sizes its groups)")
    if getattr(args, "speculative", None) and getattr(args, "draft_model", None):
        commands.error("--speculative and --draft-model are two ways to propose: give one")
    try:
        status: int = args.handler(args)
        return status
    except (KVCacheError, OSError, MissingExtraError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
