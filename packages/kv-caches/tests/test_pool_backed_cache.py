"""PoolBackedKVCache on a small in-test pool (page size 1) that honours kv_protocol.KVPool."""

from __future__ import annotations

from collections.abc import Sequence
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
    InvalidPageError,
    KVCache,
    KVPool,
    LayerKind,
    LayerKindError,
    LayerSpec,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    UnknownRequestError,
    layout_from_model,
)
from kv_testing import build_tiny_model

H, D = 2, 4


class FakePool:
    """A plain KVPool: page size 1, head-major buffers, slot 0 reserved as the null slot.

    Sliding sub-pool slots whose positions no new query can see are released at reserve time,
    relative to the old ``seq_len``; asking for them afterwards raises.
    """

    def __init__(self, layout: CacheLayout, slots_per_sub_pool: int = 512) -> None:
        self._layout = layout
        self.buffers: dict[int, tuple[mx.array, mx.array]] = {}
        for layer_id in layout.attention_layer_ids:
            g = layout.geometry(layer_id)
            shape = (g.n_kv_heads, slots_per_sub_pool, g.head_dim)
            self.buffers[layer_id] = (mx.zeros(shape, g.dtype), mx.zeros(shape, g.dtype))
        self.free = {
            "full": list(range(slots_per_sub_pool - 1, 0, -1)),
            "sliding": list(range(slots_per_sub_pool - 1, 0, -1)),
        }
        windows = [layout.window(i) or 0 for i in layout.sliding_layer_ids]
        self.max_window = max(windows, default=0)
        # request -> sub-pool -> {position: slot}
        self.tables: dict[int, dict[str, dict[int, int]]] = {}
        self.lengths: dict[int, int] = {}
        self.reserve_calls = 0

    @property
    def layout(self) -> CacheLayout:
        return self._layout

    def add_request(self, request_id: int) -> None:
        self.tables[request_id] = {"full": {}, "sliding": {}}
        self.lengths[request_id] = 0

    def free_request(self, request_id: int) -> None:
        for name, table in self._tables(request_id).items():
            self.free[name].extend(table.values())
        del self.tables[request_id], self.lengths[request_id]

    def has_request(self, request_id: int) -> bool:
        return request_id in self.tables

    def _tables(self, request_id: int) -> dict[str, dict[int, int]]:
        if request_id not in self.tables:
            raise UnknownRequestError(f"unknown request {request_id}")
        return self.tables[request_id]

    def seq_len(self, request_id: int) -> int:
        self._tables(request_id)
        return self.lengths[request_id]

    def _sub_pools(self) -> list[str]:
        names = []
        if self._layout.full_layer_ids:
            names.append("full")
        if self._layout.sliding_layer_ids:
            names.append("sliding")
        return names

    def reserve(self, request_id: int, n_tokens: int) -> dict[str, mx.array]:
        tables = self._tables(request_id)
        old = self.lengths[request_id]
        for name in self._sub_pools():
            if len(self.free[name]) < n_tokens:
                raise PoolExhaustedError(
                    sub_pool=name, pages_requested=n_tokens, pages_free=len(self.free[name])
                )
        self.reserve_calls += 1
        if "sliding" in tables:
            visible_from = old - self.max_window + 1
            for pos in [p for p in tables["sliding"] if p < visible_from]:
                self.free["sliding"].append(tables["sliding"].pop(pos))
        out = {}
        for name in self._sub_pools():
            new = [self.free[name].pop() for _ in range(n_tokens)]
            tables[name].update(zip(range(old, old + n_tokens), new, strict=True))
            out[name] = mx.array(new, dtype=mx.int32)
        self.lengths[request_id] = old + n_tokens
        return out

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        tables = self._tables(request_id)
        new_len = self.lengths[request_id] - n_tokens
        for name, table in tables.items():
            for pos in [p for p in table if p >= new_len]:
                self.free[name].append(table.pop(pos))
        self.lengths[request_id] = new_len

    def reserve_batch(self, request_ids: Sequence[int], n_tokens: int = 1) -> dict[str, mx.array]:
        for rid in request_ids:
            self._tables(rid)
        if len(set(request_ids)) != len(request_ids):
            raise RequestStateError(f"repeated request ids {list(request_ids)}")
        for name in self._sub_pools():
            need = n_tokens * len(request_ids)
            if len(self.free[name]) < need:
                raise PoolExhaustedError(
                    sub_pool=name, pages_requested=need, pages_free=len(self.free[name])
                )
        rows = [self.reserve(rid, n_tokens) for rid in request_ids]
        return {
            name: mx.array([r[name].tolist() for r in rows], dtype=mx.int32).reshape(
                len(request_ids), n_tokens
            )
            for name in self._sub_pools()
        }

    def can_reserve(self, demands: dict[int, int]) -> bool:
        need = sum(demands.values())
        return all(len(self.free[name]) >= need for name in self._sub_pools())

    def sub_pool_of(self, layer_id: int) -> str:
        kind = self._layout.kind(layer_id)
        if kind is LayerKind.STATE:
            raise LayerKindError(f"{layer_id=} not in attention layers")
        return "full" if kind is LayerKind.FULL else "sliding"

    def page_size(self, layer_id: int) -> int:
        self.sub_pool_of(layer_id)
        return 1

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        table = self._tables(request_id)[self.sub_pool_of(layer_id)]
        missing = [p for p in range(start, stop) if p not in table]
        if missing:
            raise InvalidPageError(f"positions {missing} of request {request_id} are not held")
        return mx.array([table[p] for p in range(start, stop)], dtype=mx.int32)

    def batch_page_table(self, request_ids: Sequence[int], sub_pool: str) -> mx.array:
        raise NotImplementedError

    def batch_slots(
        self, request_ids: Sequence[int], sub_pool: str, positions: Sequence[int]
    ) -> mx.array:
        raise NotImplementedError

    def get_key_buffer(self, layer_id: int) -> mx.array:
        return self.buffers[layer_id][0]

    def get_value_buffer(self, layer_id: int) -> mx.array:
        return self.buffers[layer_id][1]

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        self.buffers[layer_id] = (keys, values)

    def set_kv(self, layer_id: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        k_buf, v_buf = self.buffers[layer_id]
        k_buf[:, slots, :] = keys.transpose(1, 0, 2)
        v_buf[:, slots, :] = values.transpose(1, 0, 2)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        k_buf, v_buf = self.buffers[layer_id]
        return k_buf[:, slots, :].transpose(1, 0, 2), v_buf[:, slots, :].transpose(1, 0, 2)

    def held_slots(self, request_id: int, sub_pool: str) -> int:
        return len(self.tables[request_id][sub_pool])


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


def test_fake_pool_satisfies_the_protocol() -> None:
    assert isinstance(FakePool(two_layer_layout()), KVPool)


@settings(max_examples=30)
@given(
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    pre_reserve=st.booleans(),
)
def test_reads_back_what_attention_needs(window: int, chunks: list[int], pre_reserve: bool) -> None:
    pool = FakePool(two_layer_layout(window))
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
    pool = FakePool(layout)
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
    pool = FakePool(two_layer_layout(), slots_per_sub_pool=8)
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
    pool = FakePool(two_layer_layout())
    pool.add_request(1)
    cache = PoolBackedKVCache(pool, 1, 1)
    k, v = random_kv(5, 0)
    cache.update_and_fetch(k, v)
    assert not is_storage_backed(cache) and cache.nbytes == 0
    contiguous = to_contiguous(cache)
    assert contiguous.offset == 5
    assert mx.array_equal(contiguous.get_kv()[0], k).item()
    mx.eval(cache.state)
