from __future__ import annotations

from typing import cast

import mlx.core as mx
import pytest
from batching_fakes import FakeKernels, FakeRope, decode_step
from hypothesis import given
from hypothesis import strategies as st

from kv_batching import FUSED_ROPE_MAP_ERROR, BatchedDecodeContext, DecodeRoute
from kv_batching._decode_step import DecodeStep, PoolAddressing, QueryGroups
from kv_batching._layer_cache import BatchedLayerCache, PoolDecodeCache, batched_layer_caches
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVCacheError,
    LayerKind,
    LayerKindError,
    LayerSpec,
    RequestStateError,
    ShapeMismatchError,
)
from kv_testing import ReferenceKVPool


def gpt_oss_like(window: int = 8) -> CacheLayout:
    specs = []
    for i in range(4):
        kind = LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL
        specs.append(
            LayerSpec(
                layer_id=i,
                kind=kind,
                window=window if kind is LayerKind.SLIDING else None,
                n_kv_heads=2,
                head_dim=8,
            )
        )
    return CacheLayout(specs)


def with_state_layer() -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.STATE),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=2, head_dim=8),
            LayerSpec(layer_id=2, kind=LayerKind.SLIDING, window=4, n_kv_heads=2, head_dim=8),
        ]
    )


def ctx(seq_lens: list[int], **kwargs: object) -> BatchedDecodeContext:
    kwargs.setdefault("layout", gpt_oss_like())
    kwargs.setdefault("aot", FakeKernels())
    return BatchedDecodeContext(
        request_ids=tuple(range(len(seq_lens))),
        seq_lens=tuple(seq_lens),
        **kwargs,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- construction and errors


def test_fused_rope_without_full_map_raises_the_exact_error() -> None:
    with pytest.raises(ValueError) as info:
        ctx([3, 5], aot=FakeKernels(rope=FakeRope()))
    assert str(info.value) == (
        "BatchedDecodeContext requires full_kv_pool_index_by_layer when the fused AOT RoPE "
        "+ pool-scatter kernel is active"
    )
    assert str(info.value) == FUSED_ROPE_MAP_ERROR
    assert isinstance(info.value, KVCacheError)


def test_fused_rope_with_full_map_is_accepted() -> None:
    layout = gpt_oss_like()
    c = ctx(
        [3, 5],
        aot=FakeKernels(rope=FakeRope()),
        full_kv_pool_index_by_layer=layout.full_attention_layer_id_mapping,
    )
    assert dict(c.full_kv_pool_index_by_layer) == {1: 0, 3: 1}


def test_empty_batch_is_a_clear_error() -> None:
    with pytest.raises(RequestStateError, match="empty batch"):
        ctx([])
    pool = ReferenceKVPool(gpt_oss_like())
    empty = pool.try_reserve_batch({})
    assert empty is not None
    with pytest.raises(ValueError, match="empty batch"):
        DecodeStep.from_reservation(empty, pool, FakeKernels(), PoolAddressing.from_pool(pool))


@pytest.mark.parametrize(
    ("seq_lens", "ids", "match"),
    [
        ([3, -1], (0, 1), "must be an int >= 0"),
        ([3, 1.5], (0, 1), "must be an int"),
        ([3, 5], (0, 0), "duplicated"),  # one request's rows are at consecutive positions
        ([3, 4, 5], (0, 1, 0), "duplicated"),  # ... and adjacent
        ([4, 3], (0, 0), "duplicated"),
        ([3, 4], (0, 1, 2), "one length per request"),
    ],
)
def test_bad_lengths_and_ids(seq_lens: list[object], ids: tuple[int, ...], match: str) -> None:
    with pytest.raises(RequestStateError, match=match):
        BatchedDecodeContext(
            request_ids=ids,
            seq_lens=tuple(seq_lens),  # type: ignore[arg-type]
            layout=gpt_oss_like(),
            aot=FakeKernels(),
        )


def test_a_verifying_request_takes_adjacent_rows_at_consecutive_positions() -> None:
    c = BatchedDecodeContext(
        request_ids=(7, 7, 7, 2),
        seq_lens=(5, 6, 7, 3),
        layout=gpt_oss_like(),
        aot=FakeKernels(),
    )
    assert c.offsets.tolist() == [5, 6, 7, 3]
    # Each row sees the keys up to its own position: the proposal is attended causally.
    assert c.visible_keys(None) == [6, 7, 8, 4]
    assert c.visible_keys(4) == [4, 4, 4, 4]


def test_attention_map_defaults_to_identity_over_attention_layers() -> None:
    c = ctx([1], layout=with_state_layer())
    assert dict(c.attention_pool_index_by_layer or {}) == {1: 1, 2: 2}
    assert c.pool_layer(2) == 2
    with pytest.raises(LayerKindError):
        c.pool_layer(0)


def test_maps_naming_non_attention_or_wrong_kind_layers_are_refused() -> None:
    layout = with_state_layer()
    with pytest.raises(LayerKindError, match="not an attention layer"):
        ctx([1], layout=layout, attention_pool_index_by_layer={0: 0})
    with pytest.raises(LayerKindError, match="not a full-attention layer"):
        ctx([1], layout=layout, full_kv_pool_index_by_layer={2: 0})
    with pytest.raises(LayerKindError, match="not a full-attention layer"):
        ctx([1], layout=layout, full_kv_pool_index_by_layer={7: 0})
    with pytest.raises(LayerKindError, match="full-pool index of that layer is 0"):
        ctx([1], layout=gpt_oss_like(), full_kv_pool_index_by_layer={1: 1, 3: 0})
    # Errors are also KVCacheError / ValueError for callers catching either.
    with pytest.raises(KVCacheError):
        ctx([1], layout=layout, attention_pool_index_by_layer={0: 0})


def test_derived_values() -> None:
    c = ctx([3, 7, 0])
    assert c.batch_size == 3
    assert c.offsets.tolist() == [3, 7, 0]
    assert c.offsets.dtype == mx.int32
    assert c.max_len == 8
    assert c.valid_lens.tolist() == [4, 8, 1]
    assert c.needs_padding
    assert c.pad_sizes == (4, 0, 7)
    assert c.positions is not None and c.positions.tolist() == list(range(8))
    same = ctx([5, 5])
    assert not same.needs_padding and same.positions is None and same.pad_sizes == (0, 0)


# ---------------------------------------------------------------- decode_padding


def plain_padding(seq_lens: list[int], window: int | None) -> tuple[list[int], list[list[bool]]]:
    valid = [s + 1 if window is None else min(s + 1, window) for s in seq_lens]
    width = max(valid)
    return [width - v for v in valid], [[j < v for j in range(width)] for v in valid]


@given(
    seq_lens=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    window=st.one_of(st.none(), st.integers(1, 24)),
)
def test_decode_padding_matches_plain_python(seq_lens: list[int], window: int | None) -> None:
    c = ctx(seq_lens)
    pads, mask = c.decode_padding(window)
    want_pads, want_mask = plain_padding(seq_lens, window)
    assert pads == want_pads
    if not any(want_pads):
        assert mask is None
    else:
        assert mask is not None
        assert mask.dtype == mx.bool_
        assert mask.shape == (len(seq_lens), 1, 1, len(want_mask[0]))
        assert mask[:, 0, 0, :].tolist() == want_mask
    if window is None:
        assert pads == list(c.pad_sizes)


def test_decode_padding_is_memoised_per_window() -> None:
    c = ctx([2, 9, 4])
    first = c.decode_padding(4)
    again = c.decode_padding(4)
    assert first[1] is again[1]
    assert c.decode_padding(None)[1] is c.decode_padding(None)[1]
    assert c.decode_padding(None)[0] == [7, 0, 5]
    # Every request past the window: no padding, no mask.
    assert c.decode_padding(2) == ([0, 0, 0], None)
    with pytest.raises(ShapeMismatchError, match="window"):
        c.decode_padding(0)


# ---------------------------------------------------------------- from_reservation


def test_a_step_takes_the_reservations_slots_and_its_old_lengths() -> None:
    pool = ReferenceKVPool(gpt_oss_like(window=4), num_pages=32, page_size=2)
    for rid, n in ((10, 5), (11, 1), (12, 9)):
        pool.add_request(rid)
        pool.reserve(rid, n)
    calls = pool.reserve_batch_calls
    step = decode_step(pool, [10, 11, 12], FakeKernels())
    c = step.context
    assert pool.reserve_batch_calls == calls + 1  # one atomic reservation for the whole batch
    assert c.seq_lens == (5, 1, 9)
    assert [pool.seq_len(r) for r in (10, 11, 12)] == [6, 2, 10]
    assert step.addressing.sub_pools == ("sliding", "full")
    for name in ("full", "sliding"):
        layer = 1 if name == "full" else 0
        want = [
            pool.token_slots(r, layer, s, s + 1).item()
            for r, s in zip((10, 11, 12), c.seq_lens, strict=True)
        ]
        sub = step.sub_pools[name]
        assert sub.new_token_slots.tolist() == want
        assert sub.new_token_slots.dtype == mx.int32
        assert sub.page_table.tolist() == pool.batch_page_table([10, 11, 12], name).tolist()
    assert dict(c.full_kv_pool_index_by_layer) == {1: 0, 3: 1}
    # Each attention layer's own view: its sub-pool's arrays, page size and window.
    for layer_id in range(4):
        view = step.layer(layer_id)
        name = "sliding" if layer_id % 2 == 0 else "full"
        assert view.layer_id == layer_id and view.pool_layer == layer_id
        assert view.sub_pool == name and view.page_size == 2
        assert view.window == (4 if name == "sliding" else None)
        assert view.new_token_slots is step.sub_pools[name].new_token_slots
        assert view.page_table is step.sub_pools[name].page_table
        assert view.route == "unfused" and view.context is c and view.pool is pool
    with pytest.raises(LayerKindError, match="not an attention layer"):
        step.layer(4)


def test_a_step_takes_a_row_per_reserved_token() -> None:
    pool = ReferenceKVPool(gpt_oss_like(window=64), num_pages=3, page_size=2)
    pool.add_request(0)
    pool.add_request(1)
    pool.reserve(0, 2)
    pool.reserve(1, 2)
    before = (pool.seq_len(0), pool.seq_len(1), pool.free_pages())
    assert pool.try_reserve_batch({0: 1, 1: 1}) is None  # no room: nothing reserved
    assert (pool.seq_len(0), pool.seq_len(1), pool.free_pages()) == before
    pool.free_request(1)
    chunk = pool.try_reserve_batch({0: 2})
    assert chunk is not None
    # Two reserved tokens (a verification): two rows at consecutive positions, one table.
    step = DecodeStep.from_reservation(chunk, pool, FakeKernels(), PoolAddressing.from_pool(pool))
    assert step.context.request_ids == (0, 0) and step.context.seq_lens == (2, 3)
    for name, sub in step.sub_pools.items():
        table = chunk.page_tables[name].tolist()
        assert sub.page_table.tolist() == table * 2
        assert sub.new_token_slots.tolist() == chunk.slots[name].tolist()
        assert sub.request_page_table is not None
        assert sub.request_page_table.tolist() == table
    queries = step.queries
    assert queries is not None and queries.width == 2
    assert queries.seq_lens.tolist() == [4]
    none = pool.try_reserve_batch({0: 0})
    assert none is not None
    with pytest.raises(CacheStateError, match="at least one reserved token per request"):
        DecodeStep.from_reservation(none, pool, FakeKernels(), PoolAddressing.from_pool(pool))


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 50)), min_size=1, max_size=6))
def test_query_groups_put_each_request_s_rows_last_in_its_grid_row(
    requests: list[tuple[int, int]],
) -> None:
    counts = [n for n, _ in requests]
    starts = [start for _, start in requests]
    groups = QueryGroups.from_counts(counts, starts)
    width = max(counts)
    assert groups.width == width
    owner = [r for r, n in enumerate(counts) for _ in range(n)]
    offset = [i for n in counts for i in range(n)]
    rows = cast(list[int], groups.rows.tolist())
    cells = cast(list[int], groups.cells.tolist())
    assert len(rows) == len(counts) * width and len(cells) == sum(counts)
    # Every row reads back its own query, from the cell at its position in the grid.
    assert [rows[c] for c in cells] == list(range(sum(counts)))
    for row, cell in enumerate(cells):
        r, column = divmod(cell, width)
        assert r == owner[row] and column == width - counts[r] + offset[row]
    # Padding cells repeat a row of their own request.
    assert all(owner[rows[c]] == c // width for c in range(len(rows)))
    assert groups.seq_lens.tolist() == [s + n for n, s in requests]


def test_a_plain_step_has_no_query_groups() -> None:
    pool = ReferenceKVPool(gpt_oss_like(), num_pages=8, page_size=4)
    pool.add_request(0)
    pool.add_request(1)
    chunk = pool.try_reserve_batch({0: 1, 1: 1})
    assert chunk is not None
    step = DecodeStep.from_reservation(chunk, pool, FakeKernels(), PoolAddressing.from_pool(pool))
    assert step.queries is None
    assert all(sub.request_page_table is None for sub in step.sub_pools.values())
    assert step.layer(step.context.layout.attention_layer_ids[0]).queries is None


def test_a_step_needs_every_sub_pool() -> None:
    pool = ReferenceKVPool(gpt_oss_like(), num_pages=8, page_size=4)
    pool.add_request(0)
    pool.reserve(0, 2)
    full = decode_step(pool, [0], FakeKernels())
    with pytest.raises(CacheStateError, match=r"missing \['full'\]"):
        DecodeStep(
            context=full.context,
            pool=pool,
            kernels=FakeKernels(),
            addressing=full.addressing,
            sub_pools={"sliding": full.sub_pools["sliding"]},
        )


def test_pool_addressing() -> None:
    pool = ReferenceKVPool(gpt_oss_like(), num_pages=8, page_size=4, sliding_page_size=2)
    plan = PoolAddressing.from_pool(pool, {1: "fused", 2: "universal"})
    assert {i: a.route for i, a in plan.layers.items()} == {
        0: "unfused",
        1: "fused",
        2: "universal",
        3: "unfused",
    }
    assert plan.layers_on("universal") == {2} and plan.route_of(1) == "fused"
    assert {i: a.sub_pool for i, a in plan.layers.items()} == {
        0: "sliding",
        1: "full",
        2: "sliding",
        3: "full",
    }
    assert {i: a.page_size for i, a in plan.layers.items()} == {0: 2, 1: 4, 2: 2, 3: 4}
    assert {i: a.full_pool_index for i, a in plan.layers.items()} == {
        0: None,
        1: 0,
        2: None,
        3: 1,
    }
    assert {i: a.window for i, a in plan.layers.items()} == {0: 8, 1: None, 2: 8, 3: None}


# ---------------------------------------------------------------- the layer cache shim


def step_of(
    seq_lens: list[int],
    layout: CacheLayout | None = None,
    routes: dict[int, DecodeRoute] | None = None,
) -> DecodeStep:
    pool = ReferenceKVPool(layout or gpt_oss_like(), num_pages=32, page_size=4)
    for rid, n in enumerate(seq_lens):
        pool.add_request(rid)
        pool.reserve(rid, n)
    return decode_step(pool, list(range(len(seq_lens))), FakeKernels(), routes=routes)


def test_batched_layer_cache_is_a_data_free_shim() -> None:
    shims = batched_layer_caches(step_of([4, 9]))
    assert [s.layer_id for s in shims] == [0, 1, 2, 3]
    shim = shims[1]
    assert isinstance(shim, BatchedLayerCache)
    assert shim.offset == 9
    assert shim.state == ()
    # The same keep-mask a universal layer of that window needs (a container may share one
    # mask between fast and universal layers): lengths 5 and 10 keys, 4 and 4 in a window 4.
    full = shim.make_mask(1)
    assert isinstance(full, mx.array) and full.shape == (2, 1, 1, 10)
    assert full[:, 0, 0, :].tolist() == [[True] * 5 + [False] * 5, [True] * 10]
    assert shim.make_mask(1, window_size=4) is None  # both rows see 4 keys: no padding
    windowed = shim.make_mask(1, window_size=4, return_array=True)
    assert isinstance(windowed, mx.array) and windowed.shape == (2, 1, 1, 4)
    assert bool(mx.all(windowed))
    assert shim.empty() and shim.nbytes == 0 and not shim.is_trimmable() and shim.trim(3) == 0
    with pytest.raises(CacheStateError, match="one query per request"):
        shim.make_mask(3)
    with pytest.raises(CacheStateError, match="planned for the patched fast path"):
        shim.update_and_fetch(mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 1, 8)))
    assert "layer_id=1" in repr(shim)


def test_layer_caches_by_path_and_none_for_state_layers() -> None:
    caches = batched_layer_caches(step_of([2, 5], with_state_layer(), routes={2: "universal"}))
    assert caches[0] is None  # a STATE layer: its stacked recurrent state goes there
    assert isinstance(caches[1], BatchedLayerCache)
    assert isinstance(caches[2], PoolDecodeCache) and caches[2].layer.window == 4
    assert caches[2].offset.tolist() == [2, 5]


@pytest.mark.parametrize(
    "maps",
    [
        {"attention_pool_index_by_layer": {1.0: 0}},
        {"attention_pool_index_by_layer": {0: 0.0}},
        {"attention_pool_index_by_layer": [0, 1]},
        {"full_kv_pool_index_by_layer": {1.0: 0}},
        {"full_kv_pool_index_by_layer": {True: 0}},
        {"full_kv_pool_index_by_layer": 5},
    ],
)
def test_layer_maps_take_int_ids_only(maps: dict[str, object]) -> None:
    with pytest.raises(LayerKindError, match="layer id"):
        ctx([3, 5], **maps)
