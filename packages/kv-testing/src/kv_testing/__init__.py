"""Test support for the kv-* packages (not a toolkit package, never a run-time dependency).

Tiny random-weight models of real hybrid architectures, built from mlx-lm's own ``Model``
classes with small configurations; nothing is downloaded. The member tests, the cross-package
tests, the demo and the benchmarks build their models here. ``ReferenceKVPool`` is the one
plain-Python ``KVPool`` the packages' tests share; ``stored_kv_caches`` is the oracle for
quantized pools (mlx-lm's caches storing what quantized pages give back). ``mlx_lm_greedy`` is
the one greedy oracle: mlx-lm generating one prompt alone with its own model and caches.
"""

from ._mlx_lm_zoo import ZOO, ZOO_UNBUILDABLE, ZooEntry, build_zoo_model, zoo_config
from ._oracle import greedy_continue, mlx_lm_greedy, mlx_lm_states, states_close
from ._reference_pool import ReferenceBookkeeping, ReferenceKVPool
from ._stored_kv_caches import stored_kv_caches
from ._tiny_model_dir import save_tiny_model_dir, save_zoo_model_dir
from ._tiny_models import ARCHITECTURES, build_tiny_model, tiny_model_config
from ._tiny_tokenizer import (
    TINY_CHAT_TEMPLATE,
    TINY_HARMONY_CHAT_TEMPLATE,
    TINY_HARMONY_TOKENS,
    TINY_SPECIAL_TOKENS,
    TINY_TOOL_CHAT_TEMPLATE,
    build_tiny_tokenizer,
)

__all__ = [
    "ARCHITECTURES",
    "TINY_CHAT_TEMPLATE",
    "TINY_HARMONY_CHAT_TEMPLATE",
    "TINY_HARMONY_TOKENS",
    "TINY_TOOL_CHAT_TEMPLATE",
    "TINY_SPECIAL_TOKENS",
    "ZOO",
    "ZOO_UNBUILDABLE",
    "ReferenceBookkeeping",
    "ReferenceKVPool",
    "ZooEntry",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_zoo_model",
    "greedy_continue",
    "mlx_lm_greedy",
    "mlx_lm_states",
    "save_tiny_model_dir",
    "save_zoo_model_dir",
    "states_close",
    "stored_kv_caches",
    "tiny_model_config",
    "zoo_config",
]
