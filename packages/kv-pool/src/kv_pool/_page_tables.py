"""Page tables per lifetime: which physical pages each request holds in one sub-pool.

No tensors here: a :class:`SubPoolPages` owns one sub-pool's allocator and its requests' page
tables, and applies the sub-pool's lifetime rule (:class:`kv_protocol.KVLifetime`): a
reservation first releases the pages no later query can see, a trim must keep what the query
at the new length sees, a fork takes only the pages the child's next query needs. The pool
coordinates one of these per sub-pool and keeps the requests' lengths.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

from kv_protocol import CacheStateError, KVLifetime, PoolExhaustedError, RequestStateError

from ._allocator import PageAllocator

__all__ = ["ForkPlan", "PageTable", "ReservePlan", "SubPoolPages"]


class PageTable:
    """One request's logical page table in one sub-pool.

    ``pages[j]`` is the physical page of logical page ``j``; entries below ``first_live`` were
    released (sliding sub-pools) and are 0. An ``array('i')`` grows in amortised O(1) and
    converts to an int32 array without a Python loop.
    """

    __slots__ = ("first_live", "pages")

    def __init__(self) -> None:
        self.pages = array("i")
        self.first_live = 0

    @property
    def n_pages(self) -> int:
        """Logical pages, released ones included."""
        return len(self.pages)

    def held(self) -> list[int]:
        """The physical pages still held, in logical order."""
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

    def pages_between(self, start: int, stop: int, page_size: int) -> list[int]:
        """Physical pages holding positions ``start .. stop - 1`` (``start < stop``)."""
        return self.pages[start // page_size : (stop - 1) // page_size + 1].tolist()


class ReservePlan(NamedTuple):
    """What one reservation does in one sub-pool.

    Release logical pages ``[first_live, cut)`` (the physical ``release`` list, of which
    ``reclaim`` return to the free list; shared ones only lose an owner), then add ``n_new``.
    """

    cut: int
    release: list[int]
    n_new: int
    reclaim: int


class ForkPlan(NamedTuple):
    """What a fork takes from the parent in one sub-pool.

    Logical pages below ``first`` are not needed, ``shared`` are whole pages the child
    shares, ``tail_page`` (0: none) holds a partial last page the child gets a copy of.
    """

    first: int
    shared: list[int]
    tail_page: int


class SubPoolPages:
    """One sub-pool's allocator and the page tables of its requests, under one lifetime rule."""

    def __init__(self, name: str, *, page_size: int, num_pages: int, lifetime: KVLifetime) -> None:
        self.name = name
        self.page_size = page_size
        self.lifetime = lifetime
        self.allocator = PageAllocator(num_pages, name=name)
        self._tables: dict[int, PageTable] = {}

    # ------------------------------------------------------------------ requests

    def add(self, request_id: int) -> None:
        """Give ``request_id`` an empty table (the pool checked it is new)."""
        self._tables[request_id] = PageTable()

    def table(self, request_id: int) -> PageTable:
        """The request's table (the pool checked the request exists)."""
        return self._tables[request_id]

    def free(self, request_id: int) -> None:
        """Release every page the request holds and forget its table."""
        held = self._tables.pop(request_id).held()
        if held:
            self.allocator.free(held)

    # ------------------------------------------------------------------ reserving

    def plan(self, request_id: int, length: int, n_tokens: int) -> ReservePlan:
        """What reserving ``n_tokens`` more positions after ``length`` does here."""
        table = self._tables[request_id]
        size = self.page_size
        n_new = -(-(length + n_tokens) // size) - len(table.pages)
        first = table.first_live
        # Queries at positions >= length see no page before this one.
        cut = max(first, self.lifetime.first_live_page(length, size))
        if cut == first:
            return ReservePlan(cut, [], n_new, 0)
        release = table.pages[first:cut].tolist()
        refcount = self.allocator.refcount
        reclaim = sum(1 for p in release if refcount(p) == 1)
        return ReservePlan(cut, release, n_new, reclaim)

    def release(self, request_id: int, plan: ReservePlan) -> None:
        """Apply the release part of ``plan``."""
        if plan.release:
            table = self._tables[request_id]
            self.allocator.free(plan.release)
            table.pages[table.first_live : plan.cut] = array("i", bytes(4 * len(plan.release)))
            table.first_live = plan.cut

    def grow(self, request_id: int, plan: ReservePlan) -> None:
        """Apply the allocation part of ``plan`` (the pool checked there is room)."""
        if plan.n_new:
            self._tables[request_id].pages.extend(self.allocator.alloc(plan.n_new))

    def check_room(self, need: int, extra: int) -> None:
        """``PoolExhaustedError`` unless ``need`` pages fit in the free ones plus ``extra``."""
        available = self.allocator.num_free + extra
        if need > available:
            raise PoolExhaustedError(sub_pool=self.name, pages_requested=need, pages_free=available)

    # ------------------------------------------------------------------ trimming

    def trim_keep(self, request_id: int, length: int, n_tokens: int) -> int:
        """Logical pages to keep when the request goes from ``length`` to ``length - n_tokens``.

        Refused (``CacheStateError``, nothing changed) when this sub-pool released positions
        the query at the new length still sees, or when the request would next write into a
        page it shares with a forked request.
        """
        table = self._tables[request_id]
        size = self.page_size
        new_len = length - n_tokens
        if table.first_live:
            needed = self.lifetime.first_visible(new_len)
            if table.first_live * size > needed:
                raise CacheStateError(
                    f"cannot trim request {request_id} to {new_len} tokens: sub-pool "
                    f"{self.name!r} released positions below {table.first_live * size} "
                    f"that a query at position {new_len} still sees (from {needed})"
                )
        keep = max(-(-new_len // size), table.first_live)
        if n_tokens and new_len % size and keep > table.first_live:
            tail = table.pages[keep - 1]
            if self.allocator.refcount(tail) > 1:
                raise CacheStateError(
                    f"cannot trim request {request_id} to {new_len} tokens: its page {tail} "
                    f"of sub-pool {self.name!r} is shared with another request (a fork), "
                    "and the next write would land in it"
                )
        return keep

    def trim(self, request_id: int, keep: int) -> None:
        """Free the logical pages from ``keep`` on (from :meth:`trim_keep`)."""
        table = self._tables[request_id]
        extra = table.pages[keep:].tolist()
        if extra:
            self.allocator.free(extra)
            del table.pages[keep:]

    # ------------------------------------------------------------------ forking

    def fork_plan(self, parent_id: int, n_tokens: int) -> ForkPlan:
        """What a child holding the parent's first ``n_tokens`` positions takes here.

        Refused (``RequestStateError``) when the parent released pages the child still needs.
        """
        table = self._tables[parent_id]
        size = self.page_size
        whole, tail = divmod(n_tokens, size)
        first = self.lifetime.first_live_page(n_tokens, size)
        if n_tokens and first < table.first_live:
            raise RequestStateError(
                f"cannot fork {n_tokens} tokens of request {parent_id}: sub-pool "
                f"{self.name!r} released positions below {table.first_live * size}"
                f" that the child still needs (from {first * size})"
            )
        tail_page = table.pages[whole] if tail else 0
        return ForkPlan(first, table.pages[first:whole].tolist(), tail_page)

    def fork(self, child_id: int, plan: ForkPlan) -> int:
        """Give ``child_id`` the plan's pages; returns the child's fresh tail page (0: none).

        The pool checked a page is free for the tail copy.
        """
        if plan.shared:
            self.allocator.incref(plan.shared)
        table = PageTable()
        table.pages = array("i", bytes(4 * plan.first))
        table.pages.extend(plan.shared)
        table.first_live = plan.first
        new_page = 0
        if plan.tail_page:
            new_page = self.allocator.alloc(1)[0]
            table.pages.append(new_page)
        self._tables[child_id] = table
        return new_page

    def adopt(self, request_id: int, first_live: int, pages: Sequence[int]) -> None:
        """Give the empty request ``pages`` (owned for it) from logical page ``first_live`` on."""
        table = self._tables[request_id]
        table.pages = array("i", bytes(4 * first_live))
        table.pages.extend(pages)
        table.first_live = first_live

    # ------------------------------------------------------------------ reading

    def first_held_position(self, request_id: int) -> int:
        """The oldest position the request still holds in this sub-pool."""
        return self._tables[request_id].first_live * self.page_size

    def slot(self, request_id: int, position: int) -> tuple[int, int]:
        """``(slot, page)`` of a held position."""
        table = self._tables[request_id]
        page = table.pages[position // self.page_size]
        return page * self.page_size + position % self.page_size, page
