"""Prefix caching over a pool's sub-pools: block hashes, commit, match, reuse, eviction hooks.

A request's text is hashed once, as it grows, into a chain of content hashes kept by the
request (:class:`BlockHashes`); a sub-pool's page ``j`` of ``P`` tokens is known by the chain's
hash at position ``(j + 1) * P``, which covers every token before it, so equal hashes mean equal
prefixes whatever the page size. :class:`PrefixCache` registers the pages a request's written
tokens complete (:meth:`~PrefixCache.commit`), finds the longest prefix every sub-pool can serve
(:meth:`~PrefixCache.match_prefix`, a :class:`kv_protocol.PrefixHit`) and hands its pages to a
new request (:meth:`~PrefixCache.reuse_prefix`). The pages themselves stay in each sub-pool's
allocator, cached at refcount 0 once no request holds them, until an allocation evicts them.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Callable, Hashable, Sequence

from kv_protocol import (
    CacheStateError,
    PrefixCacheStats,
    PrefixHit,
    RequestStateError,
    TokenHashes,
    check_int,
)

from ._page_tables import SubPoolPages

__all__ = ["BlockHashes", "PrefixCache"]

#: Called with ``(sub_pool, block_hash)`` when a sub-pool stops holding a cached block.
EvictionListener = Callable[[str, bytes], None]


class BlockHashes:
    """Chained content hashes of a growing token text, one per ``granularity`` tokens.

    Entry ``i`` hashes entry ``i - 1`` (``salt`` for the first) and tokens ``i * g ..
    (i + 1) * g - 1``, so it stands for the whole prefix of ``(i + 1) * g`` tokens; ``salt``
    adds whatever else changes the K/V (a model or adapter id). :meth:`extend` hashes each
    token once; the tokens of a block not yet complete are the only ones kept.
    """

    __slots__ = ("_chain", "_count", "_tail", "granularity", "salt")

    def __init__(self, tokens: Sequence[int] = (), *, granularity: int, salt: bytes = b"") -> None:
        self.granularity = check_int(granularity, "granularity", minimum=1)
        if not isinstance(salt, bytes):
            raise RequestStateError(f"a block hash salt must be bytes, got {salt!r}")
        self.salt = salt
        self._chain: list[bytes] = []
        self._tail: list[int] = []
        self._count = 0
        self.extend(tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens hashed so far (the last, incomplete block's included)."""
        return self._count

    @property
    def complete_tokens(self) -> int:
        """Tokens covered by complete blocks."""
        return len(self._chain) * self.granularity

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (non-negative ints) to the hashed text.

        Every token is checked before any is added, so a bad one changes nothing.
        """
        new = [check_int(t, "token id", minimum=0) for t in tokens]
        size = self.granularity
        tail = self._tail
        tail.extend(new)
        full = len(tail) // size * size
        previous = self._chain[-1] if self._chain else self.salt
        for start in range(0, full, size):
            block = array("q", tail[start : start + size]).tobytes()
            previous = hashlib.blake2b(previous + block, digest_size=16).digest()
            self._chain.append(previous)
        del tail[:full]
        self._count += len(new)

    def copy(self) -> BlockHashes:
        """Independent hashes of the same text (nothing is hashed again)."""
        twin = BlockHashes(granularity=self.granularity, salt=self.salt)
        twin._chain = list(self._chain)
        twin._tail = list(self._tail)
        twin._count = self._count
        return twin

    def truncate(self, length: int, text: Sequence[int]) -> None:
        """Keep the first ``length`` tokens only (``text``: the hashed text, at least them).

        Complete blocks below ``length`` are kept as they are; the tokens of the last,
        incomplete block come from ``text``. ``length`` past the hashed tokens or a ``text``
        too short raises ``RequestStateError`` and changes nothing.
        """
        length = check_int(length, "length", minimum=0, maximum=self._count)
        blocks = length // self.granularity
        start = blocks * self.granularity
        if len(text) < length:
            raise RequestStateError(
                f"truncating hashes to {length} tokens needs their text, got {len(text)} tokens"
            )
        tail = [check_int(t, "token id", minimum=0) for t in text[start:length]]
        del self._chain[blocks:]
        self._tail = tail
        self._count = length

    def prefix_hash(self, length: int) -> bytes:
        """The hash standing for the first ``length`` tokens (a multiple of the granularity)."""
        index, rest = divmod(length, self.granularity)
        if rest or not 0 < index <= len(self._chain):
            raise RequestStateError(
                f"no block hash ends at token {length}: hashes end at multiples of "
                f"{self.granularity} up to {self.complete_tokens}"
            )
        return self._chain[index - 1]

    def page_hash(self, page: int, page_size: int) -> bytes:
        """The hash of logical page ``page`` of ``page_size`` tokens: its prefix's hash."""
        return self.prefix_hash((page + 1) * page_size)

    def __repr__(self) -> str:
        return f"BlockHashes({self._count} tokens, {len(self._chain)} blocks of {self.granularity})"


class PrefixCache:
    """The prefix cache of one pool, satisfying :class:`kv_protocol.KVPrefixCache`.

    ``pages`` are the pool's sub-pools' page tables and ``lengths`` its live mapping of
    request id to reserved length (the pool's own dict: :meth:`reuse_prefix` sets a new
    request's length in it). A usable prefix ends on a page boundary of every sub-pool (a
    multiple of the least common multiple of their page sizes) and leaves the last token to
    compute; a sliding sub-pool serves a prefix of length ``p`` when it holds the pages of
    positions ``p - W + 1 .. p - 1``, a full one when it holds every page below ``p``.

    The pool calls :meth:`request_added`, :meth:`request_freed`, :meth:`before_trim` and
    :meth:`forked` as its requests change; each request's registered page count per sub-pool
    is all this object keeps of it.
    """

    def __init__(
        self,
        pages: Sequence[SubPoolPages],
        lengths: dict[int, int],
        *,
        salt: bytes = b"",
        boundary: int = 16,
    ) -> None:
        if not isinstance(salt, bytes):
            raise RequestStateError(f"prefix_salt must be bytes, got {salt!r}")
        self._pages = tuple(pages)
        self._lengths = lengths
        self._salt = salt
        sizes = [p.page_size for p in self._pages]
        # A pool of STATE layers only has no page: its prefixes end every ``boundary`` tokens
        # (what is reused there is the caller's, e.g. a recurrent state snapshot).
        default = check_int(boundary, "boundary", minimum=1)
        self._granularity = math.gcd(*sizes) if sizes else default
        self._step = math.lcm(*sizes) if sizes else default
        # request id -> pages registered (complete and written) per sub-pool
        self._registered: dict[int, list[int]] = {}
        self._queries = self._query_tokens = self._hit_tokens = 0
        self._listeners: list[EvictionListener] = []
        for sub in self._pages:
            sub.allocator.on_forget = self._forgetter(sub.name)

    def _forgetter(self, name: str) -> Callable[[Hashable], None]:
        def forgotten(block: Hashable) -> None:
            for listener in self._listeners:
                listener(name, block)  # type: ignore[arg-type]

        return forgotten

    # ------------------------------------------------------------------ the request's side

    def hash_tokens(self, tokens: Sequence[int]) -> BlockHashes:
        """New hashes of ``tokens``, at the granularity and salt of this pool's pages."""
        return BlockHashes(tokens, granularity=self._granularity, salt=self._salt)

    def _check_hashes(self, hashes: object) -> BlockHashes:
        if (
            not isinstance(hashes, BlockHashes)
            or hashes.granularity != self._granularity
            or hashes.salt != self._salt
        ):
            raise RequestStateError(
                f"prefix caching takes the BlockHashes this pool's hash_tokens made, got {hashes!r}"
            )
        return hashes

    def commit(self, request_id: int, hashes: TokenHashes, length: int) -> None:
        """The request's positions ``0 .. length - 1`` hold the K/V of ``hashes``' first tokens.

        Registers every page those positions complete (and the request still holds) under its
        block hash. ``length`` may not pass the request's reserved length nor its hashed
        text (``RequestStateError``, nothing registered).
        """
        own = self._check_hashes(hashes)
        reserved = self._lengths.get(request_id)
        if reserved is None:
            raise RequestStateError(f"cannot commit tokens of unknown request {request_id!r}")
        length = check_int(length, "length", minimum=0)
        if length > reserved or length > own.num_tokens:
            raise RequestStateError(
                f"cannot commit {length} tokens of request {request_id}: it reserved "
                f"{reserved} positions and its hashes cover {own.num_tokens} tokens"
            )
        registered = self._registered[request_id]
        covered = min(length, own.complete_tokens)
        for i, sub in enumerate(self._pages):
            size = sub.page_size
            full = covered // size
            if full <= registered[i]:
                continue
            table = sub.table(request_id)
            for j in range(registered[i], full):
                page = table.pages[j]
                if page:  # 0: the page left a sliding window before it was committed
                    sub.allocator.register_hash(page, own.page_hash(j, size))
            registered[i] = full

    @property
    def boundary(self) -> int:
        """Tokens a reusable prefix's length is a multiple of: the page sizes' least multiple."""
        return self._step

    def match_prefix(
        self, hashes: TokenHashes, *, usable: Callable[[int], bool] | None = None
    ) -> PrefixHit:
        """The longest prefix of the hashed text, below its length, that a request can reuse.

        With ``usable``, a length counts only where ``usable(length)`` is true (the caller
        also needs something of its own there, such as a recurrent state). ``length`` 0 (no
        pages) when there is none. A pool without sub-pools serves any boundary ``usable``
        accepts (with no pages); without ``usable`` it serves none.
        """
        own = self._check_hashes(hashes)
        if usable is None and not self._pages:
            usable = _nothing
        tokens = own.num_tokens
        self._queries += 1
        self._query_tokens += tokens
        step = self._step
        miss = PrefixHit(length=0, pages={}, blocks={})
        if not step or tokens < 2:
            return miss
        longest = min((tokens - 1) // step, own.complete_tokens // step) * step
        # present[s][j]: blocks of sub-pool s among its first j that a page holds now.
        present: list[list[int]] = []
        for sub in self._pages:
            cached = sub.allocator.cached_page
            running = [0]
            for j in range(longest // sub.page_size):
                held = cached(own.page_hash(j, sub.page_size)) is not None
                running.append(running[-1] + held)
            present.append(running)
        for length in range(longest, 0, -step):
            needed = [self._needed(sub, length) for sub in self._pages]
            if (usable is None or usable(length)) and all(
                counts[r.stop] - counts[r.start] == len(r)
                for counts, r in zip(present, needed, strict=True)
            ):
                pages: dict[str, tuple[int, ...]] = {}
                blocks: dict[str, tuple[bytes, ...]] = {}
                for sub, r in zip(self._pages, needed, strict=True):
                    wanted = tuple(own.page_hash(j, sub.page_size) for j in r)
                    found = [sub.allocator.cached_page(b) for b in wanted]
                    pages[sub.name] = tuple(p for p in found if p is not None)
                    blocks[sub.name] = wanted
                return PrefixHit(length=length, pages=pages, blocks=blocks)
        return miss

    def holds_prefix(self, hashes: TokenHashes, length: int) -> bool:
        """Whether every sub-pool holds the page that ends at ``length`` tokens of ``hashes``.

        ``length`` is a positive multiple of :attr:`boundary` within the hashed blocks
        (``RequestStateError`` otherwise). A block another copy of the same text registered
        first is held only while that copy is: what is kept under a prefix's hash (a state
        snapshot) is kept only where this is true, so the eviction listener drops it in time.
        A pool without sub-pools holds every prefix (it keeps no pages to lose).
        """
        own = self._check_hashes(hashes)
        length = check_int(length, "length", minimum=1)
        if length % self._step or length > own.complete_tokens:
            raise RequestStateError(
                f"no prefix of {length} tokens to look up: prefixes end at multiples of "
                f"{self._step} up to {own.complete_tokens // self._step * self._step}"
            )
        return all(
            sub.allocator.cached_page(own.page_hash(length // sub.page_size - 1, sub.page_size))
            is not None
            for sub in self._pages
        )

    @staticmethod
    def _needed(sub: SubPoolPages, length: int) -> range:
        """The logical pages a request of ``length`` cached tokens needs (lifetime rule)."""
        return range(sub.lifetime.first_live_page(length, sub.page_size), length // sub.page_size)

    def reuse_prefix(self, request_id: int, hit: PrefixHit) -> None:
        """Start the new, empty request at ``hit.length`` tokens, sharing ``hit``'s pages.

        Each page gains one owner (no copy) and the request's length becomes ``hit.length``;
        prefill goes on from there. A request that already holds tokens is refused
        (``RequestStateError``); a hit whose pages no longer hold their blocks (evicted
        since :meth:`match_prefix`), or that is not a hit of this pool's shape, raises
        ``CacheStateError``. Nothing changes on any error; an empty hit changes nothing.
        """
        length = self._lengths.get(request_id)
        if length is None:
            raise RequestStateError(f"cannot reuse a prefix for unknown request {request_id!r}")
        if length:
            raise RequestStateError(
                f"request {request_id} already holds {length} tokens; a prefix is reused by a "
                "new request only"
            )
        if not isinstance(hit, PrefixHit):
            raise RequestStateError(f"reuse_prefix takes a PrefixHit, got {hit!r}")
        if not hit:
            return
        if hit.length % self._step or set(hit.pages) != {s.name for s in self._pages}:
            raise CacheStateError(
                f"this pool cannot serve a prefix hit of {hit.length} tokens over sub-pools "
                f"{sorted(hit.pages)}; reuse what its match_prefix returns"
            )
        for sub in self._pages:
            pages, blocks = hit.pages[sub.name], hit.blocks[sub.name]
            if len(pages) != len(self._needed(sub, hit.length)) or any(
                sub.allocator.block_of(page) != block
                for page, block in zip(pages, blocks, strict=True)
            ):
                raise CacheStateError(
                    f"sub-pool {sub.name!r} no longer holds the prefix of {hit.length} tokens "
                    "this hit found (evicted since); match the prefix again"
                )
        for sub in self._pages:
            pages = hit.pages[sub.name]
            sub.allocator.reuse(pages)
            sub.adopt(request_id, self._needed(sub, hit.length).start, pages)
        self._lengths[request_id] = hit.length
        self._registered[request_id] = [hit.length // sub.page_size for sub in self._pages]
        self._hit_tokens += hit.length

    # ------------------------------------------------------------------ the cache's side

    def stats(self) -> PrefixCacheStats:
        """Lookups, reused tokens, cached pages and evictions so far."""
        allocators = [sub.allocator for sub in self._pages]
        return PrefixCacheStats(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            cached_pages=sum(a.num_cached for a in allocators),
            hashed_pages=sum(a.num_hashed for a in allocators),
            evictions=sum(a.evictions_total for a in allocators),
        )

    def drop_cached(self) -> int:
        """Forget every cached block no request holds; returns the pages freed."""
        return sum(sub.allocator.drop_cached() for sub in self._pages)

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(sub_pool, block_hash)`` whenever a sub-pool stops holding a block.

        Evicted for an allocation, dropped, or forgotten because its page is rewritten: after
        the call no :meth:`match_prefix` finds that block in that sub-pool.
        """
        self._listeners.append(listener)

    # ------------------------------------------------------------------ the pool's hooks

    def request_added(self, request_id: int) -> None:
        """A new request holds no pages: nothing registered."""
        self._registered[request_id] = [0] * len(self._pages)

    def request_freed(self, request_id: int) -> None:
        """The request left the pool; its registered pages stay cached."""
        self._registered.pop(request_id, None)

    def before_trim(self, request_id: int, new_len: int) -> None:
        """The request is trimmed to ``new_len`` (the pool checked the trim is allowed).

        A registered page kept in part will be written again from ``new_len`` on, so it no
        longer holds its block; whole pages given back keep theirs (their K/V are intact).
        """
        registered = self._registered[request_id]
        for i, sub in enumerate(self._pages):
            full, partial = divmod(new_len, sub.page_size)
            if registered[i] <= full:
                continue
            if partial:
                page = sub.table(request_id).pages[full]
                if page and sub.allocator.block_of(page) is not None:
                    sub.allocator.forget_hash(page)
            registered[i] = full

    def forked(self, parent_id: int, child_id: int, n_tokens: int) -> None:
        """The child holds the parent's first ``n_tokens`` positions and their blocks."""
        parent = self._registered[parent_id]
        self._registered[child_id] = [
            min(count, n_tokens // sub.page_size)
            for count, sub in zip(parent, self._pages, strict=True)
        ]


def _nothing(length: int) -> bool:
    """No prefix length is usable (a pool without pages keeps nothing of its own)."""
    return False
