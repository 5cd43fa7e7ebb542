"""Batched paged decode for hybrid-attention mlx-lm models: context, attention wrapper, engine."""

from ._context import FUSED_ROPE_MAP_ERROR, BatchedDecodeContext, PoolAddressing
from ._engine import (
    DecodeEngine,
    EngineStats,
    LastPositionForward,
    PrefillCacheFactory,
    RequestOutput,
    RequestStatus,
    last_position_forward,
    pages_in_use,
    sample_top_p,
    vocabulary_size,
)
from ._layer_cache import BatchedLayerCache, batched_layer_caches
from ._wrapper import (
    AttentionSpec,
    BatchedAttention,
    NormMode,
    is_patched,
    patch_model_attention,
    unpatch_model_attention,
)

__all__ = [
    "FUSED_ROPE_MAP_ERROR",
    "AttentionSpec",
    "BatchedAttention",
    "BatchedDecodeContext",
    "BatchedLayerCache",
    "DecodeEngine",
    "EngineStats",
    "LastPositionForward",
    "PrefillCacheFactory",
    "RequestOutput",
    "RequestStatus",
    "NormMode",
    "PoolAddressing",
    "batched_layer_caches",
    "pages_in_use",
    "sample_top_p",
    "is_patched",
    "last_position_forward",
    "patch_model_attention",
    "unpatch_model_attention",
    "vocabulary_size",
]
