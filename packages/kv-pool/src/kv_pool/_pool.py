"""The paged hybrid KV pool: one sub-pool per (lifetime, geometry) group of attention layers.

:class:`HybridKVPool` is the coordinator: it keeps each request's length, makes every
reservation one atomic decision over all sub-pools (:meth:`HybridKVPool.try_reserve_batch`),
and reports memory. The page tables and the lifetime rule of each sub-pool live in
:mod:`._page_tables`, the tensors and slot trust in :mod:`._storage`, the sizing arithmetic in
:mod:`._sizing` and prefix caching in :mod:`._prefix`.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVBuffer,
    KVQuantization,
    LayerKind,
    LayerKindError,
    LayerTransferCounter,
    LayoutError,
    PoolExhaustedError,
    PoolMemoryReport,
    RequestStateError,
    Reservation,
    SlotWriter,
    SubPoolReport,
    UnknownRequestError,
    as_int,
    check_int,
)

from ._page_tables import ForkPlan, ReservePlan, SubPoolPages
from ._prefix import PrefixCache
from ._sizing import (
    QuantizationArg,
    SubPoolSpec,
    budget_page_counts,
    per_sub_pool,
    sub_pool_specs,
)
from ._storage import KVStorage, int32_array

__all__ = ["HybridKVPool"]


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

    ``kv_quantization`` stores pages in ``mx.quantize``'s affine 8- or 4-bit form: one
    :class:`kv_protocol.KVQuantization` for every sub-pool, or a mapping from sub-pool name
    or layer kind (``"full"``, ``"sliding"``) to one (or ``None``: that sub-pool unquantized).
    ``set_kv`` quantizes the written tokens; ``get_kv`` returns them dequantized in the
    model's dtype; the buffers of a quantized layer are :class:`kv_protocol.QuantizedKV`.
    Sizing and the memory report count the bytes the pages really store.

    ``slab_pages`` makes the buffers grow with use: ``None`` (the default) gives every
    sub-pool buffers for all its pages from the start; an int (or a mapping per sub-pool
    name) starts each sub-pool's buffers at one slab of that many pages (the null page
    included) and grows them by whole slabs at the end whenever a reservation or fork is
    handed a page past them, so pages never move (``slab_bytes`` instead: slabs of about
    that many bytes in every sub-pool, at least one page). ``num_pages`` stays the cap and
    admission is decided on it exactly as for preallocated buffers. :meth:`shrink` cuts the
    buffers back to the slabs that the pages in use (and, unless asked, the cached prefix
    pages) still need. The allocator hands out the lowest free page ids first, so pages in
    use gather at the start of the buffers.

    ``slot_writer`` (a :class:`kv_protocol.SlotWriter`) writes ``set_kv``'s tokens into
    plain buffers where it serves the call (kv-metal-kernels' ``CpuSlotWriter``: one native
    graph node instead of MLX's indexed assignment, about ten operations); ``None`` or a
    call it does not serve: MLX's assignment.
    """

    def __init__(
        self,
        layout: CacheLayout,
        *,
        num_pages: int | Mapping[str, int],
        page_size: int | Mapping[str, int] = 16,
        prefix_caching: bool = False,
        prefix_salt: bytes = b"",
        kv_quantization: QuantizationArg = None,
        slab_pages: int | Mapping[str, int] | None = None,
        slab_bytes: int | None = None,
        slot_writer: SlotWriter | None = None,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise LayoutError(f"HybridKVPool needs a CacheLayout, got {layout!r}")
        # A layout of STATE layers only (a pure recurrent model) has no sub-pool: requests
        # are still tracked, and every reservation succeeds without pages.
        specs = sub_pool_specs(
            layout, num_pages=num_pages, page_size=page_size, kv_quantization=kv_quantization
        )
        self._layout = layout
        self._specs = specs
        self._pages = [
            SubPoolPages(
                spec.name,
                page_size=spec.page_size,
                num_pages=spec.num_pages,
                lifetime=spec.lifetime,
            )
            for spec in specs
        ]
        self._index_of_name = {spec.name: i for i, spec in enumerate(specs)}
        names = [spec.name for spec in specs]
        self._slabs: list[int] | None = None
        if slab_pages is not None and slab_bytes is not None:
            raise LayoutError("give slab_pages or slab_bytes, not both")
        if slab_pages is not None:
            self._slabs = per_sub_pool(slab_pages, names, "slab_pages", 1)
        elif slab_bytes is not None:
            slab_bytes = check_int(slab_bytes, "slab_bytes", minimum=1, error=LayoutError)
            self._slabs = [max(1, slab_bytes // spec.bytes_per_page) for spec in specs]
        committed = (
            None
            if self._slabs is None
            else [min(slab, spec.num_pages) for slab, spec in zip(self._slabs, specs, strict=True)]
        )
        self._storage = KVStorage(
            layout, specs, [p.allocator for p in self._pages], committed, slot_writer
        )
        # request id -> reserved length (the same in every sub-pool)
        self._lengths: dict[int, int] = {}
        if not isinstance(prefix_salt, bytes):
            raise RequestStateError(f"prefix_salt must be bytes, got {prefix_salt!r}")
        self._prefix = (
            PrefixCache(
                self._pages,
                self._lengths,
                salt=prefix_salt,
                boundary=page_size if isinstance(page_size, int) else 16,
            )
            if prefix_caching
            else None
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
        prefix_caching: bool = False,
        prefix_salt: bytes = b"",
        kv_quantization: QuantizationArg = None,
        slab_pages: int | Mapping[str, int] | None = None,
        slab_bytes: int | None = None,
        slot_writer: SlotWriter | None = None,
    ) -> HybridKVPool:
        """A pool whose buffers fit in ``budget_bytes``, split for a stated workload.

        Each sub-pool gets budget in proportion to what ``concurrency`` requests of
        ``max_context`` tokens need in it at their peak (:func:`kv_pool.pages_per_request`),
        plus its null page. With exactly :func:`kv_pool.required_bytes` the workload fits;
        with more, every sub-pool grows in the same proportion. A budget too small for two
        pages (null page plus one) in some sub-pool raises ``PoolExhaustedError``. Quantized
        sub-pools (``kv_quantization``, as for the constructor) are counted at their stored
        bytes, so the same budget holds about 1.9x (8-bit) or 3.5x (4-bit, groups of 64) the
        tokens. ``slab_pages`` makes the buffers grow with use up to the budget (see the
        class).
        """
        counts, sizes = budget_page_counts(
            layout,
            budget_bytes,
            max_context=max_context,
            concurrency=concurrency,
            page_size=page_size,
            prefill_chunk=prefill_chunk,
            kv_quantization=kv_quantization,
        )
        return cls(
            layout,
            num_pages=counts,
            page_size=sizes,
            prefix_caching=prefix_caching,
            prefix_salt=prefix_salt,
            kv_quantization=kv_quantization,
            slab_pages=slab_pages,
            slab_bytes=slab_bytes,
            slot_writer=slot_writer,
        )

    # ------------------------------------------------------------------ static facts

    @property
    def layout(self) -> CacheLayout:
        """The layout the pool was built for."""
        return self._layout

    @property
    def sub_pools(self) -> tuple[SubPoolSpec, ...]:
        """Every sub-pool's spec (name, layers, page size and count, ...), by first layer id."""
        return self._specs

    @property
    def slab_pages(self) -> dict[str, int] | None:
        """Pages a slab adds to each sub-pool's buffers, by name (``None``: preallocated)."""
        if self._slabs is None:
            return None
        return {spec.name: slab for spec, slab in zip(self._specs, self._slabs, strict=True)}

    @property
    def slot_writer(self) -> SlotWriter | None:
        """The writer ``set_kv`` hands plain buffers to first (``None``: MLX's assignment)."""
        return self._storage.slot_writer

    def _pool_index(self, sub_pool: str) -> int:
        index = self._index_of_name.get(sub_pool)
        if index is None:
            raise LayerKindError(
                f"unknown sub-pool {sub_pool!r}; this pool has {list(self._index_of_name)}"
            )
        return index

    def sub_pool_of(self, layer_id: int) -> str:
        """Name of the sub-pool that stores ``layer_id``."""
        return self._storage.spec_of(layer_id).name

    def page_size(self, layer_id: int) -> int:
        """Tokens per page in the sub-pool of ``layer_id``."""
        return self._storage.spec_of(layer_id).page_size

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (``prefix_caching=True``), or ``None``."""
        return self._prefix

    # ------------------------------------------------------------------ requests

    def _length(self, request_id: int) -> int:
        key = as_int(request_id)
        if key is None:
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        length = self._lengths.get(key)
        if length is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return length

    def has_request(self, request_id: int) -> bool:
        """True while ``request_id`` is registered."""
        return request_id in self._lengths

    def add_request(self, request_id: int) -> None:
        """Register a new request holding no tokens; ``RequestStateError`` if it exists."""
        request_id = check_int(request_id, "request id")
        if request_id in self._lengths:
            raise RequestStateError(f"request {request_id} is already registered")
        for pages in self._pages:
            pages.add(request_id)
        self._lengths[request_id] = 0
        if self._prefix is not None:
            self._prefix.request_added(request_id)

    def seq_len(self, request_id: int) -> int:
        """Token positions reserved so far for the request."""
        return self._length(request_id)

    # ------------------------------------------------------------------ reserving

    def _plan(self, request_id: int, n_tokens: int) -> list[ReservePlan]:
        length = self._lengths[request_id]
        return [pages.plan(request_id, length, n_tokens) for pages in self._pages]

    def _demands(self, demands: object, what: str) -> dict[int, int]:
        """``demands`` checked: a mapping of distinct registered ids to counts ``>= 0``."""
        if not isinstance(demands, Mapping):
            raise RequestStateError(
                f"{what} takes a mapping of request id -> tokens, got {demands!r}"
            )
        checked: dict[int, int] = {}
        for request_id, n_tokens in demands.items():
            self._length(request_id)
            key = int(request_id)
            if key in checked:
                raise RequestStateError(f"{what} got request {key} twice")
            checked[key] = check_int(n_tokens, "n_tokens", minimum=0)
        return checked

    def _shortage(
        self, plans: Sequence[list[ReservePlan]], extra_need: Sequence[int] | None = None
    ) -> tuple[str, int, int] | None:
        """``(sub-pool, pages asked, pages available)`` where ``plans`` do not fit, else ``None``.

        Over the whole batch, what a request releases is room for any other's new pages;
        ``extra_need`` adds pages per sub-pool that must stay free afterwards.
        """
        for i, pages in enumerate(self._pages):
            asked = sum(plan[i].n_new for plan in plans)
            available = pages.allocator.num_free + sum(plan[i].reclaim for plan in plans)
            if extra_need is not None:
                asked += extra_need[i]
            if asked > available:
                return pages.name, asked, available
        return None

    def _apply_all(
        self, ids: Sequence[int], plans: Sequence[list[ReservePlan]], counts: Sequence[int]
    ) -> None:
        """Apply checked plans: request by request when that never runs dry, else releases first."""
        free = [pages.allocator.num_free for pages in self._pages]
        in_order = True
        for plan in plans:
            for i, step in enumerate(plan):
                free[i] += step.reclaim - step.n_new
                in_order = in_order and free[i] >= 0
        if not in_order:
            # An earlier request needs a later one's released pages: release everything first.
            for rid, plan in zip(ids, plans, strict=True):
                for pages, step in zip(self._pages, plan, strict=True):
                    pages.release(rid, step)
        for rid, plan, n_tokens in zip(ids, plans, counts, strict=True):
            for pages, step in zip(self._pages, plan, strict=True):
                if in_order:
                    pages.release(rid, step)
                pages.grow(rid, step)
            self._lengths[rid] += n_tokens
        self._cover_high_water()

    def _cover_high_water(self) -> None:
        """Grow buffers by whole slabs to cover every page handed out (preallocated: no-op)."""
        if self._slabs is None:
            return
        storage = self._storage
        for i, pages in enumerate(self._pages):
            needed = pages.allocator.high_water + 1
            if needed > storage.committed(i):
                storage.resize(i, self._slab_cover(i, needed))

    def _slab_cover(self, index: int, pages: int) -> int:
        """``pages`` rounded up to whole slabs of sub-pool ``index``, capped at its page count."""
        assert self._slabs is not None
        slab = self._slabs[index]
        return min(-(-pages // slab) * slab, self._specs[index].num_pages)

    def shrink(self, *, drop_cached: bool = False) -> int:
        """Cut growing buffers back to the slabs still needed; return the bytes given back.

        A sub-pool keeps the slabs up to its highest page held by a request or cached for a
        prefix (``drop_cached=True`` forgets the cached blocks past the highest held page
        first, so only held pages count). Pages never move, so a request running now is not
        touched. Preallocated pools (``slab_pages=None``) give nothing back: 0. Slot arrays
        stay valid: a page past the new end is one nobody holds, whose arrays were no longer
        trusted anyway.
        """
        if self._slabs is None:
            return 0
        released = 0
        storage = self._storage
        for i, (spec, pages) in enumerate(zip(self._specs, self._pages, strict=True)):
            allocator = pages.allocator
            if drop_cached:
                allocator.drop_cached_from(allocator.highest_held() + 1)
            target = self._slab_cover(i, allocator.settle_high_water() + 1)
            target = max(target, min(self._slabs[i], spec.num_pages))
            old = storage.committed(i)
            if target < old:
                storage.resize(i, target)
                released += (old - target) * spec.bytes_per_page
        return released

    def _reservation(
        self, ids: list[int], olds: list[int], counts: list[int], page_tables: bool
    ) -> Reservation:
        """The issued slots of the new positions and (if asked) the page tables, per sub-pool."""
        slots: dict[str, mx.array] = {}
        tables: dict[str, mx.array] = {}
        total = sum(counts)
        for i, pages in enumerate(self._pages):
            if page_tables:
                tables[pages.name] = self._page_tables(pages, ids)
            if not total:
                slots[pages.name] = mx.zeros((0,), dtype=mx.int32)
                continue
            size = pages.page_size
            flat = array("i")
            held: list[int] = []
            for rid, old, n in zip(ids, olds, counts, strict=True):
                if n == 1:
                    slot, page = pages.slot(rid, old)
                    held.append(page)
                    flat.append(slot)
                elif n:
                    table = pages.table(rid)
                    held.extend(table.pages_between(old, old + n, size))
                    flat.extend(table.slots(old, old + n, size))
            slots[pages.name] = self._storage.issue(int32_array(flat), i, held)
        return Reservation(
            request_ids=tuple(ids),
            start_lengths=tuple(olds),
            n_tokens=tuple(counts),
            slots=slots,
            page_tables=tables,
        )

    def try_reserve_batch(
        self,
        demands: Mapping[int, int],
        *,
        headroom: Mapping[int, int] | None = None,
        page_tables: bool = True,
    ) -> Reservation | None:
        """Reserve ``demands[request_id]`` more positions for each request, or nothing.

        One atomic decision over every request and every sub-pool. Sliding sub-pools first
        release the pages no new query can see, and what one request of the batch releases is
        room for another's new pages. Returns the :class:`kv_protocol.Reservation` (rows in
        ``demands``' order, its slots issued for writes) or ``None``, with nothing changed,
        when the pages are not there. ``headroom`` (requests not in ``demands``) must also
        still fit as one batch afterwards; it is checked, not reserved. ``page_tables=False``
        leaves the reservation's page tables empty (a prefill chunk does not read them). A
        bad mapping, an unknown, repeated or non-int id or a bad count raises and changes
        nothing.
        """
        wanted = self._demands(demands, "try_reserve_batch")
        spare: dict[int, int] = {}
        if headroom is not None:
            spare = self._demands(headroom, "try_reserve_batch's headroom")
            both = set(spare) & set(wanted)
            if both:
                raise RequestStateError(
                    f"try_reserve_batch: requests {sorted(both)} are both reserved and headroom"
                )
        plans = [self._plan(rid, n) for rid, n in wanted.items()]
        if self._shortage(plans) is not None:
            return None
        if spare:
            extra = [0] * len(self._pages)
            for rid, n_tokens in spare.items():
                for i, step in enumerate(self._plan(rid, n_tokens)):
                    extra[i] += step.n_new - step.reclaim
            if self._shortage(plans, extra) is not None:
                return None
        return self._grant(wanted, plans, page_tables)

    def _grant(
        self, wanted: dict[int, int], plans: list[list[ReservePlan]], page_tables: bool
    ) -> Reservation:
        """Apply checked plans and hand out the reservation."""
        ids = list(wanted)
        counts = list(wanted.values())
        olds = [self._lengths[rid] for rid in ids]
        self._apply_all(ids, plans, counts)
        return self._reservation(ids, olds, counts, page_tables)

    def reserve(self, request_id: int, n_tokens: int) -> Reservation:
        """Reserve ``n_tokens`` more positions for one request, atomically over all sub-pools.

        :meth:`try_reserve_batch` for one request, without page tables, raising
        ``PoolExhaustedError`` (the sub-pool, pages asked, pages available counting the pages
        this call would release) on shortage instead of returning ``None``; nothing changes
        then.
        """
        self._length(request_id)  # a bad id is refused before it is used as a key
        wanted = self._demands({request_id: n_tokens}, "reserve")
        plans = [self._plan(rid, n) for rid, n in wanted.items()]
        short = self._shortage(plans)
        if short is not None:
            name, asked, available = short
            raise PoolExhaustedError(sub_pool=name, pages_requested=asked, pages_free=available)
        return self._grant(wanted, plans, page_tables=False)

    def rollback(self, reservation: Reservation) -> None:
        """Undo ``reservation``: each request still registered goes back to its start length.

        Pages it added are freed (sliding pages it released stay released: no query at the
        start length sees them). Requests freed since are skipped; a request trimmed below
        its start length since is left alone.
        """
        if not isinstance(reservation, Reservation):
            raise RequestStateError(f"rollback takes a Reservation, got {reservation!r}")
        for rid, start in zip(reservation.request_ids, reservation.start_lengths, strict=True):
            length = self._lengths.get(rid)
            if length is not None and length > start:
                self.trim_request(rid, length - start)

    def free_request(self, request_id: int) -> None:
        """Release every page of the request and forget it.

        Slot arrays issued for its pages stop being trusted: a later write through one raises
        instead of landing in a page that may belong to another request by then.
        """
        self._length(request_id)
        request_id = int(request_id)
        for pages in self._pages:
            pages.free(request_id)
        del self._lengths[request_id]
        if self._prefix is not None:
            self._prefix.request_freed(request_id)

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
        length = self._length(request_id)
        request_id = int(request_id)
        n_tokens = check_int(n_tokens, "n_tokens", minimum=0, maximum=length)
        keeps = [pages.trim_keep(request_id, length, n_tokens) for pages in self._pages]
        if self._prefix is not None:
            self._prefix.before_trim(request_id, length - n_tokens)
        for pages, keep in zip(self._pages, keeps, strict=True):
            pages.trim(request_id, keep)
        self._lengths[request_id] = length - n_tokens

    def fork_request(self, parent_id: int, child_id: int, n_tokens: int) -> None:
        """Register ``child_id`` holding the parent's first ``n_tokens`` positions.

        Whole pages are shared (one more owner each, no copy); a partial tail page is copied,
        for every layer of its sub-pool, into a fresh page that the child owns alone. In a
        sliding sub-pool the child takes only the pages its next query can see (positions
        ``>= n_tokens - window + 1``); if the parent released any of them the fork is refused.
        Atomic: on any error (unknown parent, existing child, bad ``n_tokens``, no free page
        for a tail copy) nothing changes.
        """
        parent_length = self._length(parent_id)
        parent_id = int(parent_id)
        child_id = check_int(child_id, "request id")
        if child_id in self._lengths:
            raise RequestStateError(f"cannot fork into request {child_id}: it is registered")
        check_int(n_tokens, "n_tokens", minimum=0)
        if n_tokens > parent_length:
            raise RequestStateError(
                f"cannot fork {n_tokens} tokens of request {parent_id}, which holds {parent_length}"
            )
        plans: list[ForkPlan] = [pages.fork_plan(parent_id, n_tokens) for pages in self._pages]
        for pages, plan in zip(self._pages, plans, strict=True):
            if plan.tail_page and pages.allocator.num_free < 1:
                raise PoolExhaustedError(sub_pool=pages.name, pages_requested=1, pages_free=0)
        copies: list[tuple[int, int, int, int]] = []
        for index, (pages, plan) in enumerate(zip(self._pages, plans, strict=True)):
            new_page = pages.fork(child_id, plan)
            if new_page:
                size = pages.page_size
                copies.append((index, plan.tail_page * size, new_page * size, n_tokens % size))
        self._cover_high_water()
        self._storage.copy_tokens(copies)
        self._lengths[child_id] = n_tokens
        if self._prefix is not None:
            self._prefix.forked(parent_id, child_id, n_tokens)

    # ------------------------------------------------------------------ page tables and slots

    @staticmethod
    def _page_tables(pages: SubPoolPages, request_ids: Sequence[int]) -> mx.array:
        tables = [pages.table(r) for r in request_ids]
        width = max(max((t.n_pages for t in tables), default=0), 1)
        if not tables:
            return mx.zeros((0, width), dtype=mx.int32)
        flat = array("i", bytes(4 * len(tables) * width))
        for row, table in enumerate(tables):
            start = row * width
            flat[start : start + table.n_pages] = table.pages
        return int32_array(memoryview(flat).cast("B").cast("i", (len(tables), width)))

    def _check_position(self, request_id: int, index: int, pos: int) -> None:
        length = self._lengths[request_id]
        if as_int(pos) is None or not 0 <= pos < length:
            raise RequestStateError(
                f"position {pos!r} is outside the request's reserved positions 0..{length - 1}"
            )
        spec = self._specs[index]
        first = self._pages[index].first_held_position(request_id)
        if pos < first:
            raise CacheStateError(
                f"position {pos} of sub-pool {spec.name!r} was released: it left the window "
                f"{spec.window}; held positions start at {first}"
            )

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        """int32 slots of token positions ``start .. stop - 1`` of the request for that layer.

        A position a sliding sub-pool released raises ``CacheStateError``; one outside
        ``0 .. seq_len - 1`` (or ``start > stop``) raises ``RequestStateError``.
        """
        index = self._storage.entry(layer_id)[0]
        length = self._length(request_id)
        request_id = int(request_id)
        start = check_int(start, "token_slots start")
        stop = check_int(stop, "token_slots stop")
        if not 0 <= start <= stop <= length:
            raise RequestStateError(
                f"token range {start}..{stop} is not within the request's reserved positions "
                f"0..{length} (need 0 <= start <= stop <= seq_len)"
            )
        if start == stop:
            return mx.zeros((0,), dtype=mx.int32)
        self._check_position(request_id, index, start)
        table = self._pages[index].table(request_id)
        size = self._specs[index].page_size
        slots = int32_array(table.slots(start, stop, size))
        return self._storage.issue(slots, index, table.pages_between(start, stop, size))

    # ------------------------------------------------------------------ buffers

    @property
    def layer_transfer_counter(self) -> LayerTransferCounter | None:
        """The layer transfer counter buffer accessors wait on (``None``: none).

        Set it to make every buffer accessor wait for its global layer id; set ``None`` to
        stop.
        """
        return self._storage.layer_transfer_counter

    @layer_transfer_counter.setter
    def layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        self._storage.register_layer_transfer_counter(counter)

    def get_key_buffer(self, layer_id: int, *, wait: bool = True) -> KVBuffer:
        """The layer's key buffer ``(n_kv_heads, num_slots, head_dim)``.

        A :class:`kv_protocol.QuantizedKV` of that logical shape when the layer's sub-pool is
        quantized. Waits for the layer's transfer when a counter is registered, unless
        ``wait=False`` (for the loader itself).
        """
        return self._storage.get_key_buffer(layer_id, wait=wait)

    def get_value_buffer(self, layer_id: int, *, wait: bool = True) -> KVBuffer:
        """The layer's value buffer (same shape and waiting rule as ``get_key_buffer``)."""
        return self._storage.get_value_buffer(layer_id, wait=wait)

    def kv_quantization(self, layer_id: int) -> KVQuantization | None:
        """How the layer's pages are quantized, or ``None`` (the layout's error for a bad id)."""
        return self._storage.spec_of(layer_id).quantization

    def get_full_kv_buffers(self, layer_id: int) -> tuple[KVBuffer, KVBuffer]:
        """Key and value buffers of a FULL layer; the layout's exact error for any other id."""
        self._layout.full_pool_index(layer_id)
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_sliding_kv_buffers(self, layer_id: int) -> tuple[KVBuffer, KVBuffer]:
        """Key and value buffers of a SLIDING layer; the layout's exact error for any other id."""
        self._layout.sliding_pool_index(layer_id)
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        """Rebind the layer's buffers to arrays a kernel produced (same shape and dtype).

        Plain buffers only: a quantized layer's pages are written by :meth:`set_kv`.
        """
        self._storage.replace_buffers(layer_id, keys, values)

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
        pool issued (a reservation's slots, ``token_slots``) are trusted by identity, and any
        other array is read on the host once before the write. Do not modify a slot array in
        place after handing it to the pool.
        """
        self._storage.set_kv(layer_id, slots, keys, values, wait=wait)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        ``slots`` are checked as for :meth:`set_kv`, repeats allowed.
        """
        return self._storage.get_kv(layer_id, slots)

    # ------------------------------------------------------------------ accounting

    def memory_report(self) -> PoolMemoryReport:
        """Pages and bytes per sub-pool, the saving against full storage, prefix cache stats."""
        subs = [
            SubPoolReport(
                name=spec.name,
                kind=spec.kind.value,
                window=spec.window,
                layer_ids=spec.layer_ids,
                page_size=spec.page_size,
                num_pages=spec.num_pages,
                pages_used=pages.allocator.num_used,
                pages_free=pages.allocator.num_free,
                bytes_per_page=spec.bytes_per_page,
                kv_bits=None if spec.quantization is None else spec.quantization.bits,
                pages_committed=None if self._slabs is None else self._storage.committed(i),
            )
            for i, (spec, pages) in enumerate(zip(self._specs, self._pages, strict=True))
        ]
        full_caps = [
            (spec.num_pages - 1) * spec.page_size
            for spec in self._specs
            if spec.kind is LayerKind.FULL
        ]
        return PoolMemoryReport(
            sub_pools=tuple(subs),
            num_requests=len(self._lengths),
            tokens=sum(self._lengths.values()),
            full_kv_bytes_per_token=self._layout.full_kv_bytes_per_token(),
            full_capacity_tokens=min(full_caps) if full_caps else None,
            prefix_cache=None if self._prefix is None else self._prefix.stats(),
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}: {s.num_pages} x {s.page_size}" for s in self._specs)
        return f"HybridKVPool({parts}; {len(self._lengths)} requests)"
