"""What the ``kv-serve`` commands do once their arguments are parsed: generate and serve.

:func:`server_config` turns ``serve``'s arguments into the one ``ServerConfig`` the server,
``build_engine`` and the engine take. The parser is :mod:`kv_serve._cli`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._extras import require_extra
from ._sizes import DRAFT_SPECULATIVE_TOKENS, NGRAM_SPECULATIVE_TOKENS

__all__ = [
    "SERVE_MIB_OPTIONS",
    "SERVE_PROCESS_OPTIONS",
    "generate_command",
    "serve_command",
    "server_config",
]


def generate_command(args: argparse.Namespace) -> int:
    """``kv-serve generate``: stream one prompt's completion (or print it whole)."""
    import time

    from ._generate import GenerationStats, complete, generate

    def progress(message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    from ._blas import active_blas
    from ._cpu_jit import active_cpu_jit

    start = time.perf_counter()
    model, tokenizer = _load_model(args, progress)
    progress(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    progress(f"BLAS: {active_blas().describe()}")
    progress(f"compiled kernels: {active_cpu_jit().describe()}")
    progress(f"native CPU kernels: {_native_kernels(model)}")
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "logprobs": args.logprobs,
        "seed": args.seed,
        "chat": args.chat,
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "kv_quantize": args.kv_quantize,
    }
    if args.n > 1:
        completions = complete(model, tokenizer, args.prompt, n=args.n, **sampling)
        for i, done in enumerate(completions):
            sys.stdout.write(
                f"--- completion {i + 1} of {args.n} ({len(done.tokens)} tokens, finish: "
                f"{done.finish_reason}) ---\n{done.text}\n"
            )
            if done.logprobs is not None:
                _print_logprobs(tokenizer, done.logprobs)
        sys.stdout.flush()
        return 0
    stats = GenerationStats()
    for piece in generate(model, tokenizer, args.prompt, stats=stats, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.logprobs is not None:
        _print_logprobs(tokenizer, stats.logprobs)
    progress(
        f"prompt {stats.prompt_tokens} tokens ({stats.prefill_tokens_per_s:.1f} tok/s), "
        f"generated {stats.generated_tokens} ({stats.decode_tokens_per_s:.1f} tok/s), "
        f"finish: {stats.finish_reason}"
    )
    return 0


def _print_logprobs(tokenizer: Any, entries: Sequence[Any]) -> None:
    """One line per token: its text, its logprob, and its alternatives with theirs."""
    from ._server_text import TokenTexts

    texts = TokenTexts(tokenizer)
    sys.stdout.write("logprobs (token, logprob, alternatives):\n")
    for entry in entries:
        alternatives = ", ".join(f"{texts.text(t)!r} {lp:.4f}" for t, lp in entry.top)
        sys.stdout.write(f"{texts.text(entry.token)!r}\t{entry.logprob:.4f}\t{alternatives}\n")
    sys.stdout.flush()


def serve_command(args: argparse.Namespace) -> int:
    """``kv-serve serve``: load the model and serve its HTTP APIs until interrupted."""
    import logging
    import time

    require_extra("server")
    from ._blas import active_blas
    from ._cpu_jit import active_cpu_jit
    from ._server import KVServer

    def progress(message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    ranks = _ranks(args)
    if ranks is not None:
        rank = ranks.rank

        def progress(message: str) -> None:
            sys.stderr.write(f"rank {rank}: {message}\n")
            sys.stderr.flush()

        progress(f"rank {rank} of {ranks.size} (tensor parallel; rank 0 serves HTTP)")
    start = time.perf_counter()
    # Several ranks read only their share of each tensor (lazily, at sharding).
    model, tokenizer = _load_model(args, progress, lazy=ranks is not None)
    progress(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    progress(f"BLAS: {active_blas().describe()}")
    progress(f"compiled kernels: {active_cpu_jit().describe()}")
    progress(f"native CPU kernels: {_native_kernels(model)}")
    if ranks is not None:
        from ._sharding import shard_model

        probed = shard_model(model, ranks.group)
        checked = "its probe logits equal" if probed else "too large to probe whole"
        progress(f"model sharded over {ranks.size} ranks ({checked})")
    speculative = _speculation(args, model, tokenizer, progress)
    server = KVServer(model, tokenizer, server_config(args, speculative), ranks=ranks)
    if ranks is not None and not ranks.is_leader:
        progress("following rank 0")
        server.follow()
        progress("rank 0 stopped serving")
    else:
        progress(f"serving {server.model_name!r} on http://{args.host}:{args.port}/v1")
        server.serve(args.host, args.port, log_level=args.log_level)
    # The engine thread has stopped and been joined. MLX used from a thread other than the
    # main one can still abort in its static destructors at interpreter exit ("terminate
    # called without an active exception", ml-explore/mlx#3126), so the command ends the
    # process here, after flushing, with the status a clean shutdown has.
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: ``serve`` options that are not settings of the served model (the process's and its ranks',
#: how the model is loaded, speculation's choice): every other option is a field of
#: ``ServerConfig`` or of its parts.
SERVE_PROCESS_OPTIONS = frozenset(
    {
        "command",
        "model",
        "host",
        "port",
        "log_level",
        "cache_dir",
        "served_model_name",
        "chat_template",
        "gguf_weights",
        "dtype",
        "weights_bits",
        "weights_group_size",
        "rank_timeout",
        "speculative",
        "draft_model",
        "num_speculative_tokens",
    }
)

#: ``serve`` options given in MiB, and the config field each sets in bytes.
SERVE_MIB_OPTIONS = {
    "kv_budget_mib": "kv_budget_bytes",
    "kv_slab_mib": "kv_slab_bytes",
    "state_cache_mib": "state_cache_bytes",
}


def server_config(args: argparse.Namespace, speculative: Any = None) -> Any:
    """The ``ServerConfig`` of a parsed ``serve`` command line (built once, here).

    ``speculative`` is the speculation ``--speculative`` / ``--draft-model`` chose.
    """
    from kv_batching import EngineConfig

    from ._config import PoolConfig, ServerConfig

    def mib(value: int | None) -> int | None:
        return None if value is None else value * 2**20

    return ServerConfig(
        model_name=args.served_model_name or args.model,
        max_queued=args.max_queued,
        max_tokens_default=args.max_tokens_default,
        speculative=speculative,
        num_speculative_tokens=_speculative_tokens(args, NGRAM_SPECULATIVE_TOKENS),
        engine=EngineConfig(
            max_running=args.max_running,
            prefill_chunk=args.prefill_chunk,
            seed=args.seed,
            prefix_caching=args.prefix_caching,
            prefill_stall=args.prefill_stall,
            state_snapshot_interval=args.state_snapshot_interval,
            state_cache_bytes=mib(args.state_cache_mib),
        ),
        pool=PoolConfig(
            max_context=args.max_context,
            kv_budget_bytes=mib(args.kv_budget_mib),
            page_size=args.page_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            kv_quantize=args.kv_quantize,
            # 0 MiB: the whole budget at start.
            kv_slab_bytes=mib(args.kv_slab_mib) or None,
        ),
    )


def _ranks(args: argparse.Namespace) -> Any:
    """The tensor-parallel ``RankGroup`` of this process (``None`` alone); bad uses refused."""
    from kv_protocol import UnsupportedModelError

    from ._ranks import init_ranks

    timeout = 60.0 if args.rank_timeout is None else float(args.rank_timeout)
    ranks = init_ranks(timeout=timeout)
    if ranks is None:
        if args.rank_timeout is not None:
            raise UnsupportedModelError(
                "--rank-timeout is for tensor parallel: start kv-serve under mlx.launch (or "
                "with MLX_HOSTFILE and MLX_RANK) to run several ranks"
            )
        return None
    if args.speculative or args.draft_model:
        raise UnsupportedModelError(
            f"rank {ranks.rank}: speculative decoding does not run on tensor-parallel ranks "
            "(drop --speculative / --draft-model, or serve on one rank)"
        )
    return ranks


def _native_kernels(model: Any) -> str:
    """What the CPU's native quantized kernel is (built, or why not) and the layers using it."""
    import mlx.core as mx

    from ._kernel_linears import KernelLinear, linear_kernel

    if mx.default_device().type != mx.cpu:
        return "none on this device (MLX's own kernels)"
    layers = sum(isinstance(m, KernelLinear) for _, m in model.named_modules())
    return f"{linear_kernel().library.describe()}; {layers} linear layers read its codes"


def _load_model(
    args: argparse.Namespace, progress: Callable[[str], None], *, lazy: bool = False
) -> tuple[Any, Any]:
    """The model and tokenizer the command's options name."""
    from ._load import load_model

    return load_model(
        args.model,
        lazy=lazy,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        progress=progress,
        chat_template=args.chat_template,
        weights_bits=args.weights_bits,
        weights_group_size=args.weights_group_size or 64,
        gguf_weights=args.gguf_weights,
    )


def _speculation(
    args: argparse.Namespace, model: Any, tokenizer: Any, progress: Callable[[str], None]
) -> Any:
    """``--speculative`` as given, or a draft model's speculation (``--draft-model``)."""
    if args.draft_model is None:
        return args.speculative
    from kv_protocol import UnsupportedModelError

    from ._draft import draft_speculation
    from ._load import load_model

    draft, draft_tokenizer = load_model(args.draft_model, dtype=args.dtype, progress=progress)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UnsupportedModelError(
            f"the draft model {args.draft_model!r} has another tokenizer than {args.model!r} "
            "(their vocabularies differ): a draft must share the served model's tokenizer"
        )
    progress(f"draft model {args.draft_model} loaded")
    return draft_speculation(
        draft,
        model,
        num_tokens=_speculative_tokens(args, DRAFT_SPECULATIVE_TOKENS),
        max_running=args.max_running,
        max_context=args.max_context,
    )


def _speculative_tokens(args: argparse.Namespace, default: int) -> int:
    """``--num-speculative-tokens``, else the proposer's ``default``.

    :func:`main` refuses the option without a proposer.
    """
    return default if args.num_speculative_tokens is None else int(args.num_speculative_tokens)
