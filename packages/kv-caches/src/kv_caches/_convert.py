"""Helpers that classify caches and convert them to a contiguous cache."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import CacheStateError

from ._checks import check_positive
from ._contiguous import ContiguousAttentionKVCache
from ._offset import AttentionOffsetCache
from ._pool_backed import PoolBackedKVCache
from ._quantized import QuantizedAttentionKVCache
from ._storage import StorageCache
from ._windowed import WindowedAttentionKVCache

__all__ = ["is_storage_backed", "to_contiguous"]


def is_storage_backed(cache: object) -> bool:
    """True if ``cache`` keeps the K/V in arrays of its own.

    True for the contiguous, windowed and quantized caches of this package (and for any
    other object with ``update_and_fetch`` and ``keys``/``values`` attributes, such as
    mlx-lm's caches); False for the data-free ``AttentionOffsetCache``, for a
    ``PoolBackedKVCache`` (its K/V live in the pool) and for anything that is not a cache.
    """
    if isinstance(cache, StorageCache):  # the contiguous, windowed and quantized caches
        return True
    if isinstance(cache, AttentionOffsetCache | PoolBackedKVCache):
        return False
    return (
        callable(getattr(cache, "update_and_fetch", None))
        and hasattr(cache, "keys")
        and hasattr(cache, "values")
    )


def to_contiguous(cache: object, *, max_seq_len: int | None = None) -> ContiguousAttentionKVCache:
    """A ``ContiguousAttentionKVCache`` holding the same tokens at the same offset.

    A contiguous cache is returned as it is. A windowed cache converts only while it still
    holds every token since position 0, a quantized cache is dequantized, a pool-backed cache
    is read from the pool. ``max_seq_len`` (an ``int >= 1``, else ``LayoutError``) sets the
    initial capacity of the new cache (default: 4096, or the tokens held if more). Raises
    ``CacheStateError`` for a windowed cache that has dropped history, for an
    ``AttentionOffsetCache`` and for unknown objects.
    """
    initial = 4096 if max_seq_len is None else check_positive("max_seq_len", max_seq_len)
    if isinstance(cache, ContiguousAttentionKVCache):
        return cache
    keys: mx.array | None
    values: mx.array | None
    if isinstance(cache, WindowedAttentionKVCache):
        if cache.has_dropped_history:
            raise CacheStateError(
                f"WindowedAttentionKVCache holds only the last {cache.held} of {cache.offset} "
                "tokens; it cannot be converted to a contiguous cache"
            )
        keys, values = cache.get_kv(max(cache.offset, 1)) if cache.offset else (None, None)
    elif isinstance(cache, QuantizedAttentionKVCache):
        keys, values = cache.dequantized() if cache.offset else (None, None)
    elif isinstance(cache, PoolBackedKVCache):
        keys, values = cache.to_arrays() if cache.offset else (None, None)
    elif isinstance(cache, AttentionOffsetCache):
        raise CacheStateError(
            "AttentionOffsetCache holds no K/V; there is nothing to convert to a contiguous cache"
        )
    else:
        raise CacheStateError(
            f"to_contiguous does not know how to read the K/V of {type(cache).__name__}; "
            "expected a cache of kv_caches"
        )
    n_tokens = 0 if keys is None else int(keys.shape[2])
    capacity = max(initial, n_tokens)
    out = ContiguousAttentionKVCache(max_seq_len=capacity)
    if keys is not None and values is not None:
        out.update_and_fetch(keys, values)
    return out
