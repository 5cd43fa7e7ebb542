from __future__ import annotations

import math
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_pool import (
    HybridKVPool,
    LayerDoneCounter,
    PageAllocator,
    pages_per_request,
    required_bytes,
    sub_pool_groups,
)
from kv_pool._inspect import (
    allocator,
    batch_page_table,
    batch_slots,
    held_pages,
    num_free_pages,
    page_table,
    sub_pool_names,
)
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVBuffer,
    KVCacheError,
    KVPool,
    KVQuantization,
    LayerKind,
    LayerSpec,
    LayerTransferCounter,
    LayoutError,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    TransferTimeoutError,
    UnknownRequestError,
)
from kv_protocol import PageAllocator as PageAllocatorProtocol


def plain(buffer: KVBuffer) -> mx.array:
    """A layer buffer of an unquantized pool, as the plain array it is."""
    assert isinstance(buffer, mx.array)
    return buffer


def tl(a: mx.array) -> Any:
    """``a.tolist()`` typed loosely (mlx's stub types it as a scalar-or-list union)."""
    return a.tolist()


def sliding(
    i: int, window: int, heads: int = 2, dim: int = 4, dtype: mx.Dtype = mx.float32
) -> LayerSpec:
    return LayerSpec(
        layer_id=i,
        kind=LayerKind.SLIDING,
        window=window,
        n_kv_heads=heads,
        head_dim=dim,
        dtype=dtype,
    )


def full(i: int, heads: int = 2, dim: int = 4, dtype: mx.Dtype = mx.float32) -> LayerSpec:
    return LayerSpec(layer_id=i, kind=LayerKind.FULL, n_kv_heads=heads, head_dim=dim, dtype=dtype)


def gpt_oss_like(n_layers: int = 4, window: int = 4) -> CacheLayout:
    return CacheLayout([sliding(i, window) if i % 2 == 0 else full(i) for i in range(n_layers)])


MIXED = CacheLayout(
    [
        sliding(0, 4, heads=1, dim=8),
        full(1, heads=2, dim=4),
        LayerSpec(layer_id=2, kind=LayerKind.STATE),
        sliding(3, 4, heads=1, dim=8),
        full(4, heads=3, dim=2),
    ]
)


def test_satisfies_protocols() -> None:
    pool: KVPool = HybridKVPool(gpt_oss_like(), num_pages=8, page_size=2)
    assert isinstance(pool, KVPool)
    assert isinstance(HybridKVPool(MIXED, num_pages=4), KVPool)
    concrete = HybridKVPool(gpt_oss_like(), num_pages=8, page_size=2)
    assert isinstance(allocator(concrete, "full"), PageAllocatorProtocol)
    assert isinstance(allocator(concrete, "full"), PageAllocator)
    counter: LayerTransferCounter = LayerDoneCounter(4)
    assert isinstance(counter, LayerTransferCounter)


def test_sub_pool_names_and_geometry() -> None:
    pool = HybridKVPool(gpt_oss_like(window=128), num_pages=4)
    assert sub_pool_names(pool) == ("sliding-w128", "full")
    assert pool.sub_pool_of(0) == "sliding-w128" and pool.sub_pool_of(3) == "full"
    assert {g.name: g.layer_ids for g in sub_pool_groups(MIXED)} == {
        "sliding-w4-1x8": (0, 3),
        "full-2x4": (1,),
        "full-3x2": (4,),
    }
    dtypes = CacheLayout([full(0), full(1, dtype=mx.bfloat16)])
    assert [g.name for g in sub_pool_groups(dtypes)] == ["full-2x4-float32", "full-2x4-bfloat16"]
    pool = HybridKVPool(
        MIXED,
        num_pages={"sliding-w4-1x8": 3, "full-2x4": 5, "full-3x2": 4},
        page_size={"sliding-w4-1x8": 2, "full-2x4": 4, "full-3x2": 8},
    )
    assert pool.get_key_buffer(0).shape == (1, 6, 8)
    assert pool.get_value_buffer(3).shape == (1, 6, 8)
    assert pool.get_key_buffer(1).shape == (2, 20, 4)
    assert pool.get_key_buffer(4).shape == (3, 32, 2)
    assert pool.page_size(4) == 8 and pool.page_size(0) == 2


def test_constructor_errors() -> None:
    layout = gpt_oss_like()
    with pytest.raises(LayoutError, match="missing"):
        HybridKVPool(layout, num_pages={"full": 4})
    with pytest.raises(LayoutError, match="page_size"):
        HybridKVPool(layout, num_pages=4, page_size=0)
    with pytest.raises(LayoutError, match="num_pages"):
        HybridKVPool(layout, num_pages=1)


def test_a_layout_of_state_layers_only_has_no_sub_pool_and_tracks_requests() -> None:
    layout = CacheLayout([LayerSpec(layer_id=i, kind=LayerKind.STATE) for i in range(3)])
    for pool in (
        HybridKVPool(layout, num_pages={}),
        HybridKVPool.from_budget(layout, 1 << 20, max_context=64, concurrency=4),
    ):
        assert sub_pool_names(pool) == ()
        pool.add_request(7)
        reservation = pool.try_reserve_batch({7: 100})
        assert reservation is not None and reservation.slots == {}
        assert pool.seq_len(7) == 100
        assert pool.memory_report().sub_pools == ()
        pool.free_request(7)


def test_values_narrower_than_keys_get_their_own_buffer_width() -> None:
    layout = CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=1, head_dim=24, v_head_dim=8),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=24),
        ]
    )
    pool = HybridKVPool(layout, num_pages=4, page_size=4)
    assert sub_pool_names(pool) == ("full-1x24v8", "full-1x24")
    assert pool.get_key_buffer(0).shape == (1, 16, 24)
    assert pool.get_value_buffer(0).shape == (1, 16, 8)
    pool.add_request(0)
    slots = pool.reserve(0, 3).slots["full-1x24v8"]
    keys = mx.random.normal((3, 1, 24))
    values = mx.random.normal((3, 1, 8))
    pool.set_kv(0, slots, keys, values)
    got_k, got_v = pool.get_kv(0, slots)
    assert mx.array_equal(got_k, keys) and mx.array_equal(got_v, values)
    with pytest.raises(ShapeMismatchError, match=r"values must be \(T, n_kv_heads, v_head_dim\)"):
        pool.set_kv(0, slots, keys, mx.zeros((3, 1, 24)))
    assert pool.memory_report().sub_pools[0].bytes_total == 4 * 4 * (24 + 8) * 4


def test_layer_id_translation_raises_the_layouts_exact_errors() -> None:
    pool = HybridKVPool(MIXED, num_pages=4)
    full_keys = MIXED.full_attention_layer_id_mapping.keys()
    sliding_keys = MIXED.sliding_layer_id_mapping.keys()
    attention_keys = MIXED.attention_index_by_layer.keys()
    for layer_id in (0, 2, 3, 99):
        with pytest.raises(ValueError) as info:
            pool.get_full_kv_buffers(layer_id)
        assert str(info.value) == f"{layer_id=} not in full attention layers: {full_keys}"
    for layer_id in (1, 2, 4, 99):
        with pytest.raises(ValueError) as info:
            pool.get_sliding_kv_buffers(layer_id)
        assert str(info.value) == f"{layer_id=} not in sliding window layers: {sliding_keys}"
    slots = mx.array([1], dtype=mx.int32)
    kv = mx.zeros((1, 1, 8))
    for layer_id in (2, 5, -1):
        expected = f"{layer_id=} not in attention layers: {attention_keys}"
        for call in (
            lambda i: pool.get_key_buffer(i),
            lambda i: pool.get_value_buffer(i),
            lambda i: pool.set_kv(i, slots, kv, kv),
            lambda i: pool.get_kv(i, slots),
            lambda i: pool.sub_pool_of(i),
            lambda i: pool.page_size(i),
            lambda i: pool.replace_buffers(i, kv, kv),
        ):
            with pytest.raises(ValueError) as info:
                call(layer_id)
            assert str(info.value) == expected
    assert pool.get_full_kv_buffers(4)[0].shape == (3, 64, 2)
    assert pool.get_sliding_kv_buffers(3)[1].shape == (1, 64, 8)


def test_request_errors() -> None:
    pool = HybridKVPool(gpt_oss_like(), num_pages=8, page_size=2)
    pool.add_request(7)
    with pytest.raises(RequestStateError, match="already registered"):
        pool.add_request(7)
    for call in (
        lambda: pool.reserve(8, 1),
        lambda: pool.free_request(8),
        lambda: pool.seq_len(8),
        lambda: pool.fork_request(8, 9, 0),
        lambda: batch_page_table(pool, [7, 8], "full"),
        lambda: pool.try_reserve_batch({8: 1}),
    ):
        with pytest.raises(UnknownRequestError, match="unknown request id 8"):
            call()
    with pytest.raises(KeyError):
        pool.seq_len(8)
    with pytest.raises(RequestStateError):
        pool.reserve(7, -1)
    with pytest.raises(KVCacheError, match="unknown sub-pool"):
        batch_page_table(pool, [7], "nope")
    pool.reserve(7, 3)
    with pytest.raises(RequestStateError, match="holds 3"):
        pool.fork_request(7, 9, 4)
    pool.add_request(9)
    with pytest.raises(RequestStateError, match="registered"):
        pool.fork_request(7, 9, 1)
    with pytest.raises(RequestStateError):
        pool.token_slots(7, 1, 2, 4)
    assert not pool.has_request(8) and pool.has_request(7)


# seq_len after each single-token reserve -> first held logical page (window 4, page size 2)
RELEASE_TABLE = [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 1), (7, 1), (8, 2), (9, 2), (10, 3)]


def test_sliding_release_table() -> None:
    pool = HybridKVPool(gpt_oss_like(window=4), num_pages=32, page_size=2)
    pool.add_request(0)
    for seq_len, first in RELEASE_TABLE:
        pool.reserve(0, 1)
        assert pool.seq_len(0) == seq_len
        table = tl(page_table(pool, 0, "sliding-w4"))
        assert len(table) == math.ceil(seq_len / 2)
        assert table[:first] == [0] * first and 0 not in table[first:]
        assert len(held_pages(pool, 0, "sliding-w4")) <= math.ceil(4 / 2) + 1
        assert len(held_pages(pool, 0, "full")) == math.ceil(seq_len / 2)
    with pytest.raises(CacheStateError, match="released"):
        pool.token_slots(0, 0, 5, 10)
    with pytest.raises(CacheStateError, match="released"):
        batch_slots(pool, [0], "sliding-w4", [5])
    assert pool.token_slots(0, 0, 6, 10).shape == (4,)
    assert pool.token_slots(0, 1, 0, 10).shape == (10,)


def test_prefill_chunk_holds_more_while_it_runs() -> None:
    pool = HybridKVPool(gpt_oss_like(window=4), num_pages=32, page_size=2)
    pool.add_request(0)
    pool.reserve(0, 10)
    assert len(held_pages(pool, 0, "sliding-w4")) == 5
    pool.reserve(0, 1)  # old seq_len 10: the new query sees 7..10
    assert tl(page_table(pool, 0, "sliding-w4"))[:3] == [0, 0, 0]
    assert len(held_pages(pool, 0, "sliding-w4")) == 3
    free_before = num_free_pages(pool, "sliding-w4")
    pool.free_request(0)
    assert num_free_pages(pool, "sliding-w4") == free_before + 3
    assert num_free_pages(pool, "full") == 31


def test_reserve_is_atomic_across_sub_pools() -> None:
    layout = gpt_oss_like(window=4)
    pool = HybridKVPool(layout, num_pages={"sliding-w4": 32, "full": 4}, page_size=2)
    pool.add_request(0)
    pool.reserve(0, 4)
    before = (tl(page_table(pool, 0, "sliding-w4")), num_free_pages(pool, "sliding-w4"))
    assert pool.try_reserve_batch({0: 4}) is None
    with pytest.raises(PoolExhaustedError) as info:
        pool.reserve(0, 4)
    assert info.value.sub_pool == "full"
    assert info.value.pages_requested == 2 and info.value.pages_free == 1
    assert pool.seq_len(0) == 4
    assert (tl(page_table(pool, 0, "sliding-w4")), num_free_pages(pool, "sliding-w4")) == before
    assert pool.try_reserve_batch({0: 2}) is not None


def test_release_makes_room_in_the_same_reserve() -> None:
    # 4 usable sliding pages: a request at 8 tokens holds 4; its next reserve frees 2 first.
    pool = HybridKVPool(
        gpt_oss_like(window=2), num_pages={"sliding-w2": 5, "full": 32}, page_size=2
    )
    pool.add_request(0)
    pool.reserve(0, 8)
    assert num_free_pages(pool, "sliding-w2") == 0
    assert pool.try_reserve_batch({0: 3}) is not None
    assert len(held_pages(pool, 0, "sliding-w2")) == 3


def test_batch_page_table_and_slots() -> None:
    pool = HybridKVPool(gpt_oss_like(window=4), num_pages=32, page_size=2)
    for rid, n in ((3, 5), (1, 1), (2, 0)):
        pool.add_request(rid)
        pool.reserve(rid, n)
    table = batch_page_table(pool, [3, 1, 2], "full")
    assert table.dtype == mx.int32 and table.shape == (3, 3)
    assert tl(table[0]) == tl(page_table(pool, 3, "full"))
    assert tl(table[1])[1:] == [0, 0] and tl(table[2]) == [0, 0, 0]
    assert batch_page_table(pool, [2], "full").shape == (1, 1)
    assert batch_page_table(pool, [], "full").shape == (0, 1)
    slots = batch_slots(pool, [3, 1], "full", [4, 0])
    assert slots.dtype == mx.int32
    assert tl(slots) == [
        pool.token_slots(3, 1, 4, 5).item(),
        pool.token_slots(1, 1, 0, 1).item(),
    ]
    with pytest.raises(ShapeMismatchError):
        batch_slots(pool, [3], "full", [0, 1])
    with pytest.raises(RequestStateError):
        batch_slots(pool, [1], "full", [1])
    # A reservation carries the batch's page tables after it, and its new slots row by row.
    got = pool.try_reserve_batch({1: 2, 3: 1, 2: 3})
    assert got is not None and got.request_ids == (1, 3, 2)
    assert got.start_lengths == (1, 5, 0) and got.lengths == (3, 6, 3)
    assert tl(got.page_tables["full"]) == tl(batch_page_table(pool, [1, 3, 2], "full"))
    assert tl(got.slots["full"]) == [
        *tl(pool.token_slots(1, 1, 1, 3)),
        *tl(pool.token_slots(3, 1, 5, 6)),
        *tl(pool.token_slots(2, 1, 0, 3)),
    ]
    assert got.row_start(2) == 3 and got.total_tokens == 6


def _gather(pool: HybridKVPool, layer: int, rid: int) -> tuple[np.ndarray, np.ndarray]:
    """Read a request's tokens through its page table, as a paged kernel would."""
    size = pool.page_size(layer)
    table = batch_page_table(pool, [rid], pool.sub_pool_of(layer))
    out = []
    for buf in (plain(pool.get_key_buffer(layer)), plain(pool.get_value_buffer(layer))):
        h, slots, d = buf.shape
        pages = buf.reshape(h, slots // size, size, d)[:, table[0]]  # (H, P, size, D)
        out.append(np.array(pages.reshape(h, -1, d).transpose(1, 0, 2)))  # (P*size, H, D)
    return out[0], out[1]


@given(
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
)
def test_round_trip_through_page_tables(chunks: list[int], sizes: tuple[int, int, int]) -> None:
    names = [g.name for g in sub_pool_groups(MIXED)]
    page_size = dict(zip(names, sizes, strict=True))
    # Room for the largest draw: 2 requests of up to 1 + 5 * 7 tokens at one token a page.
    pool = HybridKVPool(MIXED, num_pages=80, page_size=page_size)
    rng = np.random.default_rng(len(chunks) * 31 + sum(sizes))
    dense = {}
    for rid in (0, 1):
        pool.add_request(rid)
        pool.reserve(rid, rid)  # offset the two requests' pages
        for layer in MIXED.attention_layer_ids:
            g = MIXED.geometry(layer)
            dense[rid, layer] = rng.standard_normal((2, 40, g.n_kv_heads, g.head_dim)).astype(
                np.float32
            )
        for layer in MIXED.attention_layer_ids:
            k, v = dense[rid, layer][:, :rid]
            slots = pool.token_slots(rid, layer, 0, rid)
            pool.set_kv(layer, slots, mx.array(k), mx.array(v))
    for n in chunks:
        for rid in (0, 1):
            start = pool.seq_len(rid)
            new_slots = pool.reserve(rid, n).slots
            for layer in MIXED.attention_layer_ids:
                k, v = dense[rid, layer][:, start : start + n]
                pool.set_kv(layer, new_slots[pool.sub_pool_of(layer)], mx.array(k), mx.array(v))
    for rid in (0, 1):
        seq_len = pool.seq_len(rid)
        for layer in MIXED.attention_layer_ids:
            k, v = _gather(pool, layer, rid)
            window = MIXED.window(layer)
            size = pool.page_size(layer)
            first = 0
            if window is not None:
                first = tl(page_table(pool, rid, pool.sub_pool_of(layer))).count(0) * size
                # what the last chunk's queries need is still there
                assert first <= max(0, seq_len - chunks[-1] - window + 1)
            np.testing.assert_array_equal(k[first:seq_len], dense[rid, layer][0, first:seq_len])
            np.testing.assert_array_equal(v[first:seq_len], dense[rid, layer][1, first:seq_len])
            slots = pool.token_slots(rid, layer, first, seq_len)
            gk, gv = pool.get_kv(layer, slots)
            np.testing.assert_array_equal(np.array(gk), dense[rid, layer][0, first:seq_len])
            np.testing.assert_array_equal(np.array(gv), dense[rid, layer][1, first:seq_len])


def test_set_kv_and_replace_buffers_check_shapes() -> None:
    pool = HybridKVPool(gpt_oss_like(), num_pages=8, page_size=2)
    slots = mx.array([2, 3], dtype=mx.int32)
    good = mx.ones((2, 2, 4))
    bad_inputs = [
        (slots, mx.ones((2, 4, 2)), good, "must be \\(T, n_kv_heads, head_dim\\) = \\(2, 2, 4\\)"),
        (slots, good, mx.ones((3, 2, 4)), "values"),
        (slots, good.astype(mx.bfloat16), good, "float32"),
        (slots.astype(mx.float32), good, good, "integer dtype"),
        (slots.reshape(1, 2), good, good, "1-D"),
    ]
    for s, k, v, message in bad_inputs:
        before = np.array(pool.get_key_buffer(1))
        with pytest.raises(ShapeMismatchError, match=message):
            pool.set_kv(1, s, k, v)
        np.testing.assert_array_equal(np.array(pool.get_key_buffer(1)), before)
    buf = plain(pool.get_key_buffer(1))
    with pytest.raises(ShapeMismatchError, match="replace_buffers"):
        pool.replace_buffers(1, buf[:, :4], buf)
    with pytest.raises(ShapeMismatchError):
        pool.replace_buffers(1, buf, buf.astype(mx.float16))
    new_k, new_v = mx.full(buf.shape, 2.0), mx.full(buf.shape, 3.0)
    pool.replace_buffers(1, new_k, new_v)
    assert pool.get_key_buffer(1) is new_k and pool.get_value_buffer(1) is new_v
    assert pool.get_key_buffer(3) is not new_k


def test_fork_shares_whole_pages_and_copies_the_tail() -> None:
    pool = HybridKVPool(gpt_oss_like(window=4), num_pages=16, page_size=4)
    pool.add_request(0)
    slots = pool.reserve(0, 10).slots
    values = mx.arange(10 * 8, dtype=mx.float32).reshape(10, 2, 4)
    for layer in range(4):
        pool.set_kv(layer, slots[pool.sub_pool_of(layer)], values + layer, -values)
    pool.fork_request(0, 1, 10)
    parent, child = tl(page_table(pool, 0, "full")), tl(page_table(pool, 1, "full"))
    assert parent[:2] == child[:2] and parent[2] != child[2]
    assert [allocator(pool, "full").refcount(p) for p in parent] == [2, 2, 1]
    # sliding: only the pages the child's next query (position 10, window 4) sees: 7..9
    assert tl(page_table(pool, 1, "sliding-w4"))[0] == 0
    for layer in range(4):
        k, _ = pool.get_kv(layer, pool.token_slots(1, layer, 8, 10))
        np.testing.assert_array_equal(np.array(k), np.array(values[8:10] + layer))
    # writes of the child into its tail copy leave the parent's page alone
    child_new = pool.reserve(1, 1).slots
    pool.set_kv(1, child_new["full"], mx.full((1, 2, 4), -7.0), mx.zeros((1, 2, 4)))
    parent_new = pool.reserve(0, 1).slots
    pool.set_kv(1, parent_new["full"], mx.full((1, 2, 4), 7.0), mx.zeros((1, 2, 4)))
    assert tl(pool.get_kv(1, pool.token_slots(0, 1, 10, 11))[0])[0][0][0] == 7.0
    assert tl(pool.get_kv(1, pool.token_slots(1, 1, 10, 11))[0])[0][0][0] == -7.0
    pool.free_request(0)
    assert [allocator(pool, "full").refcount(p) for p in child[:2]] == [1, 1]
    pool.free_request(1)
    assert num_free_pages(pool, "full") == 15 and num_free_pages(pool, "sliding-w4") == 15


def test_fork_refuses_released_positions() -> None:
    pool = HybridKVPool(gpt_oss_like(window=2), num_pages=32, page_size=2)
    pool.add_request(0)
    for _ in range(12):
        pool.reserve(0, 1)
    before = pool.memory_report()
    with pytest.raises(RequestStateError, match="released"):
        pool.fork_request(0, 1, 4)
    assert pool.memory_report() == before and not pool.has_request(1)
    pool.fork_request(0, 1, 11)
    assert pool.seq_len(1) == 11


def test_set_kv_writes_in_place() -> None:
    # A single-token write must not copy the whole buffer (MLX donates it when unshared).
    pool = HybridKVPool(gpt_oss_like(), num_pages=4096, page_size=16)
    pool.add_request(0)
    slots = pool.reserve(0, 1).slots["full"]
    mx.eval(pool.get_key_buffer(1), pool.get_value_buffer(1))
    kv = mx.ones((1, 2, 4))
    mx.eval(kv, slots)
    buffer_bytes = pool.get_key_buffer(1).nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(3):
        pool.set_kv(1, slots, kv, kv)
        mx.eval(pool.get_key_buffer(1), pool.get_value_buffer(1))
    assert mx.get_peak_memory() - base < buffer_bytes // 4
    assert tl(pool.get_kv(1, slots)[0]) == [[[1.0] * 4] * 2]


def test_from_budget_fits_the_stated_workload() -> None:
    layout = gpt_oss_like(window=8)
    kwargs: dict[str, Any] = {
        "max_context": 40,
        "concurrency": 3,
        "page_size": 4,
        "prefill_chunk": 8,
    }
    need = required_bytes(layout, **kwargs)
    pages = pages_per_request(layout, max_context=40, page_size=4, prefill_chunk=8)
    assert pages == {"sliding-w8": math.ceil((8 - 1 + 8) / 4) + 1, "full": 10}
    pool = HybridKVPool.from_budget(layout, need, **kwargs)
    assert pool.memory_report().bytes_total == need
    for rid in range(3):
        pool.add_request(rid)
    for _ in range(5):
        for rid in range(3):
            pool.reserve(rid, 8)
    assert num_free_pages(pool, "full") == 0
    bigger = HybridKVPool.from_budget(layout, 3 * need, **kwargs)
    assert {s.name: s.num_pages for s in bigger.sub_pools}["full"] == 3 * (3 * 10 + 1)
    assert bigger.memory_report().bytes_total <= 3 * need
    with pytest.raises(PoolExhaustedError):
        HybridKVPool.from_budget(layout, 100, **kwargs)
    with pytest.raises(RequestStateError):
        HybridKVPool.from_budget(layout, need, max_context=40, concurrency=0)


def test_memory_report() -> None:
    layout = gpt_oss_like(window=4)  # 2 sliding + 2 full layers, 2 heads x 4, fp32
    pool = HybridKVPool(layout, num_pages=33, page_size=2)
    report = pool.memory_report()
    per_page = 2 * 2 * (2 * 2 * 4 * 4)  # page_size * layers * bytes_per_token
    assert [s.bytes_per_page for s in report.sub_pools] == [per_page, per_page]
    assert report.bytes_total == 2 * 33 * per_page and report.bytes_used == 0
    assert report.used_fraction_of_full is None
    assert report.full_capacity_tokens == 64
    pool.add_request(0)
    for _ in range(20):
        pool.reserve(0, 1)
    report = pool.memory_report()
    sliding_rep, full_rep = report.sub_pools
    assert (sliding_rep.pages_used, full_rep.pages_used) == (2, 10)  # positions 16..19
    assert sliding_rep.pages_used + sliding_rep.pages_free == 32
    assert report.tokens == 20 and report.num_requests == 1
    assert report.full_equivalent_bytes == 20 * layout.full_kv_bytes_per_token()
    assert report.bytes_used == 12 * per_page
    assert report.saving_bytes == report.full_equivalent_bytes - 12 * per_page
    assert report.used_fraction_of_full == pytest.approx(12 / 20)  # 20 pages of 2 layers x 2 tokens
    assert "sliding-w4" in report.format()


def test_layer_done_counter_blocks_until_marked() -> None:
    counter = LayerDoneCounter(4, timeout=5.0)
    seen: list[float] = []

    def reader() -> None:
        counter.wait_until(2)
        seen.append(time.monotonic())

    thread = threading.Thread(target=reader)
    thread.start()
    counter.mark_done(0)
    time.sleep(0.05)
    assert not seen and thread.is_alive()
    marked = time.monotonic()
    counter.mark_done(2)
    thread.join(5)
    assert seen and seen[0] >= marked
    assert counter.is_done(2) and not counter.is_done(1)
    with pytest.raises(TransferTimeoutError):
        counter.wait_until(1, timeout=0.01)
    with pytest.raises(KVCacheError):
        counter.mark_done(9)
    counter.reset()
    assert not counter.is_done(2)
    counter.mark_all_done()
    counter.wait_until(3)


class SpyCounter:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def wait_until(self, layer_id: int) -> None:
        self.ids.append(layer_id)


def test_buffer_accessors_wait_on_the_global_layer_id() -> None:
    pool = HybridKVPool(MIXED, num_pages=4, page_size=2)
    spy = SpyCounter()
    pool.layer_transfer_counter = spy
    assert pool.layer_transfer_counter is spy
    slots = mx.array([2], dtype=mx.int32)
    pool.get_key_buffer(4)
    pool.get_value_buffer(3)
    pool.get_kv(1, slots)
    pool.set_kv(0, slots, mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)))
    pool.get_full_kv_buffers(4)
    assert spy.ids == [4, 3, 1, 0, 4, 4]
    with pytest.raises(ValueError):
        pool.get_key_buffer(2)  # STATE layer: the layout error, no wait
    assert len(spy.ids) == 6

    counter = LayerDoneCounter(MIXED.attention_layer_ids, timeout=0.05)
    pool.layer_transfer_counter = counter
    with pytest.raises(TransferTimeoutError):
        pool.get_key_buffer(3)
    got: list[tuple[int, ...]] = []
    thread = threading.Thread(target=lambda: got.append(pool.get_key_buffer(3).shape))
    counter = LayerDoneCounter(MIXED.attention_layer_ids, timeout=5)
    pool.layer_transfer_counter = counter
    thread.start()
    time.sleep(0.05)
    assert not got
    counter.mark_done(3)
    thread.join(5)
    assert got == [(1, 8, 8)]
    pool.layer_transfer_counter = None
    pool.get_key_buffer(0)


def test_try_reserve_batch_matches_reserve_and_is_atomic() -> None:
    layout = gpt_oss_like(window=4)
    one = HybridKVPool(layout, num_pages=64, page_size=2)
    many = HybridKVPool(layout, num_pages=64, page_size=2)
    for pool in (one, many):
        for rid, n in ((5, 3), (6, 0), (7, 8)):
            pool.add_request(rid)
            pool.reserve(rid, n)
    for n in (1, 1, 3, 0, 1):
        got = many.try_reserve_batch({7: n, 5: n, 6: n})
        assert got is not None
        want = [one.reserve(rid, n) for rid in (7, 5, 6)]
        for name in sub_pool_names(many):
            assert got.slots[name].shape == (3 * n,) and got.slots[name].dtype == mx.int32
            assert tl(got.slots[name]) == [s for w in want for s in tl(w.slots[name])]
            for rid in (5, 6, 7):
                assert tl(page_table(many, rid, name)) == tl(page_table(one, rid, name))
    empty = many.try_reserve_batch({})
    assert empty is not None and empty.slots["full"].shape == (0,)
    assert empty.page_tables["full"].shape == (0, 1)
    with pytest.raises(UnknownRequestError):
        many.try_reserve_batch({5: 1, 99: 1})
    with pytest.raises(RequestStateError, match="mapping"):
        many.try_reserve_batch([5, 6])  # type: ignore[arg-type]
    with pytest.raises(RequestStateError, match="both reserved and headroom"):
        many.try_reserve_batch({5: 1}, headroom={5: 1})
    small = HybridKVPool(layout, num_pages={"sliding-w4": 64, "full": 4}, page_size=2)
    for rid in (0, 1):
        small.add_request(rid)
        small.reserve(rid, 2)
    before = [tl(page_table(small, r, n)) for r in (0, 1) for n in sub_pool_names(small)]
    assert small.try_reserve_batch({0: 3, 1: 3}) is None  # 2 pages each, 1 free in "full"
    # One fits, but not with room for the other's next token afterwards.
    assert small.try_reserve_batch({0: 2}, headroom={1: 1}) is None
    assert [tl(page_table(small, r, n)) for r in (0, 1) for n in sub_pool_names(small)] == before
    assert small.seq_len(0) == small.seq_len(1) == 2
    got = small.try_reserve_batch({0: 2}, headroom={1: 0})
    assert got is not None and small.seq_len(0) == 4 and small.seq_len(1) == 2
    small.rollback(got)
    assert [tl(page_table(small, r, n)) for r in (0, 1) for n in sub_pool_names(small)] == before
    assert small.seq_len(0) == 2


def test_loader_thread_writes_while_the_model_waits() -> None:
    pool = HybridKVPool(MIXED, num_pages=8, page_size=2)
    pool.add_request(0)
    slots = pool.reserve(0, 3).slots
    # MLX streams are per thread: a lazy graph built in one thread cannot be evaluated in
    # another, so the buffers are materialised before the loader thread writes into them.
    mx.eval(*[pool.get_key_buffer(i) for i in MIXED.attention_layer_ids])
    mx.eval(*[pool.get_value_buffer(i) for i in MIXED.attention_layer_ids])
    counter = LayerDoneCounter(MIXED.attention_layer_ids, timeout=5)
    pool.layer_transfer_counter = counter

    def loader() -> None:
        for layer in MIXED.attention_layer_ids:
            g = MIXED.geometry(layer)
            k = mx.full((3, g.n_kv_heads, g.head_dim), float(layer + 1))
            pool.set_kv(layer, slots[pool.sub_pool_of(layer)], k, -k, wait=False)
            # ... and the loader evaluates its writes before marking the layer done
            mx.eval(
                pool.get_key_buffer(layer, wait=False), pool.get_value_buffer(layer, wait=False)
            )
            counter.mark_done(layer)
            time.sleep(0.01)

    thread = threading.Thread(target=loader)
    thread.start()
    for layer in MIXED.attention_layer_ids:  # the model reads layer by layer, waiting
        k, v = pool.get_kv(layer, pool.token_slots(0, layer, 0, 3))
        assert counter.is_done(layer)
        assert tl(k[:, 0, 0]) == [float(layer + 1)] * 3
        assert tl(v[:, -1, -1]) == [-float(layer + 1)] * 3
    thread.join(5)


@given(
    window=st.integers(1, 12),
    page_sizes=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    concurrency=st.integers(1, 4),
    max_context=st.integers(1, 40),
    chunk=st.integers(1, 16),
    factor=st.sampled_from([1.0, 1.5, 3.0]),
)
def test_from_budget_always_fits_its_workload(
    window: int,
    page_sizes: tuple[int, int],
    concurrency: int,
    max_context: int,
    chunk: int,
    factor: float,
) -> None:
    layout = gpt_oss_like(window=window)
    page_size = dict(zip((f"sliding-w{window}", "full"), page_sizes, strict=True))
    kwargs: dict[str, Any] = {
        "max_context": max_context,
        "concurrency": concurrency,
        "page_size": page_size,
        "prefill_chunk": chunk,
    }
    budget = int(required_bytes(layout, **kwargs) * factor)
    pool = HybridKVPool.from_budget(layout, budget, **kwargs)
    assert pool.memory_report().bytes_total <= budget
    for rid in range(concurrency):
        pool.add_request(rid)
    # round-robin chunks: every request holds its in-flight chunk at the same time
    while any(pool.seq_len(r) < max_context for r in range(concurrency)):
        for rid in range(concurrency):
            n = min(chunk, max_context - pool.seq_len(rid))
            if n:
                pool.reserve(rid, n)


def test_fork_tail_copy_does_not_copy_the_buffer() -> None:
    layout = CacheLayout([full(0, heads=4, dim=32)])
    pool = HybridKVPool(layout, num_pages=2048, page_size=16)
    pool.add_request(0)
    slots = pool.reserve(0, 40).slots["full"]
    kv = mx.random.normal((40, 4, 32))
    pool.set_kv(0, slots, kv, kv)
    mx.eval(pool.get_key_buffer(0), pool.get_value_buffer(0))
    buffer_bytes = pool.get_key_buffer(0).nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    pool.fork_request(0, 1, 37)  # 2 shared pages + a 5-token tail copy
    mx.eval(pool.get_key_buffer(0), pool.get_value_buffer(0))
    assert mx.get_peak_memory() - base < buffer_bytes // 4
    keys, _ = pool.get_kv(0, pool.token_slots(1, 0, 0, 37))
    assert mx.array_equal(keys, kv[:37])
    assert page_table(pool, 1, "full")[2].item() != page_table(pool, 0, "full")[2].item()


class RecordingWriter:
    """A ``kv_protocol.SlotWriter`` that serves only float32 buffers, with MLX's assignment."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, buffer: mx.array, slots: mx.array, rows: mx.array) -> bool:
        self.calls.append(tuple(buffer.shape))
        if buffer.dtype != mx.float32:
            return False
        buffer[:, slots] = rows.transpose(1, 0, 2)
        return True


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_set_kv_hands_plain_buffers_to_the_slot_writer_first(dtype: mx.Dtype) -> None:
    layout = CacheLayout([full(0, dtype=dtype)])
    writer = RecordingWriter()
    pool = HybridKVPool(layout, num_pages=8, page_size=2, slot_writer=writer)
    plain_pool = HybridKVPool(layout, num_pages=8, page_size=2)
    assert pool.slot_writer is writer and plain_pool.slot_writer is None
    for each in (pool, plain_pool):
        each.add_request(0)
        slots = each.reserve(0, 3).slots["full"]
        kv = mx.arange(3 * 2 * 4).reshape(3, 2, 4).astype(dtype)
        each.set_kv(0, slots, kv, kv + 1)
    # Each buffer was offered to the writer; it declined float16 (MLX assigned those).
    assert writer.calls == [(2, 8 * 2, 4)] * 2
    for ours, theirs in (
        (pool.get_key_buffer(0), plain_pool.get_key_buffer(0)),
        (pool.get_value_buffer(0), plain_pool.get_value_buffer(0)),
    ):
        assert np.array_equal(
            np.array(plain(ours).astype(mx.float32)), np.array(plain(theirs).astype(mx.float32))
        )


def test_quantized_pages_never_reach_the_slot_writer() -> None:
    writer = RecordingWriter()
    quant = KVQuantization(bits=8, group_size=32)
    layout = CacheLayout([full(0, dim=64)])
    pool = HybridKVPool(layout, num_pages=8, page_size=2, kv_quantization=quant, slot_writer=writer)
    pool.add_request(0)
    slots = pool.reserve(0, 1).slots["full"]
    pool.set_kv(0, slots, mx.ones((1, 2, 64)), mx.ones((1, 2, 64)))
    assert writer.calls == []
    assert np.allclose(np.array(pool.get_kv(0, slots)[0]), 1.0, atol=0.02)
