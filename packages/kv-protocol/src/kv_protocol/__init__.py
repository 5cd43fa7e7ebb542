"""Typed contracts, layer specs, the layer-id layout and the errors of the kv-* packages."""

from ._errors import (
    CacheStateError,
    InvalidPageError,
    KernelUnavailableError,
    KVCacheError,
    LayerKindError,
    LayoutError,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    TransferTimeoutError,
    UnknownRequestError,
    UnsupportedModelError,
)
from ._layer_spec import KVGeometry, LayerKind, LayerSpec
from ._layout import CacheLayout
from ._model_layout import (
    attention_module,
    find_layers,
    language_model_container,
    layout_from_model,
    model_args,
)
from ._protocols import (
    DecodeKVCache,
    KernelSet,
    KVCache,
    KVPool,
    LayerTransferCounter,
    MaskSpec,
    OffsetCache,
    PageAllocator,
    PagedDecodeAttention,
    RopeScatterKernel,
)
from ._rope import RopeConfig

__all__ = [
    "CacheLayout",
    "CacheStateError",
    "DecodeKVCache",
    "InvalidPageError",
    "KVCache",
    "KVCacheError",
    "KVGeometry",
    "KVPool",
    "KernelSet",
    "KernelUnavailableError",
    "LayerKind",
    "LayerKindError",
    "LayerSpec",
    "LayerTransferCounter",
    "LayoutError",
    "MaskSpec",
    "OffsetCache",
    "PageAllocator",
    "PagedDecodeAttention",
    "PoolExhaustedError",
    "RequestStateError",
    "RopeConfig",
    "RopeScatterKernel",
    "ShapeMismatchError",
    "TransferTimeoutError",
    "UnknownRequestError",
    "UnsupportedModelError",
    "attention_module",
    "find_layers",
    "language_model_container",
    "layout_from_model",
    "model_args",
]
