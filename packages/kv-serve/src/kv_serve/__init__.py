"""The composition root: build engines, load models (mlx-lm dirs, GGUF), generate text.

Importing this package imports nothing heavy: each public name is imported on first access,
so ``from kv_serve import build_engine`` imports the toolkit packages and mlx, and neither the
HTTP stack (``KVServer``: the ``server`` extra) nor the GGUF reader (``convert_gguf``: the
``gguf`` extra). Using a part without its extra raises an ``ImportError`` that names it.

On Linux an entry point calls :func:`load_fast_blas` before ``mlx`` is imported to give
MLX's CPU backend a fast BLAS; importing this package loads none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._blas import BLAS_ENV, BlasError, BlasInfo, active_blas, load_fast_blas
from ._cpu_jit import JIT_FLAGS_ENV, CpuJitInfo, active_cpu_jit, configure_cpu_jit
from ._extras import require_extra
from ._sizes import DEFAULT_KV_SLAB_BYTES, DRAFT_SPECULATIVE_TOKENS, NGRAM_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from ._chat_templates import CHAT_TEMPLATES, GEMMA3_CHAT_TEMPLATE, ChatTemplate
    from ._config import PoolConfig, ServerConfig
    from ._draft import DraftModelProposer, EngineDraftProposer, draft_speculation
    from ._engine import (
        build_engine,
        build_kernels,
        build_pool,
        pool_backed_cache,
    )
    from ._generate import Completion, GenerationStats, TextStream, complete, generate
    from ._gguf import GEMMA3_HARD_CODED, convert_gguf, gguf_sha256, read_gguf_tensor
    from ._load import GEMMA3_270M, default_cache_dir, encode_prompt, load_model, stop_token_ids
    from ._lockstep import LockstepEngine
    from ._ranks import RANK_LOST_EXIT, RankGroup, RankLostError, init_ranks
    from ._server import KVServer, RunningServer, ServerMetrics
    from ._sharding import shard_model

__all__ = [
    "BLAS_ENV",
    "CHAT_TEMPLATES",
    "DEFAULT_KV_SLAB_BYTES",
    "DRAFT_SPECULATIVE_TOKENS",
    "GEMMA3_270M",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_HARD_CODED",
    "JIT_FLAGS_ENV",
    "NGRAM_SPECULATIVE_TOKENS",
    "RANK_LOST_EXIT",
    "BlasError",
    "BlasInfo",
    "ChatTemplate",
    "Completion",
    "CpuJitInfo",
    "DraftModelProposer",
    "EngineDraftProposer",
    "GenerationStats",
    "KVServer",
    "LockstepEngine",
    "PoolConfig",
    "RankGroup",
    "RankLostError",
    "RunningServer",
    "ServerConfig",
    "ServerMetrics",
    "TextStream",
    "active_blas",
    "active_cpu_jit",
    "build_engine",
    "build_kernels",
    "build_pool",
    "cli_main",
    "complete",
    "configure_cpu_jit",
    "convert_gguf",
    "default_cache_dir",
    "draft_speculation",
    "encode_prompt",
    "generate",
    "gguf_sha256",
    "init_ranks",
    "load_fast_blas",
    "load_model",
    "pool_backed_cache",
    "read_gguf_tensor",
    "shard_model",
    "stop_token_ids",
]

#: Each lazily imported public name: (its module, the optional extra that module needs).
_LAZY: dict[str, tuple[str, str | None]] = {
    **dict.fromkeys(
        ("CHAT_TEMPLATES", "GEMMA3_CHAT_TEMPLATE", "ChatTemplate"), ("_chat_templates", None)
    ),
    **dict.fromkeys(
        ("DraftModelProposer", "EngineDraftProposer", "draft_speculation"), ("_draft", None)
    ),
    **dict.fromkeys(
        ("build_engine", "build_kernels", "build_pool", "pool_backed_cache"), ("_engine", None)
    ),
    **dict.fromkeys(
        ("Completion", "GenerationStats", "TextStream", "complete", "generate"),
        ("_generate", None),
    ),
    **dict.fromkeys(
        ("GEMMA3_HARD_CODED", "convert_gguf", "gguf_sha256", "read_gguf_tensor"),
        ("_gguf", "gguf"),
    ),
    **dict.fromkeys(
        ("GEMMA3_270M", "default_cache_dir", "encode_prompt", "load_model", "stop_token_ids"),
        ("_load", None),
    ),
    **dict.fromkeys(("KVServer", "RunningServer", "ServerMetrics"), ("_server", "server")),
    "LockstepEngine": ("_lockstep", None),
    **dict.fromkeys(("PoolConfig", "ServerConfig"), ("_config", None)),
    **dict.fromkeys(
        ("RANK_LOST_EXIT", "RankGroup", "RankLostError", "init_ranks"), ("_ranks", None)
    ),
    "shard_model": ("_sharding", None),
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562); later lookups are direct."""
    try:
        module, extra = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if extra is not None:
        require_extra(extra)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))


def cli_main(argv: list[str] | None = None) -> int:
    """Run the ``kv-serve`` command line with ``argv``; returns the exit status."""
    from ._cli import main

    return main(argv)
