"""CacheNesting nests flat layer ids into a model's cache list; stacked states keep their type."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kv_batching._cache_nesting import CacheNesting
from kv_batching._state_cache import StackedStateCache, install_stacked_states
from kv_protocol import flatten_caches


class _Model:
    def __init__(self, layers: int, caches: list[Any] | None) -> None:
        self.model = SimpleNamespace(layers=[object() for _ in range(layers)])
        if caches is not None:
            self.make_cache = lambda: caches


def test_one_plain_cache_per_layer_is_the_identity() -> None:
    nesting = CacheNesting.from_model(_Model(3, [KVCache(), ArraysCache(size=2), KVCache()]))
    assert nesting.by_layer and nesting.num_layers == 3 and nesting.describe() == ""
    flat = ["a", "b", "c"]
    assert nesting.nest(flat) == flat
    assert CacheNesting.from_model(_Model(2, None)).by_layer  # no make_cache: one per layer


def test_more_caches_than_layers_is_flat_but_not_by_layer() -> None:
    nesting = CacheNesting.from_model(_Model(2, [KVCache() for _ in range(4)]))
    assert not nesting.by_layer
    assert "4 caches" in nesting.describe()
    assert nesting.nest([1, 2, 3, 4]) == [1, 2, 3, 4]


def test_cache_lists_get_copies_holding_the_flat_caches() -> None:
    template = CacheList(ArraysCache(size=2), RotatingKVCache(max_size=4))
    nesting = CacheNesting.from_model(_Model(2, [KVCache(), template]))
    assert not nesting.by_layer and nesting.num_layers == 3
    nested = nesting.nest(["full", "state", "sliding"])
    assert nested[0] == "full"
    assert isinstance(nested[1], CacheList)  # the model's own class: isinstance checks hold
    assert nested[1] is not template and nested[1][0] == "state" and nested[1][1] == "sliding"
    assert isinstance(template[0], ArraysCache)  # the template is left as it was


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=6))
def test_nest_inverts_flatten(shape: list[int]) -> None:
    # Each entry: 0 a plain cache, n >= 1 a CacheList of n caches.
    caches: list[Any] = [
        KVCache() if n == 0 else CacheList(*(KVCache() for _ in range(n))) for n in shape
    ]
    nesting = CacheNesting(caches, len(shape))
    flat = flatten_caches(caches)
    assert nesting.num_layers == len(flat)
    assert flatten_caches(nesting.nest(flat)) == flat
    assert nesting.by_layer == all(n == 0 for n in shape)


def test_stacked_states_hand_the_model_its_own_cache_class() -> None:
    rows = []
    for b in range(3):
        cache = ArraysCache(size=2)
        cache[0] = mx.full((1, 2, 4), float(b))
        cache[1] = mx.full((1, 4), float(10 + b))
        rows.append([cache])
    caches: list[Any] = [None]
    stacked = install_stacked_states(caches, [0], rows)
    view = caches[0]
    assert type(view) is ArraysCache and view is not rows[0][0]
    assert view.lengths is None and view.left_padding is None
    assert view[0].shape == (3, 2, 4)
    # A model that stores its new state only into an ArraysCache, as mlx-lm's Mamba does.
    if isinstance(view, ArraysCache):
        view[0] = view[0] + 1
        view[1] = view[1] * 2
    assert isinstance(stacked[0], StackedStateCache)
    stacked[0].split()
    for b, (row,) in enumerate(rows):
        assert row[0].shape == (1, 2, 4) and float(row[0][0, 0, 0]) == b + 1
        assert float(row[1][0, 0]) == 2 * (10 + b)
