"""Sizing a pool: which sub-pools a layout needs, their specs, and pages for a workload."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    KVGeometry,
    KVLifetime,
    KVQuantization,
    LayerKind,
    LayerSpec,
    LayoutError,
    PoolExhaustedError,
    check_int,
    check_quantization_keys,
    kv_quantization_for,
)

#: A pool's ``kv_quantization`` argument: one for all sub-pools, or by sub-pool name / kind.
QuantizationArg = KVQuantization | Mapping[str, KVQuantization | None] | None

__all__ = [
    "MAX_SLOTS_PER_LAYER",
    "QuantizationArg",
    "SubPoolGroup",
    "SubPoolSpec",
    "budget_page_counts",
    "check_slot_capacity",
    "pages_per_request",
    "per_sub_pool",
    "required_bytes",
    "stored_bytes_per_token",
    "sub_pool_groups",
    "sub_pool_specs",
]

#: Slots are int32: a layer buffer holds at most this many token slots.
MAX_SLOTS_PER_LAYER = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class SubPoolSpec:
    """One sub-pool: a lifetime kind, a window, one KV geometry, its layers and its paging.

    ``quantization`` is how its pages store K/V (``None``: in the geometry's dtype).
    """

    name: str
    kind: LayerKind
    window: int | None
    geometry: KVGeometry
    layer_ids: tuple[int, ...]
    page_size: int
    num_pages: int
    quantization: KVQuantization | None = None

    @property
    def lifetime(self) -> KVLifetime:
        """Which cached positions the sub-pool's queries see (its window, or all)."""
        return KVLifetime(self.window)

    @property
    def bytes_per_token(self) -> int:
        """Stored K+V bytes of one token over every layer (quantized data, scales, biases)."""
        return stored_bytes_per_token(self.geometry, self.quantization) * len(self.layer_ids)

    @property
    def bytes_per_page(self) -> int:
        """Stored K+V bytes of one page over every layer of the sub-pool."""
        return self.page_size * self.bytes_per_token

    @property
    def num_slots(self) -> int:
        """Token slots per layer buffer, the null page included."""
        return self.num_pages * self.page_size


@dataclass(frozen=True, kw_only=True)
class SubPoolGroup:
    """The layers one sub-pool stores, before it is paged: kind, window, geometry, layer ids.

    ``quantization`` is how its pages will store K/V (``None``: in the geometry's dtype).
    """

    name: str
    kind: LayerKind
    window: int | None
    geometry: KVGeometry
    layer_ids: tuple[int, ...]
    quantization: KVQuantization | None = None

    @property
    def bytes_per_token(self) -> int:
        """Stored K+V bytes of one token over every layer of the group."""
        return stored_bytes_per_token(self.geometry, self.quantization) * len(self.layer_ids)


def stored_bytes_per_token(geometry: KVGeometry, quantization: KVQuantization | None) -> int:
    """Bytes one token of one layer occupies in a page: plain, or quantized with its scales."""
    if quantization is None:
        return geometry.bytes_per_token
    return quantization.bytes_per_token(geometry)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def sub_pool_groups(
    layout: CacheLayout, kv_quantization: QuantizationArg = None
) -> tuple[SubPoolGroup, ...]:
    """FULL and SLIDING layers grouped by (kind, window, geometry), ordered by first layer id.

    Named ``"full"`` and ``"sliding-w<W>"``, with a ``-<heads>x<head_dim>`` suffix (``v<dim>``
    for a narrower V, and a dtype suffix if dtypes differ) when the layers have several
    geometries. STATE layers store nothing in a pool. ``kv_quantization`` (one
    :class:`~kv_protocol.KVQuantization` for all, or a mapping by sub-pool name or layer kind)
    sets each group's page format; a head width its groups do not tile is a ``LayoutError``.
    """
    keyed: dict[tuple[LayerKind, int | None, int, int, int, str], list[LayerSpec]] = {}
    for spec in layout.specs:
        if spec.kind is LayerKind.STATE:
            continue
        g = spec.geometry
        key = (spec.kind, spec.window, g.n_kv_heads, g.head_dim, g.value_dim, str(g.dtype))
        keyed.setdefault(key, []).append(spec)
    geometries = {k[2:] for k in keyed}
    dtypes = {k[5] for k in keyed}
    groups: list[SubPoolGroup] = []
    for specs in keyed.values():
        first = specs[0]
        geometry = first.geometry
        name = "full" if first.kind is LayerKind.FULL else f"sliding-w{first.window}"
        if len(geometries) > 1:
            name += f"-{geometry.n_kv_heads}x{geometry.head_dim}"
            if geometry.v_head_dim is not None:
                name += f"v{geometry.v_head_dim}"
            if len(dtypes) > 1:
                name += f"-{_dtype_name(geometry.dtype)}"
        groups.append(
            SubPoolGroup(
                name=name,
                kind=first.kind,
                window=first.window,
                geometry=geometry,
                layer_ids=tuple(s.layer_id for s in specs),
            )
        )
    check_quantization_keys(kv_quantization, [g.name for g in groups])
    quantized = []
    for group in groups:
        quant = kv_quantization_for(kv_quantization, sub_pool=group.name, kind=group.kind)
        if quant is not None:
            g = group.geometry
            quant.check_dim(g.head_dim, f"sub-pool {group.name!r} keys")
            quant.check_dim(g.value_dim, f"sub-pool {group.name!r} values")
        quantized.append(replace(group, quantization=quant))
    return tuple(quantized)


def per_sub_pool(
    value: int | Mapping[str, int], names: Sequence[str], what: str, minimum: int
) -> list[int]:
    """``value`` for each sub-pool of ``names``: one int for all, or a mapping naming each."""
    if isinstance(value, Mapping):
        given = set(value)
        if given != set(names):
            raise LayoutError(
                f"{what} mapping must name exactly the sub-pools {list(names)}; "
                f"missing {sorted(set(names) - given)}, unknown {sorted(given - set(names))}"
            )
        values = [value[n] for n in names]
    else:
        values = [value] * len(names)
    return [
        check_int(v, f"{what} of sub-pool {name!r}", minimum=minimum, error=LayoutError)
        for name, v in zip(names, values, strict=True)
    ]


def check_slot_capacity(name: str, num_pages: int, page_size: int) -> None:
    """Refuse a sub-pool whose layer buffers would hold more slots than int32 can address."""
    slots = num_pages * page_size
    if slots > MAX_SLOTS_PER_LAYER:
        raise LayoutError(
            f"sub-pool {name!r} would have {num_pages} pages x {page_size} tokens = {slots} "
            f"slots per layer buffer; slots are int32, so at most {MAX_SLOTS_PER_LAYER} "
            "(use fewer pages, a smaller page size or a smaller budget)"
        )


def sub_pool_specs(
    layout: CacheLayout,
    *,
    num_pages: int | Mapping[str, int],
    page_size: int | Mapping[str, int],
    kv_quantization: QuantizationArg = None,
) -> tuple[SubPoolSpec, ...]:
    """The paged spec of every sub-pool of ``layout`` (counts include the null page)."""
    groups = sub_pool_groups(layout, kv_quantization)
    names = [g.name for g in groups]
    sizes = per_sub_pool(page_size, names, "page_size", 1)
    counts = per_sub_pool(num_pages, names, "num_pages", 2)
    for name, size, count in zip(names, sizes, counts, strict=True):
        check_slot_capacity(name, count, size)
    return tuple(
        SubPoolSpec(
            name=group.name,
            kind=group.kind,
            window=group.window,
            geometry=group.geometry,
            layer_ids=group.layer_ids,
            page_size=size,
            num_pages=count,
            quantization=group.quantization,
        )
        for group, size, count in zip(groups, sizes, counts, strict=True)
    )


def pages_per_request(
    layout: CacheLayout,
    *,
    max_context: int,
    page_size: int | Mapping[str, int] = 16,
    prefill_chunk: int = 1,
) -> dict[str, int]:
    """Peak pages one request of ``max_context`` tokens holds in each sub-pool.

    :meth:`kv_protocol.KVLifetime.peak_pages` of each sub-pool's lifetime.
    """
    check_int(max_context, "max_context", minimum=1)
    check_int(prefill_chunk, "prefill_chunk", minimum=1)
    groups = sub_pool_groups(layout)
    sizes = per_sub_pool(page_size, [g.name for g in groups], "page_size", 1)
    return {
        group.name: KVLifetime(group.window).peak_pages(max_context, size, prefill_chunk)
        for group, size in zip(groups, sizes, strict=True)
    }


def required_bytes(
    layout: CacheLayout,
    *,
    max_context: int,
    concurrency: int,
    page_size: int | Mapping[str, int] = 16,
    prefill_chunk: int = 1,
    kv_quantization: QuantizationArg = None,
) -> int:
    """Bytes a pool needs so ``concurrency`` requests of ``max_context`` tokens all fit."""
    check_int(concurrency, "concurrency", minimum=1)
    groups = sub_pool_groups(layout, kv_quantization)
    sizes = per_sub_pool(page_size, [g.name for g in groups], "page_size", 1)
    pages = pages_per_request(
        layout, max_context=max_context, page_size=page_size, prefill_chunk=prefill_chunk
    )
    return sum(
        (concurrency * pages[g.name] + 1) * size * g.bytes_per_token
        for g, size in zip(groups, sizes, strict=True)
    )


def budget_page_counts(
    layout: CacheLayout,
    budget_bytes: int,
    *,
    max_context: int,
    concurrency: int,
    page_size: int | Mapping[str, int] = 16,
    prefill_chunk: int = 1,
    kv_quantization: QuantizationArg = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """``(num_pages, page_size)`` per sub-pool for buffers that fit in ``budget_bytes``.

    Each sub-pool gets budget in proportion to what ``concurrency`` requests of
    ``max_context`` tokens need in it at their peak, plus its null page, counted in the bytes
    its pages really store (quantized data, scales and biases for a quantized sub-pool). A
    budget too small for two pages (null page plus one) in some sub-pool raises
    ``PoolExhaustedError``.
    """
    check_int(budget_bytes, "budget_bytes", minimum=1)
    check_int(concurrency, "concurrency", minimum=1)
    groups = sub_pool_groups(layout, kv_quantization)
    if not groups:  # nothing to page: the budget buys nothing and is not needed
        return {}, {}
    names = [g.name for g in groups]
    sizes = per_sub_pool(page_size, names, "page_size", 1)
    pages = pages_per_request(
        layout, max_context=max_context, page_size=page_size, prefill_chunk=prefill_chunk
    )
    weights = [concurrency * pages[n] + 1 for n in names]
    page_bytes = [size * g.bytes_per_token for g, size in zip(groups, sizes, strict=True)]
    demand = sum(w * b for w, b in zip(weights, page_bytes, strict=True))
    counts: dict[str, int] = {}
    for name, size, weight in zip(names, sizes, weights, strict=True):
        # Integer arithmetic: at budget == demand every sub-pool gets exactly `weight` pages.
        count = budget_bytes * weight // demand
        if count < 2:
            raise PoolExhaustedError(sub_pool=name, pages_requested=2, pages_free=max(count - 1, 0))
        check_slot_capacity(name, count, size)
        counts[name] = count
    return counts, dict(zip(names, sizes, strict=True))
