"""One batched decode step through a pool, and each attention layer's own view of it.

:class:`PoolAddressing` holds what never changes for a pool (each attention layer's sub-pool,
page size, window and full-pool index). :class:`DecodeStep` is one step: the padding
arithmetic (:class:`BatchedDecodeContext`), the pool, the kernels, and per sub-pool the
step's new-token slots and page table. :meth:`DecodeStep.layer` hands each attention layer a
:class:`LayerStep` with everything its cache or wrapper reads, so no layer looks anything up
through optional fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KernelSet,
    KVLifetime,
    KVPool,
    LayerKindError,
    MaskSpec,
    PoolExhaustedError,
    RequestStateError,
)

from ._context import BatchedDecodeContext

__all__ = ["DecodeStep", "LayerAddress", "LayerStep", "PoolAddressing", "SubPoolStep"]


@dataclass(frozen=True, kw_only=True)
class LayerAddress:
    """Where one attention layer's K/V live in a pool; fixed for the life of the pool.

    ``full_pool_index`` is the layer's dense index among FULL layers (the only way the fused
    RoPE + scatter kernel is addressed), ``None`` on a sliding layer. ``quantized`` says the
    layer's pages are stored quantized (only the pool's ``set_kv`` writes them, so the fused
    RoPE + scatter kernel, which writes plain pages, is not used for the layer).
    """

    layer_id: int
    sub_pool: str
    page_size: int
    window: int | None
    full_pool_index: int | None
    quantized: bool = False


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
    def from_pool(cls, pool: KVPool) -> PoolAddressing:
        """Ask ``pool`` once for the sub-pool and page size of each attention layer."""
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
            )
            if name not in names:
                names.append(name)
        return cls(layout=layout, sub_pools=tuple(names), layers=MappingProxyType(layers))


@dataclass(frozen=True, kw_only=True, eq=False)
class SubPoolStep:
    """One sub-pool's part of a step.

    ``new_token_slots``: the ``(B,)`` int32 slots of the new tokens; ``page_table``: the
    ``(B, max_pages)`` page table of the batch.
    """

    name: str
    new_token_slots: mx.array
    page_table: mx.array


@dataclass(frozen=True, kw_only=True, eq=False)
class LayerStep:
    """What one attention layer reads during one batched decode step.

    ``pool_layer`` is the id under which the pool addresses the layer; ``fused_rope`` says
    whether the step's kernels have a fused RoPE + scatter kernel that may address this
    layer (a FULL layer); whether a module's RoPE is one the kernel implements is the
    wrapper's question.
    """

    step: DecodeStep
    layer_id: int
    pool_layer: int
    sub_pool: str
    page_size: int
    window: int | None
    new_token_slots: mx.array
    page_table: mx.array
    fused_rope: bool

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
    """

    context: BatchedDecodeContext
    pool: KVPool
    kernels: KernelSet
    addressing: PoolAddressing
    sub_pools: Mapping[str, SubPoolStep]
    layers: Mapping[int, LayerStep] = field(init=False, repr=False)
    _gather_by_key: dict[tuple[str, int | None], mx.array] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        setter = object.__setattr__
        missing = [n for n in self.addressing.sub_pools if n not in self.sub_pools]
        if missing:
            raise CacheStateError(
                f"a DecodeStep needs the slots and page table of every sub-pool; missing "
                f"{missing} (build it with DecodeStep.from_pool)"
            )
        fused = self.kernels.rope is not None
        full_map = self.context.full_kv_pool_index_by_layer
        layers: dict[int, LayerStep] = {}
        for layer_id, address in self.addressing.layers.items():
            sub = self.sub_pools[address.sub_pool]
            layers[layer_id] = LayerStep(
                step=self,
                layer_id=layer_id,
                pool_layer=self.context.pool_layer(layer_id),
                sub_pool=address.sub_pool,
                page_size=address.page_size,
                window=address.window,
                new_token_slots=sub.new_token_slots,
                page_table=sub.page_table,
                fused_rope=fused and layer_id in full_map and not address.quantized,
            )
        setter(self, "layers", MappingProxyType(layers))
        setter(self, "_gather_by_key", {})

    @classmethod
    def from_pool(
        cls,
        pool: KVPool,
        request_ids: Sequence[int],
        kernels: KernelSet,
        *,
        reserve: bool = True,
        addressing: PoolAddressing | None = None,
    ) -> DecodeStep:
        """Build the decode step of ``request_ids`` from ``pool``.

        ``seq_lens`` are read from the pool *before* the new token is reserved. With
        ``reserve`` (the default) one token is reserved for every request first, with one
        atomic ``reserve_batch`` whose slots become the new-token slots: if the pool cannot
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
        context = BatchedDecodeContext(
            request_ids=tuple(ids),
            seq_lens=tuple(seq_lens),
            layout=plan.layout,
            aot=kernels,
            full_kv_pool_index_by_layer=plan.layout.full_attention_layer_id_mapping,
        )
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
                subs = {
                    name: SubPoolStep(
                        name=name,
                        new_token_slots=mx.array(
                            [row[0] for row in cast(list[list[int]], reserved[name].tolist())],
                            dtype=mx.int32,
                        ),
                        page_table=pool.batch_page_table(ids, name),
                    )
                    for name in plan.sub_pools
                }
            except BaseException:
                # Whatever interrupts the step's setup, the token reserved above goes back.
                for rid in ids:
                    pool.trim_request(rid, 1)
                raise
        else:
            subs = {
                name: SubPoolStep(
                    name=name,
                    new_token_slots=pool.batch_slots(ids, name, seq_lens),
                    page_table=pool.batch_page_table(ids, name),
                )
                for name in plan.sub_pools
            }
        return cls(context=context, pool=pool, kernels=kernels, addressing=plan, sub_pools=subs)

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
