"""A refcounted page allocator with a reserved null page 0."""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from kv_protocol import InvalidPageError, PoolExhaustedError, check_int, is_int

__all__ = ["PageAllocator"]


class PageAllocator:
    """Fixed-size pages ``1 .. num_pages - 1`` with reference counts; page 0 is never handed out.

    ``alloc`` hands out the lowest free page ids first (a heap of free ids, O(log n) a page)
    and ``free`` is O(log n) a page too. Pages in use therefore gather at low ids, which is
    what lets a pool whose buffers grow with use (:attr:`high_water`) shrink them again when
    the load drops. Every operation validates its whole argument before changing anything,
    so a failed call (a shortage, a double free, a foreign page) leaves the allocator exactly
    as it was.

    Each page has a *generation* that grows every time one of its owners lets go of it
    (``free``), so whoever remembers ``(page, generation)`` can tell later whether the page
    lost an owner in between, and maybe went to another one: the pool uses it to end the
    trust of the slot arrays it issued. ``drops_total`` counts those events over all pages,
    so "nothing changed" is one comparison.

    Prefix caching: a page holding a complete, written block of tokens can be registered
    under the block's content hash (:meth:`register_hash`). When its last owner lets go of
    it, such a page is not freed but kept *cached*: refcount 0, counted as free, found by
    :meth:`cached_page`, given back to a new owner by :meth:`reuse`, and evicted (its hash
    forgotten) least recently released first when :meth:`alloc` runs out of plain free pages.
    A page in use is never evicted. ``on_forget`` (when set) is called with each block the
    allocator stops holding: evicted, dropped, or forgotten because its page is rewritten.
    """

    def __init__(self, num_pages: int, *, name: str = "pool") -> None:
        num_pages = check_int(
            num_pages, f"PageAllocator {name!r} num_pages (page 0 is the null page)", minimum=1
        )
        self._name = name
        self._num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._generations = [0] * num_pages
        # A min-heap of plain free page ids (a sorted list is a heap already).
        self._free = list(range(1, num_pages))
        # Highest page id handed out since the last settle_high_water (0: none).
        self._high = 0
        self._allocated_total = 0
        self._released_total = 0
        self._drops_total = 0
        self._hash_of: dict[int, Hashable] = {}
        self._page_of: dict[Hashable, int] = {}
        # Cached pages at refcount 0, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._evictions = 0
        #: Called with every block hash the allocator forgets (see the class docstring).
        self.on_forget: Callable[[Hashable], None] | None = None

    @property
    def name(self) -> str:
        """The sub-pool name used in error messages."""
        return self._name

    @property
    def num_pages(self) -> int:
        """Pages managed, the null page included."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (free ones and cached ones nobody holds)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages currently held by at least one owner (the null page excluded)."""
        return self._num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages nobody holds that keep a registered block for reuse (evictable)."""
        return len(self._evictable)

    @property
    def num_hashed(self) -> int:
        """Pages registered under a block hash, held or not."""
        return len(self._hash_of)

    @property
    def evictions_total(self) -> int:
        """Cached pages evicted (their block forgotten) to satisfy ``alloc`` (a statistic)."""
        return self._evictions

    @property
    def pages_allocated_total(self) -> int:
        """Pages handed out by ``alloc`` since construction (a statistic)."""
        return self._allocated_total

    @property
    def pages_released_total(self) -> int:
        """Pages returned to the free list since construction (a statistic)."""
        return self._released_total

    @property
    def drops_total(self) -> int:
        """Owner drops (one per page per ``free``) since construction: all generations' sum."""
        return self._drops_total

    def generation(self, page: int) -> int:
        """How many times an owner of ``page`` has let go of it since construction."""
        self.refcount(page)
        return self._generations[page]

    def generations(self, pages: Sequence[int]) -> list[int]:
        """The generations of ``pages`` (trusted ids, no checks: the pool's fast path)."""
        gens = self._generations
        return [gens[p] for p in pages]

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages atomically (all or none) with refcount 1 each."""
        n = check_int(n, "alloc's page count", minimum=0)
        if n > self.num_free:
            raise PoolExhaustedError(
                sub_pool=self._name, pages_requested=n, pages_free=self.num_free
            )
        if n == 0:
            return []
        plain = min(n, len(self._free))
        free = self._free
        pages = [heapq.heappop(free) for _ in range(plain)]
        for _ in range(n - plain):
            page, _ = self._evictable.popitem(last=False)
            self._forget(page)
            self._evictions += 1
            pages.append(page)
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] = 1
        self._allocated_total += n
        top = max(pages)
        if top > self._high:
            self._high = top
        return pages

    @property
    def high_water(self) -> int:
        """An upper bound of the highest page id held or cached (0 when none).

        The highest handed out since the last :meth:`settle_high_water`: buffers covering
        pages ``0 .. high_water`` hold every page anyone can address.
        """
        return self._high

    def highest_held(self) -> int:
        """The highest page id some owner holds now (0: none). O(num_pages)."""
        refcounts = self._refcounts
        for page in range(self._num_pages - 1, 0, -1):
            if refcounts[page]:
                return page
        return 0

    def settle_high_water(self) -> int:
        """Lower :attr:`high_water` to the highest page held or cached now; return it.

        O(num_pages): for the rare moments a pool gives memory back, never a decode step.
        """
        top = max(self.highest_held(), max(self._evictable, default=0))
        self._high = top
        return top

    def drop_cached_from(self, first: int) -> int:
        """Forget the cached blocks of pages ``>= first`` nobody holds and free those pages.

        Returns how many were dropped. Held pages and cached pages below ``first`` stay.
        """
        first = check_int(first, "drop_cached_from's first page", minimum=1)
        dropped = [page for page in self._evictable if page >= first]
        for page in dropped:
            del self._evictable[page]
            self._forget(page)
            heapq.heappush(self._free, page)
        return len(dropped)

    def _check_owned(self, pages: Iterable[int], what: str) -> Counter[int]:
        if isinstance(pages, str | bytes) or not isinstance(pages, Iterable):
            raise InvalidPageError(
                f"{what} in sub-pool {self._name!r}: expected a sequence of page ids, got {pages!r}"
            )
        counts: Counter[int] = Counter()
        for page in pages:
            if not is_int(page):
                raise InvalidPageError(
                    f"{what} in sub-pool {self._name!r}: page ids must be ints, got {page!r}"
                )
            if page == 0:
                raise InvalidPageError(
                    f"{what} in sub-pool {self._name!r}: page 0 is the reserved null page and "
                    "is never allocated"
                )
            if not 0 < page < self._num_pages:
                raise InvalidPageError(
                    f"{what} in sub-pool {self._name!r}: page {page} is not owned by this "
                    f"allocator (valid pages are 1..{self._num_pages - 1})"
                )
            counts[int(page)] += 1
        for page, times in counts.items():
            held = self._refcounts[page]
            if held == 0:
                raise InvalidPageError(
                    f"{what} in sub-pool {self._name!r}: page {page} is free (double free or "
                    "never allocated)"
                )
            if what == "free" and times > held:
                raise InvalidPageError(
                    f"free in sub-pool {self._name!r}: page {page} is freed {times} times but "
                    f"has only {held} owner(s)"
                )
        return counts

    def incref(self, pages: Sequence[int]) -> None:
        """Add one owner to each allocated page (prefix sharing); all-or-nothing."""
        counts = self._check_owned(pages, "incref")
        for page, times in counts.items():
            self._refcounts[page] += times

    def free(self, pages: Sequence[int]) -> None:
        """Drop one owner of each page; a page returns to the free list at refcount 0.

        Freeing a page that is free already, page 0, or a page outside this allocator raises
        ``InvalidPageError`` and changes nothing.
        """
        refcounts = self._refcounts
        if type(pages) is list and len(pages) == 1:
            # Fast path for the common single-page free; anything unusual takes the full check.
            page = pages[0]
            if type(page) is int and 0 < page < self._num_pages and refcounts[page] > 0:
                left = refcounts[page] - 1
                refcounts[page] = left
                self._generations[page] += 1
                self._drops_total += 1
                if left == 0:
                    self._release(page)
                return
        counts = self._check_owned(pages, "free")
        for page, times in counts.items():
            left = refcounts[page] - times
            refcounts[page] = left
            self._generations[page] += times
            self._drops_total += times
            if left == 0:
                self._release(page)

    def _release(self, page: int) -> None:
        """A page's last owner let go: cache it if it holds a registered block, else free it."""
        self._released_total += 1
        if page in self._hash_of:
            self._evictable[page] = None
        else:
            heapq.heappush(self._free, page)

    def _forget(self, page: int) -> None:
        block = self._hash_of.pop(page, None)
        if block is not None:
            del self._page_of[block]
            if self.on_forget is not None:
                self.on_forget(block)

    # ------------------------------------------------------------------ prefix caching

    def register_hash(self, page: int, block: Hashable) -> bool:
        """Record that held ``page`` holds the complete block ``block`` (a content hash).

        False (and nothing recorded) when another page already holds that block or this page
        holds another one: the first copy stays the cached one.
        """
        if self.refcount(page) == 0:
            raise InvalidPageError(
                f"register_hash in sub-pool {self._name!r}: page {page} is not held"
            )
        if block in self._page_of or page in self._hash_of:
            return False
        self._hash_of[page] = block
        self._page_of[block] = page
        return True

    def forget_hash(self, page: int) -> None:
        """Drop the block a held page was registered under (its content is about to change)."""
        self._forget(page)

    def block_of(self, page: int) -> Hashable | None:
        """The block hash ``page`` is registered under, if any."""
        return self._hash_of.get(page)

    def cached_page(self, block: Hashable) -> int | None:
        """The page holding ``block``, held or cached, or ``None``."""
        return self._page_of.get(block)

    def reuse(self, pages: Sequence[int]) -> None:
        """One more owner for each page of a registered block; all-or-nothing.

        A cached page (refcount 0) leaves the eviction order.
        """
        for page in pages:
            if page not in self._hash_of:
                raise InvalidPageError(
                    f"reuse in sub-pool {self._name!r}: page {page} holds no registered block"
                )
        for page in pages:
            if self._refcounts[page] == 0:
                del self._evictable[page]
            self._refcounts[page] += 1

    def drop_cached(self) -> int:
        """Forget every cached block nobody holds and free its page; returns how many."""
        dropped = list(self._evictable)
        self._evictable.clear()
        for page in dropped:
            self._forget(page)
            heapq.heappush(self._free, page)
        return len(dropped)

    def refcount(self, page: int) -> int:
        """Current owner count of ``page`` (0 when free); ``InvalidPageError`` for a foreign id."""
        if not is_int(page) or not 0 <= page < self._num_pages:
            raise InvalidPageError(
                f"page {page!r} is not a page of sub-pool {self._name!r} "
                f"(valid pages are 0..{self._num_pages - 1})"
            )
        return self._refcounts[page]

    def __repr__(self) -> str:
        return (
            f"PageAllocator(name={self._name!r}, num_pages={self._num_pages}, free={self.num_free})"
        )
