"""Batched paged decode for hybrid-attention mlx-lm models: context, attention wrapper, engine."""

from ._attention_spec import AttentionSpec, NormMode
from ._batched_attention import BatchedAttention
from ._cache_nesting import CacheNesting
from ._context import FUSED_ROPE_MAP_ERROR, BatchedDecodeContext, PoolAddressing
from ._decode_paths import DecodePathChoice, DecodePlan, check_batched_decode, plan_decode_paths
from ._engine import (
    DecodeEngine,
    EngineStats,
    PrefillCacheFactory,
    RequestOutput,
    RequestStatus,
    pages_in_use,
)
from ._layer_cache import (
    DECODE_PATHS,
    BatchedLayerCache,
    PoolDecodeCache,
    batched_layer_caches,
    decode_mask,
)
from ._model_forward import LastPositionForward, last_position_forward, vocabulary_size
from ._patching import (
    is_patched,
    patch_model_attention,
    unpatch_model_attention,
    wrap_attention_layer,
)
from ._sampling import sample_top_p, token_key
from ._state_cache import (
    StackedStateCache,
    StateCacheFactory,
    StateSnapshot,
    install_stacked_states,
    model_state_caches,
    request_caches,
    state_nbytes,
)

__all__ = [
    "DECODE_PATHS",
    "FUSED_ROPE_MAP_ERROR",
    "AttentionSpec",
    "BatchedAttention",
    "BatchedDecodeContext",
    "BatchedLayerCache",
    "CacheNesting",
    "DecodeEngine",
    "DecodePathChoice",
    "DecodePlan",
    "EngineStats",
    "LastPositionForward",
    "PrefillCacheFactory",
    "RequestOutput",
    "RequestStatus",
    "StackedStateCache",
    "StateCacheFactory",
    "StateSnapshot",
    "NormMode",
    "PoolAddressing",
    "PoolDecodeCache",
    "batched_layer_caches",
    "check_batched_decode",
    "decode_mask",
    "install_stacked_states",
    "pages_in_use",
    "sample_top_p",
    "state_nbytes",
    "token_key",
    "is_patched",
    "last_position_forward",
    "model_state_caches",
    "patch_model_attention",
    "plan_decode_paths",
    "request_caches",
    "unpatch_model_attention",
    "vocabulary_size",
    "wrap_attention_layer",
]
