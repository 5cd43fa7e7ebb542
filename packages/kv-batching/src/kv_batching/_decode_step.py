"""One batched decode step through a pool, and each attention layer's own view of it.

:class:`PoolAddressing` holds what never changes for an engine's pool (each attention layer's
sub-pool, page size, window, full-pool index and decode route). :class:`DecodeStep` is one
step, built from the scheduler's :class:`kv_protocol.Reservation` of one token per request:
the padding arithmetic (:class:`BatchedDecodeContext`), the pool, the kernels, and per
sub-pool the step's new-token slots and page table. :meth:`DecodeStep.layer` hands each
attention layer a :class:`LayerStep` with everything its cache or wrapper reads, so no layer
looks anything up through optional fields.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KernelSet,
    KVLifetime,
    KVPool,
    LayerKindError,
    MaskSpec,
    RequestStateError,
    Reservation,
)

from ._context import BatchedDecodeContext

__all__ = [
    "DECODE_ROUTES",
    "DecodeRoute",
    "DecodeStep",
    "LayerAddress",
    "LayerStep",
    "PoolAddressing",
    "QueryGroups",
    "SubPoolStep",
]

#: How one attention layer decodes, decided once when the engine is built:
#: ``fused``: wrapped module, the fused RoPE + pool-scatter kernel, paged attention;
#: ``unfused``: wrapped module, ``mx.fast.rope`` and the pool's ``set_kv``, paged attention;
#: ``universal``: the unmodified module on a :class:`~kv_batching.PoolDecodeCache`.
DecodeRoute = Literal["fused", "unfused", "universal"]
DECODE_ROUTES: tuple[DecodeRoute, ...] = ("fused", "unfused", "universal")


@dataclass(frozen=True, kw_only=True)
class LayerAddress:
    """Where one attention layer's K/V live in a pool and how it decodes; fixed per engine.

    ``full_pool_index`` is the layer's dense index among FULL layers (the only way the fused
    RoPE + scatter kernel is addressed), ``None`` on a sliding layer. ``quantized`` says the
    layer's pages are stored quantized (only the pool's ``set_kv`` writes them). ``route`` is
    the layer's :data:`DecodeRoute`; the wrapper, the step and the runner read it and nothing
    else to decide how the layer decodes.
    """

    layer_id: int
    sub_pool: str
    page_size: int
    window: int | None
    full_pool_index: int | None
    quantized: bool = False
    route: DecodeRoute = "unfused"


@dataclass(frozen=True)
class PoolAddressing:
    """Static facts about a pool that every decode step needs, derived once per pool.

    ``layers`` has one :class:`LayerAddress` per attention layer of the pool's layout;
    ``sub_pools`` lists the distinct sub-pool names in first-use order.
    """

    layout: CacheLayout
    sub_pools: tuple[str, ...]
    layers: Mapping[int, LayerAddress]

    @classmethod
    def from_pool(
        cls, pool: KVPool, routes: Mapping[int, DecodeRoute] | None = None
    ) -> PoolAddressing:
        """Ask ``pool`` once for the sub-pool and page size of each attention layer.

        ``routes`` gives each attention layer its decode route (``"unfused"`` where absent).
        """
        routes = routes or {}
        layout = pool.layout
        full_index = layout.full_attention_layer_id_mapping
        layers: dict[int, LayerAddress] = {}
        names: list[str] = []
        for layer_id in layout.attention_layer_ids:
            name = pool.sub_pool_of(layer_id)
            layers[layer_id] = LayerAddress(
                layer_id=layer_id,
                sub_pool=name,
                page_size=int(pool.page_size(layer_id)),
                window=layout.spec(layer_id).window,
                full_pool_index=full_index.get(layer_id),
                quantized=pool.kv_quantization(layer_id) is not None,
                route=routes.get(layer_id, "unfused"),
            )
            if name not in names:
                names.append(name)
        return cls(layout=layout, sub_pools=tuple(names), layers=MappingProxyType(layers))

    def route_of(self, layer_id: int) -> DecodeRoute:
        """The decode route of attention layer ``layer_id``."""
        return self.layers[layer_id].route

    def layers_on(self, route: DecodeRoute) -> frozenset[int]:
        """The attention layers that decode on ``route``."""
        return frozenset(i for i, a in self.layers.items() if a.route == route)


@dataclass(frozen=True, kw_only=True, eq=False)
class SubPoolStep:
    """One sub-pool's part of a step.

    ``new_token_slots``: the ``(B,)`` int32 slots of the new tokens; ``page_table``: the
    ``(B, max_pages)`` page table of the batch's rows; ``request_page_table``: in a step
    where requests verify proposals (several rows each), the ``(R, max_pages)`` table with
    one row per request, else ``None``.
    """

    name: str
    new_token_slots: mx.array
    page_table: mx.array
    request_page_table: mx.array | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class QueryGroups:
    """The rows of a step where requests verify proposals, as a grid of queries per request.

    Request ``r`` has ``n_r`` adjacent rows (its last token and its proposal) at
    consecutive positions; the grid gives it ``width = max(n_r)`` query cells, its rows in
    the last ``n_r`` (the first ``width - n_r`` cells are padding that repeats its first
    row). ``rows`` (``(R * width,)`` int32) is the step row each cell reads, ``cells``
    (``(B,)`` int32) the cell each row's output comes from, ``seq_lens`` (``(R,)`` int32)
    each request's tokens up to and including its last row's: what
    :class:`kv_protocol.PagedQueryAttention` takes, so a request's pages are read once for
    all its rows.
    """

    width: int
    rows: mx.array
    cells: mx.array
    seq_lens: mx.array

    @classmethod
    def from_counts(cls, counts: Sequence[int], start_lengths: Sequence[int]) -> QueryGroups:
        """The grid of requests with ``counts[r]`` rows from position ``start_lengths[r]``."""
        width = max(counts)
        rows: list[int] = []
        cells: list[int] = []
        first = 0
        for r, n in enumerate(counts):
            pad = width - n
            rows.extend(first + max(0, cell - pad) for cell in range(width))
            cells.extend(r * width + pad + i for i in range(n))
            first += n
        return cls(
            width=width,
            rows=mx.array(rows, dtype=mx.int32),
            cells=mx.array(cells, dtype=mx.int32),
            seq_lens=mx.array(
                [start + n for start, n in zip(start_lengths, counts, strict=True)],
                dtype=mx.int32,
            ),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class LayerStep:
    """What one attention layer reads during one batched decode step.

    ``pool_layer`` is the id under which the pool addresses the layer; ``route`` is how it
    decodes (see :data:`DecodeRoute`). It refers to its step weakly (the step holds its
    layers), so a finished step is freed at once, not by the cycle collector.
    """

    step_ref: weakref.ReferenceType[DecodeStep]
    layer_id: int
    pool_layer: int
    sub_pool: str
    page_size: int
    window: int | None
    new_token_slots: mx.array
    page_table: mx.array
    route: DecodeRoute
    request_page_table: mx.array | None = None

    @property
    def step(self) -> DecodeStep:
        """The decode step this view belongs to (alive while the step is used)."""
        step = self.step_ref()
        if step is None:
            raise CacheStateError(
                f"the decode step of layer {self.layer_id}'s view is gone; a layer view is "
                "used during its step only"
            )
        return step

    @property
    def context(self) -> BatchedDecodeContext:
        """The step's shared lengths, offsets and padding."""
        return self.step.context

    @property
    def pool(self) -> KVPool:
        """The pool holding the layer's K/V."""
        return self.step.pool

    @property
    def kernels(self) -> KernelSet:
        """The step's RoPE + scatter and paged attention kernels."""
        return self.step.kernels

    @property
    def queries(self) -> QueryGroups | None:
        """The step's rows as queries per request where requests verify proposals."""
        return self.step.queries

    def visible_slots(self) -> mx.array:
        """``(B, width)`` pool slots of the keys each row sees (see DecodeStep.visible_slots)."""
        return self.step.visible_slots(self.sub_pool, self.window, self.page_size)

    def make_mask(self, N: int, *, window_size: int | None, return_array: bool) -> MaskSpec:
        """The keep-mask a single-query decode step needs for this layer's keys.

        ``window_size`` (what a model container asks for) wins over the layer's own window,
        as mlx-lm's caches do. ``None`` when no row needs padding, unless ``return_array``.
        """
        if N != 1:
            raise CacheStateError(
                f"batched decode serves one query per request; layer {self.layer_id}'s cache "
                f"was asked for a mask of {N} queries (prefill and extend go through "
                "per-request caches)"
            )
        context = self.step.context
        window = window_size if window_size is not None else self.window
        _, mask = context.decode_padding(window)
        if mask is None and return_array:
            width = max(context.visible_keys(window))
            mask = mx.ones((context.batch_size, 1, 1, width), dtype=mx.bool_)
        return mask


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodeStep:
    """One batched decode step of ``context.request_ids`` through ``pool``.

    Every field is set: the step's padding arithmetic, the pool, the kernels, the pool's
    addressing and, per sub-pool, the step's slots and page table (:class:`SubPoolStep`).
    :meth:`layer` gives each attention layer its :class:`LayerStep`, built once per step.
    Build it with :meth:`from_reservation`.
    """

    context: BatchedDecodeContext
    pool: KVPool
    kernels: KernelSet
    addressing: PoolAddressing
    sub_pools: Mapping[str, SubPoolStep]
    queries: QueryGroups | None = None
    layers: Mapping[int, LayerStep] = field(init=False, repr=False)
    _gather_by_key: dict[tuple[str, int | None], mx.array] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        setter = object.__setattr__
        missing = [n for n in self.addressing.sub_pools if n not in self.sub_pools]
        if missing:
            raise CacheStateError(
                f"a DecodeStep needs the slots and page table of every sub-pool; missing "
                f"{missing} (build it with DecodeStep.from_reservation)"
            )
        layers: dict[int, LayerStep] = {}
        for layer_id, address in self.addressing.layers.items():
            sub = self.sub_pools[address.sub_pool]
            layers[layer_id] = LayerStep(
                step_ref=weakref.ref(self),
                layer_id=layer_id,
                pool_layer=self.context.pool_layer(layer_id),
                sub_pool=address.sub_pool,
                page_size=address.page_size,
                window=address.window,
                new_token_slots=sub.new_token_slots,
                page_table=sub.page_table,
                route=address.route,
                request_page_table=sub.request_page_table,
            )
        setter(self, "layers", MappingProxyType(layers))
        setter(self, "_gather_by_key", {})

    @classmethod
    def from_reservation(
        cls,
        reservation: Reservation,
        pool: KVPool,
        kernels: KernelSet,
        addressing: PoolAddressing,
    ) -> DecodeStep:
        """The decode step of the requests ``reservation`` reserved tokens for.

        A request with one reserved token is one row at its start length; one with ``n``
        (a speculative verification: its last token and ``n - 1`` proposed ones) is ``n``
        adjacent rows at positions ``start .. start + n - 1``, each with the request's page
        table, so each query attends causally up to its own position. The new-token slots
        are the reservation's own (already in that row order) and nothing is asked of the
        pool. O(rows), no sync.
        """
        ids = list(reservation.request_ids)
        if not ids:
            raise RequestStateError(
                "BatchedDecodeContext needs at least one request; got an empty batch"
            )
        counts = reservation.n_tokens
        if any(n < 1 for n in counts):
            raise CacheStateError(
                f"a decode step takes at least one reserved token per request; the "
                f"reservation holds {list(counts)}"
            )
        seq_lens: tuple[int, ...] = tuple(reservation.start_lengths)
        row_of: mx.array | None = None
        if any(n != 1 for n in counts):
            ids = [rid for rid, n in zip(ids, counts, strict=True) for _ in range(n)]
            seq_lens = tuple(
                start + i
                for start, n in zip(reservation.start_lengths, counts, strict=True)
                for i in range(n)
            )
            row_of = mx.array([b for b, n in enumerate(counts) for _ in range(n)], dtype=mx.int32)
        context = BatchedDecodeContext(
            request_ids=tuple(ids),
            seq_lens=seq_lens,
            layout=addressing.layout,
            aot=kernels,
            full_kv_pool_index_by_layer=addressing.layout.full_attention_layer_id_mapping,
        )
        subs = {
            name: SubPoolStep(
                name=name,
                new_token_slots=reservation.slots[name],
                page_table=(
                    reservation.page_tables[name]
                    if row_of is None
                    else mx.take(reservation.page_tables[name], row_of, axis=0)
                ),
                request_page_table=None if row_of is None else reservation.page_tables[name],
            )
            for name in addressing.sub_pools
            if name in reservation.slots
        }
        queries = (
            None if row_of is None else QueryGroups.from_counts(counts, reservation.start_lengths)
        )
        return cls(
            context=context,
            pool=pool,
            kernels=kernels,
            addressing=addressing,
            sub_pools=subs,
            queries=queries,
        )

    def layer(self, layer_id: int) -> LayerStep:
        """The view of attention layer ``layer_id`` for this step."""
        view = self.layers.get(layer_id)
        if view is None:
            raise LayerKindError(
                f"{layer_id=} is not an attention layer of the pool; attention layers: "
                f"{tuple(self.layers)}"
            )
        return view

    def visible_slots(self, sub_pool: str, window: int | None, page_size: int) -> mx.array:
        """``(B, width)`` int32 pool slots of the keys each request sees, oldest first.

        Row ``b`` holds the slots of positions ``seq_len + 1 - visible .. seq_len`` (see
        :meth:`BatchedDecodeContext.visible_keys`) read through the step's page table of
        ``sub_pool``, then right padding that repeats the row's newest slot (masked out by
        :meth:`BatchedDecodeContext.decode_padding`'s mask of the same window). Memoised per
        sub-pool and window.
        """
        key = (sub_pool, window)
        cached = self._gather_by_key.get(key)
        if cached is not None:
            return cached
        sub = self.sub_pools.get(sub_pool)
        if sub is None:
            raise CacheStateError(
                f"this DecodeStep has no page table for sub-pool {sub_pool!r}; its sub-pools: "
                f"{tuple(self.sub_pools)}"
            )
        seq_lens = self.context.seq_lens
        lifetime = KVLifetime(window)
        width = max(self.context.visible_keys(window))
        first = mx.array([lifetime.first_visible(s) for s in seq_lens], dtype=mx.int32)
        newest = mx.array(seq_lens, dtype=mx.int32)
        positions = mx.minimum(first[:, None] + mx.arange(width)[None, :], newest[:, None])
        pages = mx.take_along_axis(sub.page_table, positions // page_size, axis=1)
        slots = (pages * page_size + positions % page_size).astype(mx.int32)
        self._gather_by_key[key] = slots
        return slots
