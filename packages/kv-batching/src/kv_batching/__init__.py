"""Batched paged decode for hybrid-attention mlx-lm models: context, attention wrapper, engine."""

from ._attention_spec import AttentionSpec, NormMode
from ._batched_attention import BatchedAttention
from ._cache_nesting import CacheNesting
from ._context import FUSED_ROPE_MAP_ERROR, BatchedDecodeContext
from ._decode_paths import (
    DecodePathChoice,
    DecodePlan,
    check_batched_decode,
    choose_decode_paths,
    plan_decode_paths,
)
from ._decode_step import DecodeStep, LayerAddress, LayerStep, PoolAddressing, SubPoolStep
from ._engine import DecodeEngine, PrefillCacheFactory
from ._engine_stats import DEFAULT_STATS_WINDOW, EngineMemoryReport, EngineStats, pages_in_use
from ._layer_cache import (
    DECODE_PATHS,
    BatchedLayerCache,
    PoolDecodeCache,
    batched_layer_caches,
    decode_mask,
)
from ._model_forward import LastPositionForward, last_position_forward, vocabulary_size
from ._model_runner import DecodeOutput, ModelRunner
from ._patching import (
    is_patched,
    patch_model_attention,
    unpatch_model_attention,
    wrap_attention_layer,
    wrapped_attention,
)
from ._prefill_budget import PrefillBudget
from ._requests import RequestOutput, RequestStatus
from ._sampling import Sampler, SamplingRow, sample_top_p, token_key
from ._scheduler import Scheduler
from ._state_cache import (
    StackedStateCache,
    StateCacheFactory,
    StateSnapshot,
    group_by_state_shapes,
    install_stacked_states,
    model_state_caches,
    request_caches,
    request_state_bytes,
    state_nbytes,
    state_shapes,
)

__all__ = [
    "DECODE_PATHS",
    "DEFAULT_STATS_WINDOW",
    "DecodeOutput",
    "DecodeStep",
    "LayerAddress",
    "LayerStep",
    "ModelRunner",
    "Sampler",
    "SamplingRow",
    "Scheduler",
    "SubPoolStep",
    "FUSED_ROPE_MAP_ERROR",
    "AttentionSpec",
    "BatchedAttention",
    "BatchedDecodeContext",
    "BatchedLayerCache",
    "CacheNesting",
    "DecodeEngine",
    "DecodePathChoice",
    "DecodePlan",
    "EngineMemoryReport",
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
    "PrefillBudget",
    "PoolDecodeCache",
    "batched_layer_caches",
    "check_batched_decode",
    "choose_decode_paths",
    "decode_mask",
    "install_stacked_states",
    "pages_in_use",
    "sample_top_p",
    "state_nbytes",
    "state_shapes",
    "group_by_state_shapes",
    "token_key",
    "is_patched",
    "last_position_forward",
    "model_state_caches",
    "patch_model_attention",
    "plan_decode_paths",
    "request_caches",
    "request_state_bytes",
    "unpatch_model_attention",
    "vocabulary_size",
    "wrap_attention_layer",
    "wrapped_attention",
]
