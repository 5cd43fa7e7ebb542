"""The paged hybrid KV pool: one sub-pool per (lifetime, geometry) group of attention layers."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVGeometry,
    KVLifetime,
    LayerKind,
    LayerKindError,
    LayerSpec,
    LayerTransferCounter,
    LayoutError,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    UnknownRequestError,
    as_int,
    check_int,
)

from ._allocator import PageAllocator
from ._report import PoolMemoryReport, SubPoolReport

__all__ = ["HybridKVPool", "SubPoolSpec"]


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _int32(buffer: array[int] | memoryview) -> mx.array:
    """An int32 ``mx.array`` copied from an ``array('i')`` (or a shaped view of one)."""
    # mlx reads objects with the buffer protocol; its stubs do not declare that.
    return mx.array(cast(Any, buffer))


#: How many slot arrays a pool remembers (FIFO): a decode step issues one per sub-pool, a
#: prefill chunk two per layer. A remembered array is trusted while its pages keep their
#: owners and refused after; an older one is checked on the host like any foreign array.
_KNOWN_SLOTS = 1024

#: Slots are int32: a layer buffer holds at most this many token slots.
MAX_SLOTS_PER_LAYER = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_count(value: object, what: str, minimum: int) -> int:
    return check_int(value, what, minimum=minimum)


def _request_ids(request_ids: object, what: str) -> list[int]:
    """``request_ids`` as a list, refusing a non-sequence (a bare id, a string, a mapping)."""
    if isinstance(request_ids, str | bytes | Mapping) or not isinstance(request_ids, Iterable):
        raise RequestStateError(f"{what} takes a sequence of request ids, got {request_ids!r}")
    return list(request_ids)


@dataclass(frozen=True, kw_only=True)
class SubPoolSpec:
    """One sub-pool: a lifetime kind, a window, one KV geometry, its layers and its paging."""

    name: str
    kind: LayerKind
    window: int | None
    geometry: KVGeometry
    layer_ids: tuple[int, ...]
    page_size: int
    num_pages: int

    @property
    def lifetime(self) -> KVLifetime:
        """Which cached positions the sub-pool's queries see (its window, or all)."""
        return KVLifetime(self.window)

    @property
    def bytes_per_page(self) -> int:
        """K+V bytes of one page over every layer of the sub-pool."""
        return self.page_size * self.geometry.bytes_per_token * len(self.layer_ids)

    @property
    def num_slots(self) -> int:
        """Token slots per layer buffer, the null page included."""
        return self.num_pages * self.page_size


@dataclass(frozen=True)
class _Group:
    name: str
    kind: LayerKind
    window: int | None
    geometry: KVGeometry
    layer_ids: tuple[int, ...]


def _groups(layout: CacheLayout) -> tuple[_Group, ...]:
    """Group FULL and SLIDING layers by (kind, window, geometry), ordered by first layer id."""
    keyed: dict[tuple[LayerKind, int | None, int, int, int, str], list[LayerSpec]] = {}
    for spec in layout.specs:
        if spec.kind is LayerKind.STATE:
            continue
        g = spec.geometry
        key = (spec.kind, spec.window, g.n_kv_heads, g.head_dim, g.value_dim, str(g.dtype))
        keyed.setdefault(key, []).append(spec)
    geometries = {k[2:] for k in keyed}
    dtypes = {k[5] for k in keyed}
    groups: list[_Group] = []
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
            _Group(
                name=name,
                kind=first.kind,
                window=first.window,
                geometry=geometry,
                layer_ids=tuple(s.layer_id for s in specs),
            )
        )
    return tuple(groups)


def _per_group(
    value: int | Mapping[str, int], names: Sequence[str], what: str, minimum: int
) -> list[int]:
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


def _check_slot_capacity(name: str, num_pages: int, page_size: int) -> None:
    """Refuse a sub-pool whose layer buffers would hold more slots than int32 can address."""
    slots = num_pages * page_size
    if slots > MAX_SLOTS_PER_LAYER:
        raise LayoutError(
            f"sub-pool {name!r} would have {num_pages} pages x {page_size} tokens = {slots} "
            f"slots per layer buffer; slots are int32, so at most {MAX_SLOTS_PER_LAYER} "
            "(use fewer pages, a smaller page size or a smaller budget)"
        )


class _SubPool:
    """Buffers, allocator and static facts of one sub-pool."""

    __slots__ = ("allocator", "keys", "lifetime", "name", "page_size", "spec", "values", "window")

    def __init__(self, spec: SubPoolSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.page_size = spec.page_size
        self.window = spec.window
        self.lifetime = spec.lifetime
        self.allocator = PageAllocator(spec.num_pages, name=spec.name)
        g = spec.geometry
        key_shape = (g.n_kv_heads, spec.num_slots, g.head_dim)
        value_shape = (g.n_kv_heads, spec.num_slots, g.value_dim)
        # mx.zeros is lazy: memory is committed when a buffer is first evaluated.
        self.keys = [mx.zeros(key_shape, dtype=g.dtype) for _ in spec.layer_ids]
        self.values = [mx.zeros(value_shape, dtype=g.dtype) for _ in spec.layer_ids]


class _Table:
    """One request's logical page table in one sub-pool.

    ``pages[j]`` is the physical page of logical page ``j``; entries below ``first_live`` were
    released (sliding sub-pools) and are 0. An ``array('i')`` grows in amortised O(1) and
    converts to an int32 ``mx.array`` without a Python loop.
    """

    __slots__ = ("first_live", "pages")

    def __init__(self) -> None:
        self.pages = array("i")
        self.first_live = 0

    @property
    def n_pages(self) -> int:
        return len(self.pages)

    def held(self) -> list[int]:
        return self.pages[self.first_live :].tolist()

    def slots(self, start: int, stop: int, page_size: int) -> array[int]:
        """Slots of positions ``start .. stop - 1``, built one page-run at a time."""
        out = array("i")
        pos = start
        while pos < stop:
            j, offset = divmod(pos, page_size)
            run = min(page_size - offset, stop - pos)
            base = self.pages[j] * page_size + offset
            out.extend(range(base, base + run))
            pos += run
        return out


class _Issued:
    """A slot array the pool vouches for, with the pages it addresses and their generations.

    The trust lasts while every page is still at the generation it had at issue (no owner let
    go of any of them in between); ``epoch`` (the allocator's drop count when last confirmed)
    lets the common case skip the per-page comparison.
    """

    __slots__ = ("array", "epoch", "generations", "index", "pages")

    def __init__(
        self, array: mx.array, index: int, pages: list[int], generations: list[int], epoch: int
    ) -> None:
        self.array = array
        self.index = index
        self.pages = pages
        self.generations = generations
        self.epoch = epoch


class _Request:
    __slots__ = ("seq_len", "tables")

    def __init__(self, n_sub_pools: int) -> None:
        self.seq_len = 0
        self.tables = [_Table() for _ in range(n_sub_pools)]


#: What one reserve does in one sub-pool: release logical pages ``[first_live, cut)`` (the
#: physical ``release`` list, of which ``reclaim`` return to the free list), then add ``n_new``.
_Plan = tuple[int, list[int], int, int]


class HybridKVPool:
    """A paged KV pool for hybrid models, satisfying ``kv_protocol.KVPool``.

    One sub-pool per (kind, window, geometry) group of the layout's FULL and SLIDING layers
    (STATE layers store nothing here). Sub-pools are named ``"full"`` and ``"sliding-w<W>"``,
    with a ``-<heads>x<head_dim>`` suffix (and a dtype suffix if dtypes differ) when the
    attention layers have several geometries; :meth:`sub_pool_groups` tells the names before
    construction. Each layer's K and V buffers are head-major and slot addressed,
    ``(n_kv_heads, num_pages * page_size, head_dim)``; slot ``page * page_size + i`` holds
    position ``i`` of a page, and page 0 is the null page that padding points to.

    A request reserves positions ``0 .. seq_len - 1`` in every sub-pool. When ``reserve``
    grows a request from ``L`` to ``L + n`` positions, a sliding sub-pool of window ``W`` first
    releases the pages whose positions are all ``< L - W + 1`` (no new query can see them), so
    between decode steps a request holds at most ``ceil(W / page_size) + 1`` pages per sliding
    sub-pool at any length.

    ``num_pages`` and ``page_size`` are an int for every sub-pool or a mapping from sub-pool
    name to int. Page counts include the null page.
    """

    def __init__(
        self,
        layout: CacheLayout,
        *,
        num_pages: int | Mapping[str, int],
        page_size: int | Mapping[str, int] = 16,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise LayoutError(f"HybridKVPool needs a CacheLayout, got {layout!r}")
        # A layout of STATE layers only (a pure recurrent model) has no sub-pool: requests
        # are still tracked, and every reservation succeeds without pages.
        groups = _groups(layout)
        names = [g.name for g in groups]
        sizes = _per_group(page_size, names, "page_size", 1)
        counts = _per_group(num_pages, names, "num_pages", 2)
        for name, size, count in zip(names, sizes, counts, strict=True):
            _check_slot_capacity(name, count, size)
        self._layout = layout
        self._pools: list[_SubPool] = []
        self._index_of_name: dict[str, int] = {}
        # attention index -> (sub-pool index, layer index inside the sub-pool)
        self._by_attention: list[tuple[int, int]] = [(-1, -1)] * len(layout.attention_layer_ids)
        for i, (group, size, count) in enumerate(zip(groups, sizes, counts, strict=True)):
            spec = SubPoolSpec(
                name=group.name,
                kind=group.kind,
                window=group.window,
                geometry=group.geometry,
                layer_ids=group.layer_ids,
                page_size=size,
                num_pages=count,
            )
            self._pools.append(_SubPool(spec))
            self._index_of_name[group.name] = i
            for local, layer_id in enumerate(group.layer_ids):
                self._by_attention[layout.attention_index(layer_id)] = (i, local)
        self._requests: dict[int, _Request] = {}
        self._counter: LayerTransferCounter | None = None
        # id -> issue record of the slot arrays known valid for writes in one sub-pool
        # (issued by this pool or checked once); holding the arrays keeps their ids from
        # being reused while they are listed.
        self._known_slots: dict[int, _Issued] = {}

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def sub_pool_groups(layout: CacheLayout) -> dict[str, tuple[int, ...]]:
        """The sub-pool names a pool for ``layout`` will have, each with its global layer ids."""
        return {g.name: g.layer_ids for g in _groups(layout)}

    @staticmethod
    def pages_per_request(
        layout: CacheLayout,
        *,
        max_context: int,
        page_size: int | Mapping[str, int] = 16,
        prefill_chunk: int = 1,
    ) -> dict[str, int]:
        """Peak pages one request of ``max_context`` tokens holds in each sub-pool.

        FULL: ``ceil(max_context / page_size)``. SLIDING: while a chunk of ``prefill_chunk``
        tokens is reserved, the request holds positions ``L - W + 1 .. L + chunk - 1``, at
        most ``ceil((W - 1 + chunk) / page_size) + 1`` pages (never more than the full count).
        """
        _check_count(max_context, "max_context", 1)
        _check_count(prefill_chunk, "prefill_chunk", 1)
        groups = _groups(layout)
        sizes = _per_group(page_size, [g.name for g in groups], "page_size", 1)
        out: dict[str, int] = {}
        for group, size in zip(groups, sizes, strict=True):
            lifetime = KVLifetime(group.window)
            out[group.name] = lifetime.peak_pages(max_context, size, prefill_chunk)
        return out

    @classmethod
    def required_bytes(
        cls,
        layout: CacheLayout,
        *,
        max_context: int,
        concurrency: int,
        page_size: int | Mapping[str, int] = 16,
        prefill_chunk: int = 1,
    ) -> int:
        """Bytes a pool needs so ``concurrency`` requests of ``max_context`` tokens all fit."""
        _check_count(concurrency, "concurrency", 1)
        groups = _groups(layout)
        sizes = _per_group(page_size, [g.name for g in groups], "page_size", 1)
        pages = cls.pages_per_request(
            layout, max_context=max_context, page_size=page_size, prefill_chunk=prefill_chunk
        )
        return sum(
            (concurrency * pages[g.name] + 1) * size * g.geometry.bytes_per_token * len(g.layer_ids)
            for g, size in zip(groups, sizes, strict=True)
        )

    @classmethod
    def from_budget(
        cls,
        layout: CacheLayout,
        budget_bytes: int,
        *,
        max_context: int,
        concurrency: int,
        page_size: int | Mapping[str, int] = 16,
        prefill_chunk: int = 1,
    ) -> HybridKVPool:
        """A pool whose buffers fit in ``budget_bytes``, split for a stated workload.

        Each sub-pool gets budget in proportion to what ``concurrency`` requests of
        ``max_context`` tokens need in it at their peak (see :meth:`pages_per_request`), plus
        its null page. With exactly :meth:`required_bytes` the workload fits; with more, every
        sub-pool grows in the same proportion. A budget too small for two pages (null page
        plus one) in some sub-pool raises ``PoolExhaustedError``.
        """
        _check_count(budget_bytes, "budget_bytes", 1)
        _check_count(concurrency, "concurrency", 1)
        groups = _groups(layout)
        if not groups:  # nothing to page: the budget buys nothing and is not needed
            return cls(layout, num_pages={}, page_size={})
        names = [g.name for g in groups]
        sizes = _per_group(page_size, names, "page_size", 1)
        pages = cls.pages_per_request(
            layout, max_context=max_context, page_size=page_size, prefill_chunk=prefill_chunk
        )
        weights = [concurrency * pages[n] + 1 for n in names]
        page_bytes = [
            size * g.geometry.bytes_per_token * len(g.layer_ids)
            for g, size in zip(groups, sizes, strict=True)
        ]
        demand = sum(w * b for w, b in zip(weights, page_bytes, strict=True))
        counts: dict[str, int] = {}
        for name, weight in zip(names, weights, strict=True):
            # Integer arithmetic: at budget == demand every sub-pool gets exactly `weight` pages.
            count = budget_bytes * weight // demand
            if count < 2:
                raise PoolExhaustedError(
                    sub_pool=name, pages_requested=2, pages_free=max(count - 1, 0)
                )
            _check_slot_capacity(name, count, sizes[names.index(name)])
            counts[name] = count
        return cls(layout, num_pages=counts, page_size=dict(zip(names, sizes, strict=True)))

    # ------------------------------------------------------------------ static facts

    @property
    def layout(self) -> CacheLayout:
        """The layout the pool was built for."""
        return self._layout

    @property
    def sub_pools(self) -> tuple[SubPoolSpec, ...]:
        """Every sub-pool's spec, in order of first layer id."""
        return tuple(p.spec for p in self._pools)

    @property
    def sub_pool_names(self) -> tuple[str, ...]:
        """Every sub-pool's name."""
        return tuple(p.spec.name for p in self._pools)

    def _pool_index(self, sub_pool: str) -> int:
        index = self._index_of_name.get(sub_pool)
        if index is None:
            raise LayerKindError(
                f"unknown sub-pool {sub_pool!r}; this pool has {list(self._index_of_name)}"
            )
        return index

    def sub_pool_spec(self, sub_pool: str) -> SubPoolSpec:
        """The spec of the named sub-pool."""
        return self._pools[self._pool_index(sub_pool)].spec

    def allocator(self, sub_pool: str) -> PageAllocator:
        """The page allocator of the named sub-pool (read it; mutate only through the pool)."""
        return self._pools[self._pool_index(sub_pool)].allocator

    def _entry(self, layer_id: int) -> tuple[_SubPool, int]:
        # attention_index raises the layout's exact error for a STATE or unknown id.
        pool, local = self._by_attention[self._layout.attention_index(layer_id)]
        return self._pools[pool], local

    def sub_pool_of(self, layer_id: int) -> str:
        """Name of the sub-pool that stores ``layer_id``."""
        return self._entry(layer_id)[0].spec.name

    def page_size(self, layer_id: int) -> int:
        """Tokens per page in the sub-pool of ``layer_id``."""
        return self._entry(layer_id)[0].spec.page_size

    # ------------------------------------------------------------------ requests

    def _request(self, request_id: int) -> _Request:
        key = as_int(request_id)
        if key is None:
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        req = self._requests.get(key)
        if req is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return req

    @property
    def request_ids(self) -> tuple[int, ...]:
        """Ids of the registered requests, in registration order."""
        return tuple(self._requests)

    def has_request(self, request_id: int) -> bool:
        """True while ``request_id`` is registered."""
        return request_id in self._requests

    def add_request(self, request_id: int) -> None:
        """Register a new request holding no tokens; ``RequestStateError`` if it exists."""
        request_id = check_int(request_id, "request id")
        if request_id in self._requests:
            raise RequestStateError(f"request {request_id} is already registered")
        self._requests[request_id] = _Request(len(self._pools))

    def seq_len(self, request_id: int) -> int:
        """Token positions reserved so far for the request."""
        return self._request(request_id).seq_len

    def _plan(self, req: _Request, n_tokens: int) -> list[_Plan]:
        old = req.seq_len
        new = old + n_tokens
        plans: list[_Plan] = []
        for pool, table in zip(self._pools, req.tables, strict=True):
            size = pool.page_size
            n_new = -(-new // size) - len(table.pages)
            first = table.first_live
            # Queries at positions >= old see no page before this one.
            cut = max(first, pool.lifetime.first_live_page(old, size))
            if cut == first:
                plans.append((cut, [], n_new, 0))
                continue
            release = table.pages[first:cut].tolist()
            refcount = pool.allocator.refcount
            reclaim = sum(1 for p in release if refcount(p) == 1)
            plans.append((cut, release, n_new, reclaim))
        return plans

    def _release(self, req: _Request, plans: list[_Plan]) -> None:
        for pool, table, (cut, release, _, _) in zip(self._pools, req.tables, plans, strict=True):
            if release:
                pool.allocator.free(release)
                table.pages[table.first_live : cut] = array("i", bytes(4 * len(release)))
                table.first_live = cut

    def _grow(self, req: _Request, plans: list[_Plan], n_tokens: int) -> None:
        for pool, table, (_, _, n_new, _) in zip(self._pools, req.tables, plans, strict=True):
            if n_new:
                table.pages.extend(pool.allocator.alloc(n_new))
        req.seq_len += n_tokens

    def _fits_in_order(self, plans: list[list[_Plan]]) -> bool:
        """True if applying ``plans`` one request after another never runs out of pages."""
        free = [pool.allocator.num_free for pool in self._pools]
        for plan in plans:
            for i, (_, _, n_new, reclaim) in enumerate(plan):
                free[i] += reclaim - n_new
                if free[i] < 0:
                    return False
        return True

    def _check_room(self, needs: list[int], room: list[int]) -> None:
        for pool, need, extra in zip(self._pools, needs, room, strict=True):
            available = pool.allocator.num_free + extra
            if need > available:
                raise PoolExhaustedError(
                    sub_pool=pool.spec.name, pages_requested=need, pages_free=available
                )

    def reserve(self, request_id: int, n_tokens: int) -> dict[str, mx.array]:
        """Reserve ``n_tokens`` more positions, atomically over all sub-pools.

        Returns the new tokens' int32 slots ``(n_tokens,)`` per sub-pool name. Sliding
        sub-pools first release pages that no query of the new tokens can see. On shortage
        raises ``PoolExhaustedError`` (sub-pool, pages asked, pages available counting the
        pages this call would release) and nothing changes.
        """
        req = self._request(request_id)
        _check_count(n_tokens, "n_tokens", 0)
        plans = self._plan(req, n_tokens)
        self._check_room([p[2] for p in plans], [p[3] for p in plans])
        old = req.seq_len
        self._release(req, plans)
        self._grow(req, plans, n_tokens)
        out: dict[str, mx.array] = {}
        for i, (pool, table) in enumerate(zip(self._pools, req.tables, strict=True)):
            size = pool.page_size
            if n_tokens == 1:
                page = table.pages[old // size]
                slot = page * size + old % size
                out[pool.name] = self._issue(mx.array([slot], dtype=mx.int32), i, [page])
            elif n_tokens == 0:
                out[pool.name] = mx.zeros((0,), dtype=mx.int32)
            else:
                pages = table.pages[old // size : (old + n_tokens - 1) // size + 1].tolist()
                slots = _int32(table.slots(old, old + n_tokens, size))
                out[pool.name] = self._issue(slots, i, pages)
        return out

    def reserve_batch(self, request_ids: Sequence[int], n_tokens: int = 1) -> dict[str, mx.array]:
        """Reserve ``n_tokens`` more positions for each request, atomically over the batch.

        The decode-step form of :meth:`reserve`: returns ``(B, n_tokens)`` int32 slots per
        sub-pool, built with one array conversion per sub-pool. Either every request gets its
        pages or ``PoolExhaustedError`` is raised (pages asked and available summed over the
        batch) and nothing changes. Repeated ids are a ``RequestStateError``.
        """
        _check_count(n_tokens, "n_tokens", 0)
        request_ids = _request_ids(request_ids, "reserve_batch")
        reqs = [self._request(r) for r in request_ids]
        if len(set(request_ids)) != len(reqs):
            raise RequestStateError(f"reserve_batch got repeated request ids: {list(request_ids)}")
        plans = [self._plan(req, n_tokens) for req in reqs]
        width = len(self._pools)
        self._check_room(
            [sum(p[i][2] for p in plans) for i in range(width)],
            [sum(p[i][3] for p in plans) for i in range(width)],
        )
        olds = [req.seq_len for req in reqs]
        if self._fits_in_order(plans):
            # Request by request: the same pages as one reserve per request in batch order.
            for req, plan in zip(reqs, plans, strict=True):
                self._release(req, plan)
                self._grow(req, plan, n_tokens)
        else:
            # The room check counted what the whole batch releases, and an earlier request
            # needs a later one's pages: every release goes before any allocation.
            for req, plan in zip(reqs, plans, strict=True):
                self._release(req, plan)
            for req, plan in zip(reqs, plans, strict=True):
                self._grow(req, plan, n_tokens)
        out: dict[str, mx.array] = {}
        batch = len(reqs)
        for i, pool in enumerate(self._pools):
            if batch == 0 or n_tokens == 0:
                out[pool.name] = mx.zeros((batch, n_tokens), dtype=mx.int32)
                continue
            size = pool.page_size
            flat = array("i")
            pages: list[int] = []
            for req, old in zip(reqs, olds, strict=True):
                table = req.tables[i]
                if n_tokens == 1:
                    page = table.pages[old // size]
                    pages.append(page)
                    flat.append(page * size + old % size)
                else:
                    pages.extend(table.pages[old // size : (old + n_tokens - 1) // size + 1])
                    flat.extend(table.slots(old, old + n_tokens, size))
            shaped = memoryview(flat).cast("B").cast("i", (batch, n_tokens))
            out[pool.name] = self._issue(_int32(shaped), i, pages)
        return out

    def can_reserve(self, demands: dict[int, int]) -> bool:
        """True if reserving ``demands[request_id]`` more tokens for each request would fit.

        True means one :meth:`reserve` per request succeeds in *any* order (and so does one
        :meth:`reserve_batch` of them): pages a request would release make room for its own
        new pages only, never for another request's, since that request may reserve first.
        Released pages count only when no other request shares them.
        """
        if not isinstance(demands, Mapping):
            raise RequestStateError(
                f"can_reserve takes a mapping of request id -> tokens, got {demands!r}"
            )
        need = [0] * len(self._pools)
        for request_id, n_tokens in demands.items():
            req = self._request(request_id)
            _check_count(n_tokens, "n_tokens", 0)
            for i, (_, _, n_new, reclaim) in enumerate(self._plan(req, n_tokens)):
                need[i] += max(0, n_new - reclaim)
        return all(n <= p.allocator.num_free for n, p in zip(need, self._pools, strict=True))

    def free_request(self, request_id: int) -> None:
        """Release every page of the request and forget it.

        Slot arrays issued for its pages stop being trusted: a later write through one raises
        instead of landing in a page that may belong to another request by then.
        """
        req = self._request(request_id)
        for pool, table in zip(self._pools, req.tables, strict=True):
            held = table.held()
            if held:
                pool.allocator.free(held)
        del self._requests[int(request_id)]

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        """Give back the last ``n_tokens`` reserved positions of the request (a rollback).

        Pages that then hold no reserved position return to the free list. A sliding
        sub-pool must still hold what a query at the new length sees (positions ``>= new_len
        - window + 1``); trimming back to the length a reservation started from always
        satisfies that, since a reservation releases only pages no query at that length can
        see. A trim that would leave the request writing into a page it shares with a forked
        request is refused too. Otherwise ``CacheStateError``, and nothing changes. The K/V
        of the kept positions are untouched; the trimmed positions' next write overwrites
        whatever a failed step left there.
        """
        req = self._request(request_id)
        n_tokens = check_int(n_tokens, "n_tokens", minimum=0, maximum=req.seq_len)
        new_len = req.seq_len - n_tokens
        cuts: list[int] = []
        for pool, table in zip(self._pools, req.tables, strict=True):
            size = pool.page_size
            if table.first_live:
                needed = pool.lifetime.first_visible(new_len)
                if table.first_live * size > needed:
                    raise CacheStateError(
                        f"cannot trim request {request_id} to {new_len} tokens: sub-pool "
                        f"{pool.name!r} released positions below {table.first_live * size} "
                        f"that a query at position {new_len} still sees (from {needed})"
                    )
            keep = max(_cdiv(new_len, size), table.first_live)
            if n_tokens and new_len % size and keep > table.first_live:
                tail = table.pages[keep - 1]
                if pool.allocator.refcount(tail) > 1:
                    raise CacheStateError(
                        f"cannot trim request {request_id} to {new_len} tokens: its page {tail} "
                        f"of sub-pool {pool.name!r} is shared with another request (a fork), "
                        "and the next write would land in it"
                    )
            cuts.append(keep)
        for pool, table, keep in zip(self._pools, req.tables, cuts, strict=True):
            extra = table.pages[keep:].tolist()
            if extra:
                pool.allocator.free(extra)
                del table.pages[keep:]
        req.seq_len = new_len

    def fork_request(self, parent_id: int, child_id: int, n_tokens: int) -> None:
        """Register ``child_id`` holding the parent's first ``n_tokens`` positions.

        Whole pages are shared (one more owner each, no copy); a partial tail page is copied,
        for every layer of its sub-pool, into a fresh page that the child owns alone. In a
        sliding sub-pool the child takes only the pages its next query can see (positions
        ``>= n_tokens - window + 1``); if the parent released any of them the fork is refused.
        Atomic: on any error (unknown parent, existing child, bad ``n_tokens``, no free page
        for a tail copy) nothing changes.
        """
        parent = self._request(parent_id)
        child_id = check_int(child_id, "request id")
        if child_id in self._requests:
            raise RequestStateError(f"cannot fork into request {child_id}: it is registered")
        _check_count(n_tokens, "n_tokens", 0)
        if n_tokens > parent.seq_len:
            raise RequestStateError(
                f"cannot fork {n_tokens} tokens of request {parent_id}, which holds "
                f"{parent.seq_len}"
            )
        plans: list[tuple[int, list[int], int]] = []
        for pool, table in zip(self._pools, parent.tables, strict=True):
            spec = pool.spec
            whole, tail = divmod(n_tokens, spec.page_size)
            first = spec.lifetime.first_live_page(n_tokens, spec.page_size)
            if n_tokens and first < table.first_live:
                raise RequestStateError(
                    f"cannot fork {n_tokens} tokens of request {parent_id}: sub-pool "
                    f"{spec.name!r} released positions below {table.first_live * spec.page_size}"
                    f" that the child still needs (from {first * spec.page_size})"
                )
            tail_page = table.pages[whole] if tail else 0
            plans.append((first, table.pages[first:whole].tolist(), tail_page))
        for pool, (_, _, tail_page) in zip(self._pools, plans, strict=True):
            if tail_page and pool.allocator.num_free < 1:
                raise PoolExhaustedError(sub_pool=pool.spec.name, pages_requested=1, pages_free=0)
        child = _Request(len(self._pools))
        copies: list[tuple[_SubPool, int, int, list[mx.array], list[mx.array]]] = []
        for pool, table, (first, shared, tail_page) in zip(
            self._pools, child.tables, plans, strict=True
        ):
            size = pool.spec.page_size
            whole, tail = divmod(n_tokens, size)
            if shared:
                pool.allocator.incref(shared)
            table.pages = array("i", bytes(4 * first))
            table.pages.extend(shared)
            table.first_live = first
            if tail_page:
                new_page = pool.allocator.alloc(1)[0]
                table.pages.append(new_page)
                src = tail_page * size
                # Materialise the sources first: a write whose source is a lazy read of the
                # same buffer cannot be done in place and would copy the whole buffer.
                ks = [mx.contiguous(k[:, src : src + tail]) for k in pool.keys]
                vs = [mx.contiguous(v[:, src : src + tail]) for v in pool.values]
                copies.append((pool, new_page * size, tail, ks, vs))
        if copies:
            mx.eval(*[a for c in copies for a in (*c[3], *c[4])])
            for pool, dst, tail, ks, vs in copies:
                for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
                    pool.keys[i][:, dst : dst + tail] = k
                    pool.values[i][:, dst : dst + tail] = v
        child.seq_len = n_tokens
        self._requests[child_id] = child

    # ------------------------------------------------------------------ page tables and slots

    def held_pages(self, request_id: int, sub_pool: str) -> list[int]:
        """Physical pages the request holds in the sub-pool, in logical order."""
        return self._request(request_id).tables[self._pool_index(sub_pool)].held()

    def page_table(self, request_id: int, sub_pool: str) -> mx.array:
        """``(n_pages,)`` int32 logical page table of one request; released entries are 0."""
        table = self._request(request_id).tables[self._pool_index(sub_pool)]
        if not table.pages:
            return mx.zeros((0,), dtype=mx.int32)
        return _int32(table.pages)

    def batch_page_table(self, request_ids: Sequence[int], sub_pool: str) -> mx.array:
        """``(B, max_pages)`` int32 logical page tables, padded and unheld entries = page 0.

        Entry ``[b, j]`` is the physical page holding positions ``j * page_size ..
        (j + 1) * page_size - 1`` of request ``b``. ``max_pages`` is at least 1.
        """
        index = self._pool_index(sub_pool)
        tables = [self._request(r).tables[index] for r in request_ids]
        width = max(max((t.n_pages for t in tables), default=0), 1)
        if not tables:
            return mx.zeros((0, width), dtype=mx.int32)
        flat = array("i", bytes(4 * len(tables) * width))
        for row, table in enumerate(tables):
            start = row * width
            flat[start : start + table.n_pages] = table.pages
        return _int32(memoryview(flat).cast("B").cast("i", (len(tables), width)))

    def _check_position(self, req: _Request, table: _Table, spec: SubPoolSpec, pos: int) -> None:
        if as_int(pos) is None or not 0 <= pos < req.seq_len:
            raise RequestStateError(
                f"position {pos!r} is outside the request's reserved positions 0..{req.seq_len - 1}"
            )
        if pos < table.first_live * spec.page_size:
            raise CacheStateError(
                f"position {pos} of sub-pool {spec.name!r} was released: it left the window "
                f"{spec.window}; held positions start at {table.first_live * spec.page_size}"
            )

    def batch_slots(
        self, request_ids: Sequence[int], sub_pool: str, positions: Sequence[int]
    ) -> mx.array:
        """``(B,)`` int32 slots of ``positions[b]`` of each request ``b`` in the sub-pool."""
        index = self._pool_index(sub_pool)
        request_ids = _request_ids(request_ids, "batch_slots")
        positions = _request_ids(positions, "batch_slots positions")
        if len(request_ids) != len(positions):
            raise ShapeMismatchError(
                f"batch_slots got {len(request_ids)} request ids but {len(positions)} positions"
            )
        spec = self._pools[index].spec
        size = spec.page_size
        slots: list[int] = []
        pages: list[int] = []
        for request_id, pos in zip(request_ids, positions, strict=True):
            req = self._request(request_id)
            table = req.tables[index]
            self._check_position(req, table, spec, pos)
            page = table.pages[pos // size]
            pages.append(page)
            slots.append(page * size + pos % size)
        out = mx.array(slots, dtype=mx.int32)
        # Two requests sharing a page can name one slot: such an array is for reads only.
        return self._issue(out, index, pages) if len(set(slots)) == len(slots) else out

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        """int32 slots of token positions ``start .. stop - 1`` of the request for that layer.

        A position a sliding sub-pool released raises ``CacheStateError``; one outside
        ``0 .. seq_len - 1`` (or ``start > stop``) raises ``RequestStateError``.
        """
        pool, _ = self._entry(layer_id)
        req = self._request(request_id)
        index = self._index_of_name[pool.spec.name]
        table = req.tables[index]
        start = check_int(start, "token_slots start")
        stop = check_int(stop, "token_slots stop")
        if not 0 <= start <= stop <= req.seq_len:
            raise RequestStateError(
                f"token range {start}..{stop} is not within the request's reserved positions "
                f"0..{req.seq_len} (need 0 <= start <= stop <= seq_len)"
            )
        if start == stop:
            return mx.zeros((0,), dtype=mx.int32)
        self._check_position(req, table, pool.spec, start)
        size = pool.spec.page_size
        pages = table.pages[start // size : (stop - 1) // size + 1].tolist()
        return self._issue(_int32(table.slots(start, stop, size)), index, pages)

    # ------------------------------------------------------------------ buffers

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        """Make buffer accessors wait on ``counter`` for their global layer id (``None``: stop)."""
        self._counter = counter

    @property
    def layer_transfer_counter(self) -> LayerTransferCounter | None:
        """The registered layer transfer counter, if any."""
        return self._counter

    def _wait(self, layer_id: int) -> None:
        if self._counter is not None:
            self._counter.wait_until(layer_id)

    def get_key_buffer(self, layer_id: int, *, wait: bool = True) -> mx.array:
        """The layer's key buffer ``(n_kv_heads, num_slots, head_dim)``.

        Waits for the layer's transfer when a counter is registered, unless ``wait=False``
        (for the loader itself).
        """
        pool, local = self._entry(layer_id)
        if wait:
            self._wait(layer_id)
        return pool.keys[local]

    def get_value_buffer(self, layer_id: int, *, wait: bool = True) -> mx.array:
        """The layer's value buffer (same shape and waiting rule as ``get_key_buffer``)."""
        pool, local = self._entry(layer_id)
        if wait:
            self._wait(layer_id)
        return pool.values[local]

    def get_full_kv_buffers(self, layer_id: int) -> tuple[mx.array, mx.array]:
        """Key and value buffers of a FULL layer; the layout's exact error for any other id."""
        self._layout.full_pool_index(layer_id)
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_sliding_kv_buffers(self, layer_id: int) -> tuple[mx.array, mx.array]:
        """Key and value buffers of a SLIDING layer; the layout's exact error for any other id."""
        self._layout.sliding_pool_index(layer_id)
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        """Rebind the layer's buffers to arrays a kernel produced (same shape and dtype)."""
        pool, local = self._entry(layer_id)
        for name, new, old in (
            ("keys", keys, pool.keys[local]),
            ("values", values, pool.values[local]),
        ):
            if not isinstance(new, mx.array) or new.shape != old.shape or new.dtype != old.dtype:
                got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, mx.array) else repr(new)
                raise ShapeMismatchError(
                    f"replace_buffers({layer_id}): {name} must be {tuple(old.shape)} "
                    f"{old.dtype}, got {got}"
                )
        pool.keys[local] = keys
        pool.values[local] = values

    def _issue(self, slots: mx.array, index: int, pages: list[int]) -> mx.array:
        """Remember ``slots`` (distinct, in range of sub-pool ``index``) as valid; return it.

        ``pages`` are the physical pages the slots lie in: the trust ends as soon as an owner
        lets go of one of them (the request is freed or trimmed, or the page leaves its
        window).
        """
        allocator = self._pools[index].allocator
        known = self._known_slots
        known[id(slots)] = _Issued(
            slots, index, pages, allocator.generations(pages), allocator.drops_total
        )
        if len(known) > _KNOWN_SLOTS:
            del known[next(iter(known))]
        return slots

    def _still_owned(self, record: _Issued) -> bool:
        """True while no owner has let go of a page of an issued slot array."""
        allocator = self._pools[record.index].allocator
        released = allocator.drops_total
        if released == record.epoch:
            return True
        if allocator.generations(record.pages) != record.generations:
            return False
        record.epoch = released
        return True

    def _check_slots(self, layer_id: int, slots: mx.array) -> int:
        """Check the rank and dtype of ``slots``; return ``T``."""
        if not isinstance(slots, mx.array) or slots.ndim != 1:
            got = f"shape {tuple(slots.shape)}" if isinstance(slots, mx.array) else repr(slots)
            raise ShapeMismatchError(f"layer {layer_id}: slots must be a 1-D mx.array, got {got}")
        if slots.dtype != mx.int32:
            raise ShapeMismatchError(
                f"layer {layer_id}: slots must have the integer dtype int32, got {slots.dtype}"
            )
        return int(slots.shape[0])

    def _trust_slots(self, layer_id: int, slots: mx.array, *, write: bool) -> None:
        """Check the values of ``slots`` for a read (``write=False``) or write of the layer.

        Arrays this pool issued (or already checked for a write) are trusted by identity, so
        the decode path needs no device read; any other array is read on the host once.
        """
        index = self._by_attention[self._layout.attention_index(layer_id)][0]
        known = self._known_slots.get(id(slots))
        if known is None or known.array is not slots or known.index != index:
            values = self._check_slot_values(layer_id, slots, write=write)
            if write:
                size = self._pools[index].spec.page_size
                self._issue(slots, index, sorted({v // size for v in values}))
            return
        if not self._still_owned(known):
            raise CacheStateError(
                f"layer {layer_id}: this slot array was issued for pages of sub-pool "
                f"{self._pools[index].name!r} that have been freed since (the request finished, "
                "was trimmed, or the pages left its window) and may belong to another request "
                "now; ask the pool for the request's current slots"
            )

    def _check_slot_values(self, layer_id: int, slots: mx.array, *, write: bool) -> list[int]:
        """Read ``slots`` on the host: in range, outside the null page, distinct for a write."""
        spec = self._entry(layer_id)[0].spec
        values = cast(list[int], slots.tolist())
        if not values:
            return values
        low, high = min(values), max(values)
        if low < spec.page_size or high >= spec.num_slots:
            bad = low if low < spec.page_size else high
            where = "in the null page 0" if 0 <= bad < spec.page_size else "out of range"
            raise RequestStateError(
                f"layer {layer_id}: slot {bad} is {where}; slots of sub-pool {spec.name!r} "
                f"must be in {spec.page_size}..{spec.num_slots - 1} (page 0 is the null page)"
            )
        if write and len(set(values)) != len(values):
            seen: set[int] = set()
            dup = values[0]
            for dup in values:
                if dup in seen:
                    break
                seen.add(dup)
            raise RequestStateError(
                f"layer {layer_id}: slot {dup} appears more than once in one write; the slots "
                "of one set_kv must be distinct (the order of a repeated write is undefined)"
            )
        return values

    def set_kv(
        self,
        layer_id: int,
        slots: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        wait: bool = True,
    ) -> None:
        """Write token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        With a registered transfer counter the write first waits for the layer's transfer,
        so the model's writes never race the loader's; the loader itself writes with
        ``wait=False`` (then marks the layer done).

        One scatter per buffer. MLX does the write in place when nothing else references the
        buffer; a live view of it or a pending lazy read of it makes MLX copy the whole
        buffer. ``slots`` must be int32, distinct, and outside the null page; slot arrays the
        pool issued (``reserve``, ``reserve_batch``, ``token_slots``, ``batch_slots``) are
        trusted by identity, and any other array is read on the host once before the write.
        Do not modify a slot array in place after handing it to the pool.
        """
        pool, local = self._entry(layer_id)
        t = self._check_slots(layer_id, slots)
        g = pool.spec.geometry
        for name, arr, dim in (("keys", keys, "head_dim"), ("values", values, "v_head_dim")):
            want = (t, g.n_kv_heads, g.head_dim if name == "keys" else g.value_dim)
            if not isinstance(arr, mx.array) or tuple(arr.shape) != want or arr.dtype != g.dtype:
                got = f"{tuple(arr.shape)} {arr.dtype}" if isinstance(arr, mx.array) else repr(arr)
                raise ShapeMismatchError(
                    f"set_kv(layer {layer_id}): {name} must be (T, n_kv_heads, {dim}) = "
                    f"{want} {g.dtype}, got {got}"
                )
        self._trust_slots(layer_id, slots, write=True)
        if wait:
            self._wait(layer_id)
        pool.keys[local][:, slots] = keys.transpose(1, 0, 2)
        pool.values[local][:, slots] = values.transpose(1, 0, 2)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        ``slots`` are checked as for :meth:`set_kv`, repeats allowed.
        """
        pool, local = self._entry(layer_id)
        self._check_slots(layer_id, slots)
        self._trust_slots(layer_id, slots, write=False)
        self._wait(layer_id)
        k = pool.keys[local][:, slots]
        v = pool.values[local][:, slots]
        return k.transpose(1, 0, 2), v.transpose(1, 0, 2)

    # ------------------------------------------------------------------ accounting

    def num_free_pages(self, sub_pool: str) -> int:
        """Pages of the sub-pool that can be allocated now."""
        return self._pools[self._pool_index(sub_pool)].allocator.num_free

    def memory_report(self) -> PoolMemoryReport:
        """Bytes and pages used and free per sub-pool, and the saving against full storage."""
        subs = []
        for pool in self._pools:
            spec = pool.spec
            subs.append(
                SubPoolReport(
                    name=spec.name,
                    kind=spec.kind.value,
                    window=spec.window,
                    layer_ids=spec.layer_ids,
                    page_size=spec.page_size,
                    num_pages=spec.num_pages,
                    pages_used=pool.allocator.num_used,
                    pages_free=pool.allocator.num_free,
                    bytes_per_page=spec.bytes_per_page,
                )
            )
        full_caps = [
            (p.spec.num_pages - 1) * p.spec.page_size
            for p in self._pools
            if p.spec.kind is LayerKind.FULL
        ]
        return PoolMemoryReport(
            sub_pools=tuple(subs),
            num_requests=len(self._requests),
            tokens=sum(r.seq_len for r in self._requests.values()),
            full_kv_bytes_per_token=self._layout.full_kv_bytes_per_token(),
            full_capacity_tokens=min(full_caps) if full_caps else None,
        )

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{p.spec.name}: {p.spec.num_pages} x {p.spec.page_size}" for p in self._pools
        )
        return f"HybridKVPool({parts}; {len(self._requests)} requests)"
