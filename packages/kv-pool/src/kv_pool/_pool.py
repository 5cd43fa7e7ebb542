"""The paged hybrid KV pool: one sub-pool per (lifetime, geometry) group of attention layers.

:class:`HybridKVPool` is the coordinator: it keeps each request's length, makes every
reservation one atomic decision over all sub-pools, and reports memory. The page tables
and the lifetime rule of each sub-pool live in :mod:`._page_tables`, the tensors and slot
trust in :mod:`._storage`, and the sizing arithmetic in :mod:`._sizing`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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
    RequestStateError,
    ShapeMismatchError,
    UnknownRequestError,
    as_int,
    check_int,
)

from ._allocator import PageAllocator
from ._page_tables import ForkPlan, ReservePlan, SubPoolPages, block_hashes
from ._report import PoolMemoryReport, SubPoolReport
from ._sizing import (
    QuantizationArg,
    SubPoolSpec,
    budget_page_counts,
    pages_per_request,
    required_bytes,
    sub_pool_groups,
    sub_pool_specs,
)
from ._storage import KVStorage, int32_array

__all__ = ["HybridKVPool", "PrefixCacheStats"]


@dataclass(frozen=True, kw_only=True)
class PrefixCacheStats:
    """What prefix caching did so far: lookups, tokens asked and reused, pages kept, evictions.

    ``cached_pages`` counts pages no request holds that keep a block for reuse (they are also
    free: an allocation evicts them, least recently released first); ``hashed_pages`` counts
    every page registered under a block, held or not.
    """

    queries: int
    query_tokens: int
    hit_tokens: int
    cached_pages: int
    hashed_pages: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Reused tokens per looked-up token."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _request_ids(request_ids: object, what: str) -> list[int]:
    """``request_ids`` as a list, refusing a non-sequence (a bare id, a string, a mapping)."""
    if isinstance(request_ids, str | bytes | Mapping) or not isinstance(request_ids, Iterable):
        raise RequestStateError(f"{what} takes a sequence of request ids, got {request_ids!r}")
    return list(request_ids)


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
        self._storage = KVStorage(layout, specs, [p.allocator for p in self._pages])
        # request id -> reserved length (the same in every sub-pool)
        self._lengths: dict[int, int] = {}
        if not isinstance(prefix_salt, bytes):
            raise RequestStateError(f"prefix_salt must be bytes, got {prefix_salt!r}")
        self._prefix_caching = bool(prefix_caching)
        self._salt = prefix_salt
        # request id -> the tokens whose K/V it has written (prefix caching only)
        self._tokens: dict[int, list[int]] = {}
        self._queries = self._query_tokens = self._hit_tokens = 0

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def sub_pool_groups(layout: CacheLayout) -> dict[str, tuple[int, ...]]:
        """The sub-pool names a pool for ``layout`` will have, each with its global layer ids."""
        return {g.name: g.layer_ids for g in sub_pool_groups(layout)}

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
        return pages_per_request(
            layout, max_context=max_context, page_size=page_size, prefill_chunk=prefill_chunk
        )

    @staticmethod
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
        return required_bytes(
            layout,
            max_context=max_context,
            concurrency=concurrency,
            page_size=page_size,
            prefill_chunk=prefill_chunk,
            kv_quantization=kv_quantization,
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
    ) -> HybridKVPool:
        """A pool whose buffers fit in ``budget_bytes``, split for a stated workload.

        Each sub-pool gets budget in proportion to what ``concurrency`` requests of
        ``max_context`` tokens need in it at their peak (see :meth:`pages_per_request`), plus
        its null page. With exactly :meth:`required_bytes` the workload fits; with more, every
        sub-pool grows in the same proportion. A budget too small for two pages (null page
        plus one) in some sub-pool raises ``PoolExhaustedError``. Quantized sub-pools
        (``kv_quantization``, as for the constructor) are counted at their stored bytes, so
        the same budget holds about 1.9x (8-bit) or 3.5x (4-bit, groups of 64) the tokens.
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
        )

    # ------------------------------------------------------------------ static facts

    @property
    def layout(self) -> CacheLayout:
        """The layout the pool was built for."""
        return self._layout

    @property
    def sub_pools(self) -> tuple[SubPoolSpec, ...]:
        """Every sub-pool's spec, in order of first layer id."""
        return self._specs

    @property
    def sub_pool_names(self) -> tuple[str, ...]:
        """Every sub-pool's name."""
        return tuple(spec.name for spec in self._specs)

    def _pool_index(self, sub_pool: str) -> int:
        index = self._index_of_name.get(sub_pool)
        if index is None:
            raise LayerKindError(
                f"unknown sub-pool {sub_pool!r}; this pool has {list(self._index_of_name)}"
            )
        return index

    def sub_pool_spec(self, sub_pool: str) -> SubPoolSpec:
        """The spec of the named sub-pool."""
        return self._specs[self._pool_index(sub_pool)]

    def allocator(self, sub_pool: str) -> PageAllocator:
        """The page allocator of the named sub-pool (read it; mutate only through the pool)."""
        return self._pages[self._pool_index(sub_pool)].allocator

    def page_tables(self, sub_pool: str) -> SubPoolPages:
        """The page tables of the named sub-pool (read them; mutate only through the pool)."""
        return self._pages[self._pool_index(sub_pool)]

    def sub_pool_of(self, layer_id: int) -> str:
        """Name of the sub-pool that stores ``layer_id``."""
        return self._storage.spec_of(layer_id).name

    def page_size(self, layer_id: int) -> int:
        """Tokens per page in the sub-pool of ``layer_id``."""
        return self._storage.spec_of(layer_id).page_size

    # ------------------------------------------------------------------ requests

    def _length(self, request_id: int) -> int:
        key = as_int(request_id)
        if key is None:
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        length = self._lengths.get(key)
        if length is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return length

    @property
    def request_ids(self) -> tuple[int, ...]:
        """Ids of the registered requests, in registration order."""
        return tuple(self._lengths)

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
        if self._prefix_caching:
            self._tokens[request_id] = []

    def seq_len(self, request_id: int) -> int:
        """Token positions reserved so far for the request."""
        return self._length(request_id)

    def _plan(self, request_id: int, n_tokens: int) -> list[ReservePlan]:
        length = self._lengths[request_id]
        return [pages.plan(request_id, length, n_tokens) for pages in self._pages]

    def _apply(self, request_id: int, plans: list[ReservePlan], n_tokens: int) -> None:
        for pages, plan in zip(self._pages, plans, strict=True):
            pages.release(request_id, plan)
        self._grow(request_id, plans, n_tokens)

    def _grow(self, request_id: int, plans: list[ReservePlan], n_tokens: int) -> None:
        for pages, plan in zip(self._pages, plans, strict=True):
            pages.grow(request_id, plan)
        self._lengths[request_id] += n_tokens

    def _fits_in_order(self, plans: list[list[ReservePlan]]) -> bool:
        """True if applying ``plans`` one request after another never runs out of pages."""
        free = [pages.allocator.num_free for pages in self._pages]
        for plan in plans:
            for i, step in enumerate(plan):
                free[i] += step.reclaim - step.n_new
                if free[i] < 0:
                    return False
        return True

    def _new_slots(self, index: int, request_id: int, old: int, n_tokens: int) -> mx.array:
        """The issued slots of positions ``old .. old + n_tokens - 1`` in sub-pool ``index``."""
        pages = self._pages[index]
        if n_tokens == 0:
            return mx.zeros((0,), dtype=mx.int32)
        if n_tokens == 1:
            slot, page = pages.slot(request_id, old)
            return self._storage.issue(mx.array([slot], dtype=mx.int32), index, [page])
        table = pages.table(request_id)
        size = pages.page_size
        slots = int32_array(table.slots(old, old + n_tokens, size))
        return self._storage.issue(slots, index, table.pages_between(old, old + n_tokens, size))

    def reserve(self, request_id: int, n_tokens: int) -> dict[str, mx.array]:
        """Reserve ``n_tokens`` more positions, atomically over all sub-pools.

        Returns the new tokens' int32 slots ``(n_tokens,)`` per sub-pool name. Sliding
        sub-pools first release pages that no query of the new tokens can see. On shortage
        raises ``PoolExhaustedError`` (sub-pool, pages asked, pages available counting the
        pages this call would release) and nothing changes.
        """
        old = self._length(request_id)
        request_id = int(request_id)
        check_int(n_tokens, "n_tokens", minimum=0)
        plans = self._plan(request_id, n_tokens)
        for pages, plan in zip(self._pages, plans, strict=True):
            pages.check_room(plan.n_new, plan.reclaim)
        self._apply(request_id, plans, n_tokens)
        return {
            spec.name: self._new_slots(i, request_id, old, n_tokens)
            for i, spec in enumerate(self._specs)
        }

    def reserve_batch(self, request_ids: Sequence[int], n_tokens: int = 1) -> dict[str, mx.array]:
        """Reserve ``n_tokens`` more positions for each request, atomically over the batch.

        The decode-step form of :meth:`reserve`: returns ``(B, n_tokens)`` int32 slots per
        sub-pool, built with one array conversion per sub-pool. Either every request gets its
        pages or ``PoolExhaustedError`` is raised (pages asked and available summed over the
        batch) and nothing changes. Repeated ids are a ``RequestStateError``.
        """
        check_int(n_tokens, "n_tokens", minimum=0)
        ids = _request_ids(request_ids, "reserve_batch")
        olds = [self._length(r) for r in ids]
        ids = [int(r) for r in ids]
        if len(set(ids)) != len(ids):
            raise RequestStateError(f"reserve_batch got repeated request ids: {list(request_ids)}")
        plans = [self._plan(rid, n_tokens) for rid in ids]
        for i, pages in enumerate(self._pages):
            pages.check_room(sum(p[i].n_new for p in plans), sum(p[i].reclaim for p in plans))
        if self._fits_in_order(plans):
            # Request by request: the same pages as one reserve per request in batch order.
            for rid, plan in zip(ids, plans, strict=True):
                self._apply(rid, plan, n_tokens)
        else:
            # The room check counted what the whole batch releases, and an earlier request
            # needs a later one's pages: every release goes before any allocation.
            for rid, plan in zip(ids, plans, strict=True):
                for pages, step in zip(self._pages, plan, strict=True):
                    pages.release(rid, step)
            for rid, plan in zip(ids, plans, strict=True):
                self._grow(rid, plan, n_tokens)
        out: dict[str, mx.array] = {}
        batch = len(ids)
        for i, pages in enumerate(self._pages):
            if batch == 0 or n_tokens == 0:
                out[pages.name] = mx.zeros((batch, n_tokens), dtype=mx.int32)
                continue
            size = pages.page_size
            flat = array("i")
            held: list[int] = []
            for rid, old in zip(ids, olds, strict=True):
                if n_tokens == 1:
                    slot, page = pages.slot(rid, old)
                    held.append(page)
                    flat.append(slot)
                else:
                    table = pages.table(rid)
                    held.extend(table.pages_between(old, old + n_tokens, size))
                    flat.extend(table.slots(old, old + n_tokens, size))
            shaped = memoryview(flat).cast("B").cast("i", (batch, n_tokens))
            out[pages.name] = self._storage.issue(int32_array(shaped), i, held)
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
        need = [0] * len(self._pages)
        for request_id, n_tokens in demands.items():
            self._length(request_id)
            check_int(n_tokens, "n_tokens", minimum=0)
            for i, step in enumerate(self._plan(int(request_id), n_tokens)):
                need[i] += max(0, step.n_new - step.reclaim)
        return all(
            n <= pages.allocator.num_free for n, pages in zip(need, self._pages, strict=True)
        )

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
        self._tokens.pop(request_id, None)

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
        for pages, keep in zip(self._pages, keeps, strict=True):
            pages.trim(request_id, keep, length - n_tokens)
        self._lengths[request_id] = length - n_tokens
        committed = self._tokens.get(request_id)
        if committed is not None:
            del committed[length - n_tokens :]

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
        self._storage.copy_tokens(copies)
        self._lengths[child_id] = n_tokens
        parent_tokens = self._tokens.get(parent_id)
        if parent_tokens is not None:
            self._tokens[child_id] = parent_tokens[:n_tokens]
            for pages in self._pages:
                pages.inherit(parent_id, child_id, n_tokens)

    # ------------------------------------------------------------------ prefix caching

    @property
    def prefix_caching(self) -> bool:
        """Whether complete pages are kept for reuse by requests with the same prefix."""
        return self._prefix_caching

    def _prefix_step(self) -> int:
        """A reusable prefix ends on a page boundary of every sub-pool."""
        return math.lcm(*(spec.page_size for spec in self._specs)) if self._specs else 0

    def commit_tokens(self, request_id: int, tokens: Sequence[int]) -> None:
        """Record the tokens of the request's next positions as written (their K/V are in).

        ``tokens`` continue the committed ones (positions ``committed .. committed + n - 1``,
        within the reserved length). Every page that becomes complete is registered under
        its chained block hash, so a later request with the same prefix can reuse it, and
        once no request holds it, it stays cached until an allocation evicts it. A no-op
        without prefix caching.
        """
        length = self._length(request_id)
        if not self._prefix_caching:
            return
        request_id = int(request_id)
        committed = self._tokens[request_id]
        new = [check_int(t, "token id", minimum=0) for t in tokens]
        if len(committed) + len(new) > length:
            raise RequestStateError(
                f"cannot commit {len(new)} tokens of request {request_id}: {len(committed)} "
                f"are committed and only {length} positions are reserved"
            )
        committed.extend(new)
        for pages in self._pages:
            pages.commit(request_id, committed, salt=self._salt)

    def _usable_prefix(self, tokens: Sequence[int]) -> tuple[int, list[list[bytes]]]:
        step = self._prefix_step()
        if not self._prefix_caching or not step or len(tokens) < 2:
            return 0, []
        longest = (len(tokens) - 1) // step * step
        hashes = [block_hashes(tokens[:longest], p.page_size, salt=self._salt) for p in self._pages]
        # counts[s][j]: blocks of sub-pool s cached among its first j.
        counts: list[list[int]] = []
        for pages, own in zip(self._pages, hashes, strict=True):
            running = [0]
            for present in pages.cached_blocks(own):
                running.append(running[-1] + int(present))
            counts.append(running)
        for p in range(longest, 0, -step):
            if all(
                c[need.stop] - c[need.start] == len(need)
                for pages, c in zip(self._pages, counts, strict=True)
                for need in (pages.needed_blocks(p),)
            ):
                return p, hashes
        return 0, hashes

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` a new request can reuse from the cache.

        A multiple of every sub-pool's page size, below ``len(tokens)`` (the last token is
        always computed, for its logits), such that every sub-pool still has the pages its
        lifetime needs at that length: all of them in a full sub-pool, only those holding
        positions ``p - window + 1 .. p - 1`` in a sliding one. 0 without prefix caching.
        """
        tokens = [check_int(t, "token id", minimum=0) for t in tokens]
        found, _ = self._usable_prefix(tokens)
        if self._prefix_caching:
            self._queries += 1
            self._query_tokens += len(tokens)
        return found

    def reuse_prefix(self, request_id: int, tokens: Sequence[int], n_tokens: int) -> None:
        """Start the new, empty request at ``n_tokens`` cached tokens of ``tokens``.

        The cached pages its sub-pools need are shared (one more owner each, no copy) and its
        length becomes ``n_tokens``; prefill goes on from there. ``n_tokens`` must be a prefix
        :meth:`match_prefix` allows; otherwise ``CacheStateError`` and nothing changes.
        """
        length = self._length(request_id)
        request_id = int(request_id)
        if length:
            raise RequestStateError(
                f"request {request_id} already holds {length} tokens; a prefix is reused by a "
                "new request only"
            )
        tokens = [check_int(t, "token id", minimum=0) for t in tokens]
        n_tokens = check_int(n_tokens, "n_tokens", minimum=1, maximum=max(len(tokens) - 1, 1))
        usable, hashes = self._usable_prefix(tokens[: n_tokens + 1])
        if usable != n_tokens:
            raise CacheStateError(
                f"the cache cannot serve a prefix of {n_tokens} tokens for request "
                f"{request_id} (it serves {usable}); reuse what match_prefix returns"
            )
        for pages, own in zip(self._pages, hashes, strict=True):
            pages.reuse(request_id, own, n_tokens)
        self._lengths[request_id] = n_tokens
        self._tokens[request_id] = tokens[:n_tokens]
        self._hit_tokens += n_tokens

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups, reused tokens, cached pages and evictions so far."""
        allocators = [p.allocator for p in self._pages]
        return PrefixCacheStats(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            cached_pages=sum(a.num_cached for a in allocators),
            hashed_pages=sum(a.num_hashed for a in allocators),
            evictions=sum(a.evictions_total for a in allocators),
        )

    def drop_cached_prefixes(self) -> int:
        """Forget every cached block no request holds; returns the pages freed."""
        return sum(p.allocator.drop_cached() for p in self._pages)

    # ------------------------------------------------------------------ page tables and slots

    def held_pages(self, request_id: int, sub_pool: str) -> list[int]:
        """Physical pages the request holds in the sub-pool, in logical order."""
        self._length(request_id)
        return self._pages[self._pool_index(sub_pool)].table(int(request_id)).held()

    def page_table(self, request_id: int, sub_pool: str) -> mx.array:
        """``(n_pages,)`` int32 logical page table of one request; released entries are 0."""
        self._length(request_id)
        table = self._pages[self._pool_index(sub_pool)].table(int(request_id))
        if not table.pages:
            return mx.zeros((0,), dtype=mx.int32)
        return int32_array(table.pages)

    def batch_page_table(self, request_ids: Sequence[int], sub_pool: str) -> mx.array:
        """``(B, max_pages)`` int32 logical page tables, padded and unheld entries = page 0.

        Entry ``[b, j]`` is the physical page holding positions ``j * page_size ..
        (j + 1) * page_size - 1`` of request ``b``. ``max_pages`` is at least 1.
        """
        pages = self._pages[self._pool_index(sub_pool)]
        for r in request_ids:
            self._length(r)
        tables = [pages.table(int(r)) for r in request_ids]
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
        pages = self._pages[index]
        slots: list[int] = []
        held: list[int] = []
        for request_id, pos in zip(request_ids, positions, strict=True):
            self._length(request_id)
            self._check_position(int(request_id), index, pos)
            slot, page = pages.slot(int(request_id), pos)
            held.append(page)
            slots.append(slot)
        out = mx.array(slots, dtype=mx.int32)
        # Two requests sharing a page can name one slot: such an array is for reads only.
        return self._storage.issue(out, index, held) if len(set(slots)) == len(slots) else out

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
    def storage(self) -> KVStorage:
        """The pool's buffers and slot checks (read them; write through the pool)."""
        return self._storage

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        """Make buffer accessors wait on ``counter`` for their global layer id (``None``: stop)."""
        self._storage.register_layer_transfer_counter(counter)

    @property
    def layer_transfer_counter(self) -> LayerTransferCounter | None:
        """The registered layer transfer counter, if any."""
        return self._storage.layer_transfer_counter

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
        pool issued (``reserve``, ``reserve_batch``, ``token_slots``, ``batch_slots``) are
        trusted by identity, and any other array is read on the host once before the write.
        Do not modify a slot array in place after handing it to the pool.
        """
        self._storage.set_kv(layer_id, slots, keys, values, wait=wait)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        ``slots`` are checked as for :meth:`set_kv`, repeats allowed.
        """
        return self._storage.get_kv(layer_id, slots)

    # ------------------------------------------------------------------ accounting

    def num_free_pages(self, sub_pool: str) -> int:
        """Pages of the sub-pool that can be allocated now."""
        return self._pages[self._pool_index(sub_pool)].allocator.num_free

    def memory_report(self) -> PoolMemoryReport:
        """Bytes and pages used and free per sub-pool, and the saving against full storage."""
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
            )
            for spec, pages in zip(self._specs, self._pages, strict=True)
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
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}: {s.num_pages} x {s.page_size}" for s in self._specs)
        return f"HybridKVPool({parts}; {len(self._lengths)} requests)"
