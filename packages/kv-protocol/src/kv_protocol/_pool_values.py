"""The values a paged KV pool hands out: a step's reservation, a prefix hit, its reports.

They are plain frozen values so that a scheduler, an engine or a server can read them without
knowing the pool that made them; each pool builds them, the :mod:`._protocols` say when.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import mlx.core as mx

from ._errors import RequestStateError

__all__ = [
    "PoolMemoryReport",
    "PrefixCacheStats",
    "PrefixHit",
    "Reservation",
    "SubPoolReport",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class Reservation:
    """What one successful ``try_reserve_batch`` granted: new positions for a batch of requests.

    Row ``b`` is ``request_ids[b]``; it held ``start_lengths[b]`` positions before and holds
    ``start_lengths[b] + n_tokens[b]`` now, in every sub-pool. Per sub-pool name:

    - ``slots[name]``: the ``(sum(n_tokens),)`` int32 slots of the new positions, row after
      row (row ``b``'s are ``slots[name][row_start(b) : row_start(b) + n_tokens[b]]``); the
      pool issued them, so it trusts them for writes without reading them back;
    - ``page_tables[name]``: the ``(B, max_pages)`` int32 logical page tables of the batch
      after the reservation (unheld and padding entries are page 0); empty when the caller
      asked for none (a prefill chunk does not read them).

    A one-token-per-request reservation (a decode step) has ``slots[name]`` of shape ``(B,)``:
    the step's new-token slots as they are. Undo it with the pool's ``rollback``.
    """

    request_ids: tuple[int, ...]
    start_lengths: tuple[int, ...]
    n_tokens: tuple[int, ...]
    slots: Mapping[str, mx.array]
    page_tables: Mapping[str, mx.array]

    def __post_init__(self) -> None:
        rows = len(self.request_ids)
        if len(self.start_lengths) != rows or len(self.n_tokens) != rows:
            raise RequestStateError(
                f"a Reservation needs one start length and one token count per request: "
                f"{rows} requests, {len(self.start_lengths)} lengths, {len(self.n_tokens)} counts"
            )
        object.__setattr__(self, "slots", MappingProxyType(dict(self.slots)))
        object.__setattr__(self, "page_tables", MappingProxyType(dict(self.page_tables)))

    @property
    def batch_size(self) -> int:
        """Requests in the reservation."""
        return len(self.request_ids)

    @property
    def total_tokens(self) -> int:
        """New positions over every request."""
        return sum(self.n_tokens)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each request's reserved length after the reservation."""
        return tuple(s + n for s, n in zip(self.start_lengths, self.n_tokens, strict=True))

    def row_start(self, row: int) -> int:
        """Index in ``slots[name]`` of row ``row``'s first new slot."""
        return sum(self.n_tokens[:row])


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefixHit:
    """A cached prefix a new request can start from, as ``match_prefix`` found it.

    ``length`` tokens (a page boundary of every sub-pool; 0: no hit) whose K/V the pages
    ``pages[name]`` hold in each sub-pool, the ones a request of that length needs under the
    sub-pool's lifetime (every page of a full sub-pool, the trailing window's of a sliding
    one), paired with the block hashes ``blocks[name]`` they were found under. Hand it to
    ``reuse_prefix``, which checks that each page still holds its block (an allocation in
    between may have evicted it).
    """

    length: int
    pages: Mapping[str, tuple[int, ...]]
    blocks: Mapping[str, tuple[bytes, ...]]

    def __post_init__(self) -> None:
        if set(self.pages) != set(self.blocks) or any(
            len(self.pages[name]) != len(self.blocks[name]) for name in self.pages
        ):
            raise RequestStateError("a PrefixHit needs one block hash per page, in every sub-pool")
        object.__setattr__(self, "pages", MappingProxyType(dict(self.pages)))
        object.__setattr__(self, "blocks", MappingProxyType(dict(self.blocks)))

    def __bool__(self) -> bool:
        return self.length > 0


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


@dataclass(frozen=True, kw_only=True)
class SubPoolReport:
    """Pages and bytes of one sub-pool. Byte counts cover K and V of every layer it stores.

    ``kv_bits`` is the width of its quantized pages (``None``: the model's dtype); bytes are
    what the pages store, quantized data with its scales and biases. ``pages_committed`` is
    how many pages its buffers hold now when they grow with use (``None``: all
    ``num_pages``, preallocated).
    """

    name: str
    kind: str
    window: int | None
    layer_ids: tuple[int, ...]
    page_size: int
    num_pages: int
    pages_used: int
    pages_free: int
    bytes_per_page: int
    kv_bits: int | None = None
    pages_committed: int | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes of the sub-pool's buffers at their cap, null page included."""
        return self.num_pages * self.bytes_per_page

    @property
    def bytes_committed(self) -> int:
        """Bytes its buffers hold now (the cap when preallocated), null page included."""
        pages = self.num_pages if self.pages_committed is None else self.pages_committed
        return pages * self.bytes_per_page

    @property
    def bytes_used(self) -> int:
        """Bytes of the pages held by requests."""
        return self.pages_used * self.bytes_per_page

    @property
    def bytes_free(self) -> int:
        """Bytes of the pages that can still be allocated."""
        return self.pages_free * self.bytes_per_page


@dataclass(frozen=True, kw_only=True)
class PoolMemoryReport:
    """What a paged KV pool holds now, and what storing every layer in full would cost.

    ``full_equivalent_bytes`` is what the live requests would occupy if every attention layer
    kept its whole context (``sum(seq_len) * layout.full_kv_bytes_per_token()``, at token
    granularity, i.e. an ideal unpaged full-KV store). ``full_capacity_tokens`` is how many
    tokens of full context the pool can hold (the smallest FULL sub-pool's usable slots, or
    ``None`` without FULL layers) and ``full_equivalent_capacity_bytes`` the bytes a pool that
    stores every attention layer in full would need for that capacity. ``prefix_cache`` is
    the prefix cache's statistics (``None`` when the pool caches no prefixes).
    """

    sub_pools: tuple[SubPoolReport, ...]
    num_requests: int
    tokens: int
    full_kv_bytes_per_token: int
    full_capacity_tokens: int | None
    prefix_cache: PrefixCacheStats | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes of every sub-pool's buffers."""
        return sum(s.bytes_total for s in self.sub_pools)

    @property
    def bytes_committed(self) -> int:
        """Bytes every sub-pool's buffers hold now (below ``bytes_total`` while they grow)."""
        return sum(s.bytes_committed for s in self.sub_pools)

    @property
    def bytes_used(self) -> int:
        """Bytes of every page held by a request."""
        return sum(s.bytes_used for s in self.sub_pools)

    @property
    def bytes_free(self) -> int:
        """Bytes of every page that can still be allocated."""
        return sum(s.bytes_free for s in self.sub_pools)

    @property
    def pages_used(self) -> dict[str, int]:
        """Pages held per sub-pool name."""
        return {s.name: s.pages_used for s in self.sub_pools}

    @property
    def full_equivalent_bytes(self) -> int:
        """Bytes the live requests would need with every attention layer stored in full."""
        return self.tokens * self.full_kv_bytes_per_token

    @property
    def saving_bytes(self) -> int:
        """``full_equivalent_bytes - bytes_used`` (negative for tiny requests, page rounding)."""
        return self.full_equivalent_bytes - self.bytes_used

    @property
    def used_fraction_of_full(self) -> float | None:
        """``bytes_used / full_equivalent_bytes``, or ``None`` while no token is held."""
        full = self.full_equivalent_bytes
        return self.bytes_used / full if full else None

    @property
    def full_equivalent_capacity_bytes(self) -> int | None:
        """Bytes a pool storing every layer in full would need for ``full_capacity_tokens``."""
        if self.full_capacity_tokens is None:
            return None
        return self.full_capacity_tokens * self.full_kv_bytes_per_token

    def format(self) -> str:
        """A human-readable table of the report."""
        mib = 1024 * 1024
        lines = [
            f"{'sub-pool':<24s} {'page':>5s} {'pages used/free/total':>24s} "
            f"{'MiB used':>10s} {'MiB total':>10s}"
        ]
        for s in self.sub_pools:
            pages = f"{s.pages_used}/{s.pages_free}/{s.num_pages}"
            lines.append(
                f"{s.name:<24s} {s.page_size:>5d} {pages:>24s} "
                f"{s.bytes_used / mib:>10.2f} {s.bytes_total / mib:>10.2f}"
            )
        lines.append(
            f"requests {self.num_requests}, tokens {self.tokens}; used "
            f"{self.bytes_used / mib:.2f} MiB vs {self.full_equivalent_bytes / mib:.2f} MiB "
            "with every attention layer in full"
        )
        return "\n".join(lines)
