"""is_storage_backed and to_contiguous."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kv_caches import (
    AttentionOffsetCache,
    ContiguousAttentionKVCache,
    WindowedAttentionKVCache,
    is_storage_backed,
    to_contiguous,
)
from kv_protocol import CacheStateError


def test_is_storage_backed() -> None:
    assert is_storage_backed(ContiguousAttentionKVCache())
    assert is_storage_backed(WindowedAttentionKVCache(4))
    assert is_storage_backed(KVCache()) and is_storage_backed(RotatingKVCache(4))
    assert not is_storage_backed(AttentionOffsetCache(3))
    assert not is_storage_backed(None) and not is_storage_backed(object())


def test_to_contiguous() -> None:
    k = mx.random.normal((1, 2, 5, 4))
    contiguous = ContiguousAttentionKVCache()
    contiguous.update_and_fetch(k, -k)
    assert to_contiguous(contiguous) is contiguous

    windowed = WindowedAttentionKVCache(8)
    windowed.update_and_fetch(k, -k)
    converted = to_contiguous(windowed, max_seq_len=16)
    assert converted.offset == 5 and converted.capacity == 16
    assert mx.array_equal(converted.get_kv()[1], -k).item()
    assert to_contiguous(WindowedAttentionKVCache(8)).offset == 0

    windowed.update_and_fetch(mx.zeros((1, 2, 20, 4)), mx.zeros((1, 2, 20, 4)))
    windowed.write_token(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert windowed.has_dropped_history
    with pytest.raises(CacheStateError, match="cannot be converted"):
        to_contiguous(windowed)
    with pytest.raises(CacheStateError, match="holds no K/V"):
        to_contiguous(AttentionOffsetCache(4))
    with pytest.raises(CacheStateError, match="does not know"):
        to_contiguous(KVCache())
