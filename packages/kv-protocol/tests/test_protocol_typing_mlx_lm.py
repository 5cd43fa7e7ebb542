"""Static and runtime checks that mlx-lm's own caches satisfy the kv_protocol cache protocols.

mypy follows ``mlx_lm.models.cache`` (see the root pyproject's mypy overrides), so the typed
assignments below are checked against mlx-lm's real class definitions.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache as MlxLmKVCache
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from mlx_lm.models.cache import RotatingKVCache as MlxLmRotatingKVCache

from kv_protocol import KVCache, OffsetCache


def test_mlx_lm_caches_satisfy_kv_cache_statically_and_at_runtime() -> None:
    caches: list[KVCache] = [
        MlxLmKVCache(),
        MlxLmRotatingKVCache(max_size=8),
        MlxLmQuantizedKVCache(group_size=64, bits=8),
    ]
    for cache in caches:
        # mlx-lm's QuantizedKVCache.nbytes fails while empty, which a runtime protocol check
        # (it reads every member) would report as "not a KVCache"; give each cache one token.
        k = mx.zeros((1, 2, 1, 64))
        cache.update_and_fetch(k, k)
        assert isinstance(cache, KVCache)
        assert isinstance(cache, OffsetCache)


def test_offset_cache_protocol_is_narrower_than_kv_cache() -> None:
    class OnlyOffset:
        offset = 3
        state = ()

        def make_mask(
            self, N: int, return_array: bool = False, window_size: int | None = None
        ) -> None:
            return None

    shim: OffsetCache = OnlyOffset()
    assert isinstance(shim, OffsetCache)
    assert not isinstance(shim, KVCache)
