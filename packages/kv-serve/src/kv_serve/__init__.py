"""The composition root: build engines, load models (mlx-lm dirs, GGUF), generate text.

Importing it on Linux before ``mlx`` loads a fast BLAS for MLX's CPU backend (see
:func:`load_fast_blas`; ``KV_SERVE_BLAS=off`` keeps MLX's reference one).
"""

# ``_blas`` loads the BLAS when it is imported, so it must stay the first import (it sorts
# first): the modules after it import mlx.
from ._blas import BLAS_ENV, BlasError, BlasInfo, active_blas, load_fast_blas
from ._engine import build_engine, build_kernels, build_pool, pool_backed_cache
from ._generate import GenerationStats, TextStream, generate
from ._gguf import GEMMA3_HARD_CODED, convert_gguf, gguf_sha256, read_gguf_tensor
from ._load import GEMMA3_270M, default_cache_dir, encode_prompt, load_model, stop_token_ids
from ._server import KVServer, RunningServer, ServerMetrics

__all__ = [
    "BLAS_ENV",
    "GEMMA3_270M",
    "GEMMA3_HARD_CODED",
    "BlasError",
    "BlasInfo",
    "GenerationStats",
    "KVServer",
    "RunningServer",
    "ServerMetrics",
    "TextStream",
    "active_blas",
    "build_engine",
    "build_kernels",
    "build_pool",
    "cli_main",
    "convert_gguf",
    "default_cache_dir",
    "encode_prompt",
    "generate",
    "gguf_sha256",
    "load_fast_blas",
    "load_model",
    "pool_backed_cache",
    "read_gguf_tensor",
    "stop_token_ids",
]


def cli_main(argv: list[str] | None = None) -> int:
    """Run the ``kv-serve`` command line with ``argv``; returns the exit status."""
    from ._cli import main

    return main(argv)
