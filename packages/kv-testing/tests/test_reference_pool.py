"""The shared reference pool keeps what a window still sees and gives back the rest."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_protocol import CacheLayout, CacheStateError, KVLifetime, KVPool, LayerKind, LayerSpec
from kv_testing import ReferenceKVPool


def layout(window: int) -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=window, n_kv_heads=1, head_dim=2),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2),
        ]
    )


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 9),
    page_size=st.integers(1, 5),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=8),
)
def test_reads_back_every_visible_position(window: int, page_size: int, chunks: list[int]) -> None:
    pool = ReferenceKVPool(layout(window), num_pages=200, page_size=page_size)
    assert isinstance(pool, KVPool)
    pool.add_request(0)
    length = 0
    for n in chunks:
        before = length
        pool.reserve(0, n)
        length += n
        for layer in (0, 1):
            slots = pool.token_slots(0, layer, before, length)
            values = mx.arange(before, length, dtype=mx.float32)[:, None, None] * mx.ones((1, 1, 2))
            pool.set_kv(layer, slots, values, values)
    first = KVLifetime(window).first_visible(length)
    for layer in (0, 1):
        start = first if layer == 0 else 0
        k, _ = pool.get_kv(layer, pool.token_slots(0, layer, start, length))
        assert k[:, 0, 0].tolist() == list(range(start, length))
    # The sliding sub-pool let go of whole pages before the last reservation's first query.
    released_below = KVLifetime(window).first_live_page(length - chunks[-1], page_size)
    if released_below:
        with pytest.raises(CacheStateError, match="released"):
            pool.token_slots(0, 0, 0, 1)
    pool.free_request(0)
    assert all(n == 0 for n in pool.pages_in_use().values())
