"""A failed PoolBackedKVCache call leaves the request and the cache exactly as they were."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kv_caches import PoolBackedKVCache
from kv_pool import HybridKVPool
from kv_pool._inspect import num_free_pages, sub_pool_names
from kv_protocol import CacheLayout, KVCacheError, LayerKind, LayerSpec, ShapeMismatchError


def make_pool() -> HybridKVPool:
    layout = CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=4, n_kv_heads=2, head_dim=4),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4),
        ]
    )
    return HybridKVPool(layout, num_pages=16, page_size=2)


def state(pool: HybridKVPool, caches: list[PoolBackedKVCache]) -> Any:
    return (
        pool.seq_len(0),
        [num_free_pages(pool, n) for n in sub_pool_names(pool)],
        [c.offset for c in caches],
    )


def kv(n: int, dtype: mx.Dtype = mx.float32, heads: int = 2) -> mx.array:
    return mx.random.normal((1, heads, n, 4)).astype(dtype)


@pytest.mark.parametrize(
    "bad",
    [
        lambda n: (kv(n, mx.float16), kv(n, mx.float16)),
        lambda n: (kv(n, heads=3), kv(n, heads=3)),
        lambda n: (kv(n)[0], kv(n)[0]),
        lambda n: (kv(n), kv(n + 1)),
    ],
)
def test_bad_arrays_change_nothing(bad: Any) -> None:
    pool = make_pool()
    pool.add_request(0)
    caches = [PoolBackedKVCache(pool, 0, layer) for layer in (0, 1)]
    for cache in caches:
        cache.update_and_fetch(kv(3), kv(3))
    before = state(pool, caches)
    for cache in caches:
        with pytest.raises(ShapeMismatchError):
            cache.update_and_fetch(*bad(5))
        assert state(pool, caches) == before
    # and the next good chunk continues as if nothing happened
    for cache in caches:
        k, _ = cache.update_and_fetch(kv(2), kv(2))
        assert k.shape[2] == 5
    assert pool.seq_len(0) == 5


@pytest.mark.parametrize("where", ["set_kv", "get_kv", "token_slots"])
def test_a_failing_pool_write_gives_the_reservation_back(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool()
    pool.add_request(0)
    cache = PoolBackedKVCache(pool, 0, 0)
    cache.update_and_fetch(kv(3), kv(3))
    before = state(pool, [cache])

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(pool, where, boom)
    with pytest.raises(KeyboardInterrupt):
        cache.update_and_fetch(kv(4), kv(4))
    monkeypatch.undo()
    assert state(pool, [cache]) == before
    with pytest.raises(KVCacheError):
        cache.update_and_fetch(mx.zeros((1, 2, 0, 4)), mx.zeros((1, 2, 0, 4)))
    assert state(pool, [cache]) == before
