"""Masks and the data-free offset cache against mlx-lm's own caches."""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask as mlx_lm_container_mask
from mlx_lm.models.cache import KVCache

from kv_caches import AttentionOffsetCache, causal_band_mask, make_attention_mask
from kv_protocol import CacheStateError, KVCacheError, OffsetCache


def assert_same_mask(ours: Any, theirs: Any) -> None:
    if theirs is None or isinstance(theirs, str):
        assert ours == theirs
        return
    assert isinstance(ours, mx.array)
    assert ours.dtype == theirs.dtype
    assert ours.shape == theirs.shape
    assert mx.array_equal(ours, theirs).item()


def mlx_lm_mask_at(offset: int, N: int, return_array: bool, window_size: int | None) -> Any:
    cache = KVCache()
    cache.offset = offset
    return cache.make_mask(N, return_array=return_array, window_size=window_size)


WINDOW = 8
OFFSETS = [0, 1, 3, WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW - 1, 2 * WINDOW, 37]
GRID = list(itertools.product([1, 4, 16], OFFSETS, [None, 4, WINDOW], [False, True]))


@pytest.mark.parametrize(("N", "offset", "window_size", "return_array"), GRID)
def test_offset_cache_mask_is_mlx_lm_mask(
    N: int, offset: int, window_size: int | None, return_array: bool
) -> None:
    theirs = mlx_lm_mask_at(offset, N, return_array, window_size)
    assert_same_mask(make_attention_mask(N, offset, return_array, window_size), theirs)
    cache = AttentionOffsetCache(offset)
    assert_same_mask(cache.make_mask(N, return_array=return_array, window_size=window_size), theirs)
    # The container helper routes through make_mask the same way.
    h = mx.zeros((1, N, 4))
    assert_same_mask(
        mlx_lm_container_mask(h, cache, window_size=window_size, return_array=return_array),
        theirs,
    )


def test_band_keeps_window_keys_including_self() -> None:
    mask = causal_band_mask(1, 200, 128)
    assert mask.shape == (1, 201)
    assert mask.sum().item() == 128
    assert mask[0, 200].item() and mask[0, 73].item() and not mask[0, 72].item()
    # N = 1 with a window is an array, never None (mlx-lm's KVCache gives one too).
    assert isinstance(make_attention_mask(1, 200, window_size=128), mx.array)


def test_offset_cache_is_data_free() -> None:
    cache = AttentionOffsetCache(5)
    assert isinstance(cache, OffsetCache)
    assert cache.state == ()
    mx.eval(cache.state)
    assert cache.nbytes == 0 and cache.empty() and cache.size() == 0
    with pytest.raises(RuntimeError) as info:
        cache.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert str(info.value) == "AttentionOffsetCache should not store data"
    assert isinstance(info.value, CacheStateError)
    assert cache.offset == 5
    cache.offset = 9
    assert cache.offset == 9
    assert cache.trim(4) == 4 and cache.offset == 5
    cache.state = ()
    with pytest.raises(CacheStateError):
        cache.state = (mx.zeros(1),)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_offset_cache_rejects_bad_offsets(bad: Any) -> None:
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        AttentionOffsetCache(bad)
    cache = AttentionOffsetCache(2)
    with pytest.raises(KVCacheError):
        cache.offset = bad
    assert cache.offset == 2


def test_offset_cache_trim_bounds() -> None:
    cache = AttentionOffsetCache(3)
    for n in (-1, 4):
        with pytest.raises(CacheStateError, match="cannot trim"):
            cache.trim(n)
    assert cache.offset == 3


@pytest.mark.parametrize(
    ("N", "offset", "window_size"), [(0, 0, None), (1, -1, None), (2, 0, 0), (1, 0, -3)]
)
def test_mask_arguments_are_checked(N: int, offset: int, window_size: int | None) -> None:
    with pytest.raises(ValueError):
        make_attention_mask(N, offset, window_size=window_size)
