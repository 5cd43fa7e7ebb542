"""Per-request KV caches that mlx-lm models accept unchanged.

Every cache follows mlx-lm's cache protocol (``offset``, ``state``, ``make_mask``,
``update_and_fetch``, ``is_trimmable``, ``trim``, ``nbytes``, ``empty``) with shapes
``(B, n_kv_heads, S, head_dim)``.
"""

from ._contiguous import ContiguousAttentionKVCache
from ._convert import is_storage_backed, to_contiguous
from ._masks import causal_band_mask, make_attention_mask
from ._offset import AttentionOffsetCache
from ._pool_backed import PoolBackedKVCache
from ._quantized import QuantizedAttentionKVCache
from ._windowed import WindowedAttentionKVCache

__all__ = [
    "AttentionOffsetCache",
    "ContiguousAttentionKVCache",
    "PoolBackedKVCache",
    "QuantizedAttentionKVCache",
    "WindowedAttentionKVCache",
    "causal_band_mask",
    "is_storage_backed",
    "make_attention_mask",
    "to_contiguous",
]
