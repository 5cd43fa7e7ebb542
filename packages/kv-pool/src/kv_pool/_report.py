"""Memory reports of a hybrid KV pool."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolMemoryReport", "SubPoolReport"]


@dataclass(frozen=True, kw_only=True)
class SubPoolReport:
    """Pages and bytes of one sub-pool. Byte counts cover K and V of every layer it stores.

    ``kv_bits`` is the width of its quantized pages (``None``: the model's dtype); bytes are
    what the pages store, quantized data with its scales and biases.
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

    @property
    def bytes_total(self) -> int:
        """Bytes of the sub-pool's buffers, null page included."""
        return self.num_pages * self.bytes_per_page

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
    """What a :class:`~kv_pool.HybridKVPool` holds now, and what storing every layer in full costs.

    ``full_equivalent_bytes`` is what the live requests would occupy if every attention layer
    kept its whole context (``sum(seq_len) * layout.full_kv_bytes_per_token()``, at token
    granularity, i.e. an ideal unpaged full-KV store). ``full_capacity_tokens`` is how many
    tokens of full context the pool can hold (the smallest FULL sub-pool's usable slots, or
    ``None`` without FULL layers) and ``full_equivalent_capacity_bytes`` the bytes a pool that
    stores every attention layer in full would need for that capacity.
    """

    sub_pools: tuple[SubPoolReport, ...]
    num_requests: int
    tokens: int
    full_kv_bytes_per_token: int
    full_capacity_tokens: int | None

    @property
    def bytes_total(self) -> int:
        """Bytes of every sub-pool's buffers."""
        return sum(s.bytes_total for s in self.sub_pools)

    @property
    def bytes_used(self) -> int:
        """Bytes of every page held by a request."""
        return sum(s.bytes_used for s in self.sub_pools)

    @property
    def bytes_free(self) -> int:
        """Bytes of every page that can still be allocated."""
        return sum(s.bytes_free for s in self.sub_pools)

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
