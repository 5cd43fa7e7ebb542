"""The per-step batched decode context and the static pool addressing it relies on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    FusedRopeConfigError,
    KernelSet,
    KVPool,
    LayerKind,
    LayerKindError,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    as_int,
    check_int,
)

__all__ = ["FUSED_ROPE_MAP_ERROR", "BatchedDecodeContext", "PoolAddressing"]

#: The exact message raised when the fused kernel is active without the full-layer map.
FUSED_ROPE_MAP_ERROR = (
    "BatchedDecodeContext requires full_kv_pool_index_by_layer when the fused AOT RoPE + "
    "pool-scatter kernel is active"
)


@dataclass(frozen=True)
class PoolAddressing:
    """Static facts about a pool that every decode step needs, derived once per pool.

    ``sub_pool_by_layer`` and ``page_size_by_layer`` cover every attention layer of the
    pool's layout; ``sub_pools`` lists the distinct sub-pool names in first-use order.
    """

    layout: CacheLayout
    sub_pools: tuple[str, ...]
    sub_pool_by_layer: Mapping[int, str]
    page_size_by_layer: Mapping[int, int]

    @classmethod
    def from_pool(cls, pool: KVPool) -> PoolAddressing:
        """Ask ``pool`` once for the sub-pool and page size of each attention layer."""
        layout = pool.layout
        by_layer: dict[int, str] = {}
        page_sizes: dict[int, int] = {}
        names: list[str] = []
        for layer_id in layout.attention_layer_ids:
            name = pool.sub_pool_of(layer_id)
            by_layer[layer_id] = name
            page_sizes[layer_id] = int(pool.page_size(layer_id))
            if name not in names:
                names.append(name)
        return cls(
            layout=layout,
            sub_pools=tuple(names),
            sub_pool_by_layer=MappingProxyType(by_layer),
            page_size_by_layer=MappingProxyType(page_sizes),
        )


def _checked_lengths(request_ids: Sequence[int], seq_lens: Sequence[int]) -> None:
    if len(request_ids) == 0:
        raise RequestStateError(
            "BatchedDecodeContext needs at least one request; got an empty batch"
        )
    if len(request_ids) != len(seq_lens):
        raise RequestStateError(
            f"BatchedDecodeContext got {len(request_ids)} request ids but "
            f"{len(seq_lens)} seq_lens; expected one length per request"
        )
    if len(set(request_ids)) != len(request_ids):
        duplicates = sorted({r for r in request_ids if list(request_ids).count(r) > 1})
        raise RequestStateError(f"request ids must be unique in a batch; duplicated: {duplicates}")
    for rid, length in zip(request_ids, seq_lens, strict=True):
        check_int(rid, "request id")
        check_int(length, f"seq_len of request {rid}", minimum=0)


def _checked_layer_map(value: object, what: str) -> Mapping[int, int]:
    """A read-only copy of a layer-id map whose keys and values are ints (not floats)."""
    if not isinstance(value, Mapping):
        raise LayerKindError(f"{what} must be a mapping of layer id -> index, got {value!r}")
    for key, index in value.items():
        if as_int(key) is None or as_int(index) is None:
            raise LayerKindError(
                f"{what} must map int layer ids to int indices, got {key!r}: {index!r}"
            )
    return MappingProxyType({int(k): int(v) for k, v in value.items()})


@dataclass(frozen=True, eq=False, kw_only=True)
class BatchedDecodeContext:
    """Everything one batched decode step shares across the model's attention layers.

    ``seq_lens[b]`` counts the tokens request ``b`` already has cached, i.e. it is the
    position of the token being decoded. Derived once at construction: ``offsets``
    (int32 ``(B,)``, the RoPE positions), ``max_len = max(seq_lens) + 1``, ``valid_lens =
    offsets + 1`` (keys per request including the new one), ``needs_padding``,
    ``pad_sizes`` (right padding to ``max_len`` per request) and ``positions``
    (``arange(max_len)`` when padding is needed, else ``None``).

    ``attention_pool_index_by_layer`` maps a global layer id to the id under which the
    pool addresses that layer; it defaults to the identity over the layout's attention
    layers (kv-protocol pools translate global ids themselves). ``full_kv_pool_index_by_layer``
    maps each FULL layer to its dense index among full layers; the fused RoPE + scatter
    kernel is only ever addressed through it, and every entry is checked against the
    layout. ``page_tables`` and ``new_token_slots`` hold, per sub-pool, the ``(B,
    max_pages)`` page table and the ``(B,)`` slots of the new tokens for this step.
    """

    request_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    layout: CacheLayout
    aot: KernelSet
    pool: KVPool | None = None
    addressing: PoolAddressing | None = None
    attention_pool_index_by_layer: Mapping[int, int] | None = None
    full_kv_pool_index_by_layer: Mapping[int, int] = field(default_factory=dict)
    page_tables: Mapping[str, mx.array] = field(default_factory=dict)
    new_token_slots: Mapping[str, mx.array] = field(default_factory=dict)

    batch_size: int = field(init=False)
    offsets: mx.array = field(init=False, repr=False)
    max_len: int = field(init=False)
    valid_lens: mx.array = field(init=False, repr=False)
    needs_padding: bool = field(init=False)
    pad_sizes: tuple[int, ...] = field(init=False)
    positions: mx.array | None = field(init=False, repr=False)
    _padding_by_window: dict[int | None, tuple[list[int], mx.array | None]] = field(
        init=False, repr=False
    )
    _gather_by_key: dict[tuple[str, int | None], mx.array] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        setter = object.__setattr__
        request_ids = tuple(self.request_ids)
        seq_lens = tuple(self.seq_lens)
        _checked_lengths(request_ids, seq_lens)
        setter(self, "request_ids", request_ids)
        setter(self, "seq_lens", seq_lens)
        layout = self.layout

        if self.attention_pool_index_by_layer is None:
            attention_map: Mapping[int, int] = MappingProxyType(
                {layer_id: layer_id for layer_id in layout.attention_layer_ids}
            )
        else:
            attention_map = _checked_layer_map(
                self.attention_pool_index_by_layer, "attention_pool_index_by_layer"
            )
            for layer_id in attention_map:
                if layer_id not in layout.attention_index_by_layer:
                    raise LayerKindError(
                        f"attention_pool_index_by_layer names layer {layer_id!r}, which is not "
                        f"an attention layer; attention layers: {layout.attention_layer_ids}"
                    )
        setter(self, "attention_pool_index_by_layer", attention_map)

        full_map = _checked_layer_map(
            self.full_kv_pool_index_by_layer, "full_kv_pool_index_by_layer"
        )
        for layer_id, index in full_map.items():
            if layer_id not in layout.full_attention_layer_id_mapping:
                kind = (
                    layout.kind(layer_id).value
                    if isinstance(layer_id, int) and 0 <= layer_id < layout.num_layers
                    else "unknown"
                )
                raise LayerKindError(
                    f"full_kv_pool_index_by_layer names layer {layer_id!r} ({kind}), which is "
                    f"not a full-attention layer; full layers: {layout.full_layer_ids}"
                )
            expected = layout.full_pool_index(layer_id)
            if index != expected:
                raise LayerKindError(
                    f"full_kv_pool_index_by_layer maps layer {layer_id} to {index!r}, but the "
                    f"layout's full-pool index of that layer is {expected}"
                )
        setter(self, "full_kv_pool_index_by_layer", full_map)
        if self.aot.rope is not None and not full_map:
            raise FusedRopeConfigError(FUSED_ROPE_MAP_ERROR)
        setter(self, "page_tables", MappingProxyType(dict(self.page_tables)))
        setter(self, "new_token_slots", MappingProxyType(dict(self.new_token_slots)))

        longest = max(seq_lens)
        setter(self, "batch_size", len(seq_lens))
        setter(self, "offsets", mx.array(seq_lens, dtype=mx.int32))
        setter(self, "max_len", longest + 1)
        setter(self, "valid_lens", mx.array([s + 1 for s in seq_lens], dtype=mx.int32))
        setter(self, "needs_padding", min(seq_lens) < longest)
        setter(self, "pad_sizes", tuple(longest - s for s in seq_lens))
        setter(self, "positions", mx.arange(longest + 1) if min(seq_lens) < longest else None)
        setter(self, "_padding_by_window", {})
        setter(self, "_gather_by_key", {})

    @classmethod
    def from_pool(
        cls,
        pool: KVPool,
        request_ids: Sequence[int],
        aot: KernelSet,
        *,
        reserve: bool = True,
        addressing: PoolAddressing | None = None,
    ) -> BatchedDecodeContext:
        """Build the context of one decode step for ``request_ids`` from ``pool``.

        ``seq_lens`` are read from the pool *before* the new token is reserved. With
        ``reserve`` (the default) one token is reserved for every request first, with one
        atomic ``reserve_batch`` whose slots become ``new_token_slots``: if the pool cannot
        grant all of them a ``CacheStateError`` is raised and nothing is reserved. Then, per
        sub-pool, the page table of the batch is fetched once. ``addressing`` (from
        :meth:`PoolAddressing.from_pool`) saves re-asking the pool its static layout each
        step. O(B) host work, no sync.
        """
        ids = list(request_ids)
        if not ids:
            raise RequestStateError(
                "BatchedDecodeContext needs at least one request; got an empty batch"
            )
        plan = addressing if addressing is not None else PoolAddressing.from_pool(pool)
        seq_lens = [pool.seq_len(rid) for rid in ids]
        if reserve:
            try:
                reserved = pool.reserve_batch(ids, 1)
            except PoolExhaustedError as err:
                raise CacheStateError(
                    f"the pool cannot hold one more token for each of the {len(ids)} requests "
                    f"{ids}; finish or preempt requests first (nothing was reserved)"
                ) from err
            try:
                # (B, 1) -> (B,) rebuilt from host values, not a lazy reshape: a pool that
                # checks slot arrays it did not issue then reads host data, never device
                # results.
                slots = {
                    name: mx.array(
                        [row[0] for row in cast(list[list[int]], reserved[name].tolist())],
                        dtype=mx.int32,
                    )
                    for name in plan.sub_pools
                }
                page_tables = {name: pool.batch_page_table(ids, name) for name in plan.sub_pools}
            except BaseException:
                # Whatever interrupts the step's setup, the token reserved above goes back.
                for rid in ids:
                    pool.trim_request(rid, 1)
                raise
        else:
            slots = {name: pool.batch_slots(ids, name, seq_lens) for name in plan.sub_pools}
            page_tables = {name: pool.batch_page_table(ids, name) for name in plan.sub_pools}
        return cls(
            request_ids=tuple(ids),
            seq_lens=tuple(seq_lens),
            layout=plan.layout,
            aot=aot,
            pool=pool,
            addressing=plan,
            full_kv_pool_index_by_layer=plan.layout.full_attention_layer_id_mapping,
            page_tables=page_tables,
            new_token_slots=slots,
        )

    def visible_keys(self, window: int | None) -> list[int]:
        """Keys each request's decode query sees, itself included: the one rule of a window.

        ``seq_len + 1`` on a full layer (``window=None``), ``min(seq_len + 1, window)`` on a
        sliding one: the query at position ``p`` sees positions ``p - window + 1 .. p``.
        """
        if window is not None:
            window = check_int(window, "window", minimum=1, error=ShapeMismatchError)
        return [s + 1 if window is None else min(s + 1, window) for s in self.seq_lens]

    def decode_padding(self, window: int | None) -> tuple[list[int], mx.array | None]:
        """Right padding of each request's keys to one width, and the keep-mask.

        Full layers (``window=None``): width ``max(seq_len + 1)``. Sliding layers: each
        request sees ``min(seq_len + 1, window)`` keys (itself included) and the width is
        the largest of those. Returns ``(pad_sizes, mask)`` where ``mask`` is boolean ``(B,
        1, 1, width)``, True for kept keys (``[0, valid)`` of each row), or ``None`` when
        no row needs padding. Memoised per window for the life of the context.
        """
        cached = self._padding_by_window.get(window)
        if cached is not None:
            return list(cached[0]), cached[1]
        valid = self.visible_keys(window)
        width = max(valid)
        pads = [width - v for v in valid]
        mask: mx.array | None = None
        if any(pads):
            keep = mx.arange(width)[None, :] < mx.array(valid, dtype=mx.int32)[:, None]
            mask = keep.reshape(len(valid), 1, 1, width)
        self._padding_by_window[window] = (pads, mask)
        return list(pads), mask

    def visible_slots(self, sub_pool: str, window: int | None, page_size: int) -> mx.array:
        """``(B, width)`` int32 pool slots of the keys each request sees, oldest first.

        Row ``b`` holds the slots of positions ``seq_len + 1 - visible .. seq_len`` (see
        :meth:`visible_keys`) read through the step's page table of ``sub_pool``, then
        right padding that repeats the row's newest slot (masked out by
        :meth:`decode_padding`'s mask of the same window). Memoised per sub-pool and window.
        """
        key = (sub_pool, window)
        cached = self._gather_by_key.get(key)
        if cached is not None:
            return cached
        table = self.page_tables.get(sub_pool)
        if table is None:
            raise CacheStateError(
                f"this BatchedDecodeContext has no page table for sub-pool {sub_pool!r}; "
                "build it with BatchedDecodeContext.from_pool"
            )
        valid = self.visible_keys(window)
        width = max(valid)
        first = mx.array([s + 1 - v for s, v in zip(self.seq_lens, valid, strict=True)])
        newest = mx.array(self.seq_lens, dtype=mx.int32)
        positions = mx.minimum(first[:, None] + mx.arange(width)[None, :], newest[:, None])
        pages = mx.take_along_axis(table, positions // page_size, axis=1)
        slots = (pages * page_size + positions % page_size).astype(mx.int32)
        self._gather_by_key[key] = slots
        return slots

    def sub_pool(self, layer_id: int) -> str:
        """Name of the sub-pool storing ``layer_id`` (needs a context built with addressing)."""
        if self.addressing is None:
            raise CacheStateError(
                "this BatchedDecodeContext was built without pool addressing; build it with "
                "BatchedDecodeContext.from_pool to run batched decode"
            )
        name = self.addressing.sub_pool_by_layer.get(layer_id)
        if name is None:
            raise LayerKindError(
                f"{layer_id=} not in attention layers: {self.addressing.sub_pool_by_layer.keys()}"
            )
        return name

    def pool_layer(self, layer_id: int) -> int:
        """The id under which the pool addresses attention layer ``layer_id``."""
        index_map = self.attention_pool_index_by_layer
        index = index_map.get(layer_id) if index_map is not None else None
        if index is None:
            raise LayerKindError(
                f"{layer_id=} not in attention_pool_index_by_layer: "
                f"{index_map.keys() if index_map is not None else '{}'}"
            )
        return index

    def window(self, layer_id: int) -> int | None:
        """The sliding window of ``layer_id`` per the layout, ``None`` for a full layer."""
        spec = self.layout.spec(layer_id)
        if spec.kind is LayerKind.STATE:
            raise LayerKindError(f"{layer_id=} is a STATE layer; batched decode has no KV there")
        return spec.window
