"""The composition root: build engines, load models (mlx-lm dirs, GGUF), generate text."""

from ._engine import build_engine, build_kernels, build_pool, pool_backed_cache
from ._generate import GenerationStats, TextStream, generate
from ._gguf import GEMMA3_HARD_CODED, convert_gguf, gguf_sha256, read_gguf_tensor
from ._load import GEMMA3_270M, default_cache_dir, encode_prompt, load_model, stop_token_ids

__all__ = [
    "GEMMA3_270M",
    "GEMMA3_HARD_CODED",
    "GenerationStats",
    "TextStream",
    "build_engine",
    "build_kernels",
    "build_pool",
    "convert_gguf",
    "default_cache_dir",
    "encode_prompt",
    "generate",
    "gguf_sha256",
    "load_model",
    "pool_backed_cache",
    "read_gguf_tensor",
    "stop_token_ids",
]
