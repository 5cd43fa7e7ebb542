"""PoolBackedKVCache on the shared reference pool (kv_testing.ReferenceKVPool, page size 1)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from kv_caches import (
    ContiguousAttentionKVCache,
    PoolBackedKVCache,
    WindowedAttentionKVCache,
    is_storage_backed,
    to_contiguous,
)
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVCache,
    KVPool,
    LayerKind,
    LayerKindError,
    LayerSpec,
    PoolExhaustedError,
    ShapeMismatchError,
    UnknownRequestError,
    layout_from_model,
)
from kv_testing import ReferenceKVPool, build_tiny_model

H, D = 2, 4


def reference_pool(layout: CacheLayout, slots: int = 512) -> ReferenceKVPool:
    """The shared reference pool with one-token pages: ``slots - 1`` usable per sub-pool."""
    return ReferenceKVPool(layout, num_pages=slots, page_size=1)


def two_layer_layout(window: int = 4) -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=window, n_kv_heads=H, head_dim=D),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=H, head_dim=D),
            LayerSpec(layer_id=2, kind=LayerKind.STATE),
        ]
    )


def random_kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)


def test_reference_pool_satisfies_the_protocol() -> None:
    assert isinstance(reference_pool(two_layer_layout()), KVPool)


@settings(max_examples=30)
@given(
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    pre_reserve=st.booleans(),
)
def test_reads_back_what_attention_needs(window: int, chunks: list[int], pre_reserve: bool) -> None:
    pool = reference_pool(two_layer_layout(window))
    pool.add_request(7)
    sliding, full = PoolBackedKVCache(pool, 7, 0), PoolBackedKVCache(pool, 7, 1)
    windowed, contiguous = WindowedAttentionKVCache(window), ContiguousAttentionKVCache()
    for step, n in enumerate(chunks):
        if pre_reserve:  # an engine reserving before the forward, as a scheduler would
            pool.reserve(7, n)
        calls = pool.reserve_calls
        assert sliding.make_mask(n, window_size=window) is not None or n == 1
        for ours, reference, layer in ((sliding, windowed, 0), (full, contiguous, 1)):
            mask = ours.make_mask(n, window_size=window if layer == 0 else None)
            ref_mask = reference.make_mask(n, window_size=window if layer == 0 else None)
            assert type(mask) is type(ref_mask)
            if isinstance(mask, mx.array):
                assert isinstance(ref_mask, mx.array)
                assert mx.array_equal(mask, ref_mask).item()
            k, v = random_kv(n, 10 * step + layer)
            ok, ov = ours.update_and_fetch(k, v)
            rk, rv = reference.update_and_fetch(k, v)
            assert mx.array_equal(ok, rk).item() and mx.array_equal(ov, rv).item()
            assert ours.offset == reference.offset
        # Only the first layer of a step reserves, and only when the engine did not.
        assert pool.reserve_calls == calls + (0 if pre_reserve else 1)
        assert pool.seq_len(7) == sliding.offset
        # The pool really released what no query sees any more.
        assert pool.held_slots(7, "sliding") <= window - 1 + n


@pytest.mark.parametrize(
    ("arch", "window", "chunks", "recreate"),
    [
        ("gpt_oss", 8, [5, 12, 1, 9], False),
        ("gemma3_text", 6, [13, 2, 7], True),
        ("olmo3", 4, [3, 9], True),
    ],
)
def test_model_on_pool_matches_mlx_lm(
    arch: str, window: int, chunks: list[int], recreate: bool
) -> None:
    model = build_tiny_model(arch, window=window)
    layout = layout_from_model(model)
    pool = reference_pool(layout)
    pool.add_request(3)
    prompt = mx.random.randint(0, 256, (sum(chunks),), key=mx.random.key(window))

    def pool_caches() -> list[Any]:
        return [PoolBackedKVCache(pool, 3, i) for i in range(layout.num_layers)]

    reference = make_prompt_cache(model)
    ours = pool_caches()
    pos = 0
    inputs = [prompt[None, pos : (pos := pos + n)] for n in chunks]
    ref_tok = our_tok = None
    for step in range(len(chunks) + 40):
        if step < len(chunks):
            ids_ref = ids_ours = inputs[step]
        else:
            ids_ref, ids_ours = mx.array([[ref_tok]]), mx.array([[our_tok]])
        if recreate:  # an engine building fresh views each step: offset = pool.seq_len
            ours = pool_caches()
        a = model(ids_ref, cache=reference)
        b = model(ids_ours, cache=ours)
        mx.eval(a, b, [c.state for c in ours])
        assert float(mx.max(mx.abs(a - b))) <= 1e-5
        ref_tok, our_tok = int(mx.argmax(a[0, -1])), int(mx.argmax(b[0, -1]))
        assert ref_tok == our_tok
    assert pool.seq_len(3) == sum(chunks) + 40
    if layout.sliding_layer_ids:
        assert pool.held_slots(3, "sliding") <= window


def test_errors_leave_everything_unchanged() -> None:
    pool = reference_pool(two_layer_layout(), slots=8)
    pool.add_request(1)
    with pytest.raises(LayerKindError, match="STATE"):
        PoolBackedKVCache(pool, 1, 2)
    with pytest.raises(LayerKindError):
        PoolBackedKVCache(pool, 1, 9)
    with pytest.raises(UnknownRequestError):
        PoolBackedKVCache(pool, 99, 0)
    with pytest.raises(CacheStateError, match="past the 0 positions"):
        PoolBackedKVCache(pool, 1, 0, offset=3)
    with pytest.raises(TypeError, match="KVPool"):
        PoolBackedKVCache(object(), 1, 0)  # type: ignore[arg-type]
    full = PoolBackedKVCache(pool, 1, 1)
    assert isinstance(full, KVCache)
    full.update_and_fetch(*random_kv(3, 0))
    with pytest.raises(ShapeMismatchError):
        full.update_and_fetch(mx.zeros((1, H + 1, 1, D)), mx.zeros((1, H + 1, 1, D)))
    with pytest.raises(ShapeMismatchError):
        full.update_and_fetch(mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D)))
    with pytest.raises(PoolExhaustedError):
        full.update_and_fetch(*random_kv(6, 1))
    assert full.offset == 3 and pool.seq_len(1) == 3
    with pytest.raises(CacheStateError, match="cannot be replaced"):
        full.state = ()
    sliding = PoolBackedKVCache(pool, 1, 0, offset=0)
    assert not sliding.is_trimmable()
    with pytest.raises(CacheStateError, match="cannot be trimmed"):
        sliding.trim(1)
    assert full.trim(1) == 1 and full.offset == 2
    with pytest.raises(CacheStateError, match="cannot trim 3"):
        full.trim(3)


def test_full_layer_converts_to_contiguous() -> None:
    pool = reference_pool(two_layer_layout())
    pool.add_request(1)
    cache = PoolBackedKVCache(pool, 1, 1)
    k, v = random_kv(5, 0)
    cache.update_and_fetch(k, v)
    assert not is_storage_backed(cache) and cache.nbytes == 0
    contiguous = to_contiguous(cache)
    assert contiguous.offset == 5
    assert mx.array_equal(contiguous.get_kv()[0], k).item()
    mx.eval(cache.state)
