"""Batched paged decode for hybrid-attention mlx-lm models: the decode engine and its parts.

:class:`DecodeEngine` serves many requests on one model through any ``kv_protocol.KVPool``:
admission by pool capacity, chunked prefill, one batched decode per step, one pool reservation
per decode batch and per prefill chunk, and speculative decoding (:class:`SpeculationConfig`,
:class:`NgramProposer`); its settings are one :class:`EngineConfig`.
:class:`BatchedDecodeContext` is the padding and position arithmetic of one batched step;
:func:`patch_model_attention` wraps a model's attention modules for the paged fast path;
every change the engine makes to a model is a :class:`ModelChange`, installed, engaged and
undone through one :class:`ModelSurgery`.
Everything else (the step's phases, the scheduler, the runner, the per-layer decode caches,
the recurrent-state helpers) stays importable from the private modules.
"""

from ._agreement import RankAgreement
from ._context import FUSED_ROPE_MAP_ERROR, BatchedDecodeContext
from ._decode_paths import DecodePlan
from ._decode_step import DecodeRoute
from ._engine import DEFAULT_STATE_CACHE_BYTES, DecodeEngine, PrefillCacheFactory
from ._engine_config import EngineConfig
from ._engine_stats import EngineMemoryReport, EngineStats
from ._model_forward import last_position_forward, vocabulary_size
from ._model_surgery import ChangeReport, EngagedChange, ModelChange, ModelSurgery
from ._patching import is_patched, patch_model_attention, unpatch_model_attention
from ._requests import RequestOutput, RequestStatus
from ._sampling_params import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ._speculative import (
    MAX_SPECULATIVE_TOKENS,
    BatchProposer,
    NgramProposer,
    Proposer,
    SpeculationConfig,
)
from ._state_cache import StateCacheFactory
from ._state_snapshots import StateSnapshotStats

__all__ = [
    "DEFAULT_STATE_CACHE_BYTES",
    "FUSED_ROPE_MAP_ERROR",
    "MAX_LOGPROBS",
    "MAX_SPECULATIVE_TOKENS",
    "BatchProposer",
    "BatchedDecodeContext",
    "ChangeReport",
    "DecodeEngine",
    "DecodePlan",
    "DecodeRoute",
    "EngagedChange",
    "EngineConfig",
    "EngineMemoryReport",
    "EngineStats",
    "ModelChange",
    "ModelSurgery",
    "NgramProposer",
    "PrefillCacheFactory",
    "Proposer",
    "RankAgreement",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SpeculationConfig",
    "StateCacheFactory",
    "StateSnapshotStats",
    "TokenLogprob",
    "is_patched",
    "last_position_forward",
    "patch_model_attention",
    "unpatch_model_attention",
    "vocabulary_size",
]
