"""The typed contracts between the kv-* packages.

Whatever one package hands another goes through one of these protocols, so that each package
can be swapped or tested alone. Shapes follow mlx-lm: per-request caches hold
``(B, n_kv_heads, S, head_dim)``; pools are *slot addressed* and *head major*: a layer's key
buffer is ``(n_kv_heads, num_pages * page_size, head_dim)`` and token slot
``page * page_size + offset_in_page`` is column ``slot`` of it. Page 0 of every sub-pool is a
reserved null page: padding entries of page tables point to it and it is never allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import mlx.core as mx

from ._layout import CacheLayout
from ._pool_values import PoolMemoryReport, PrefixCacheStats, PrefixHit, Reservation
from ._quantized_kv import KVBuffer, KVQuantization

__all__ = [
    "DecodeKVCache",
    "KVBufferStorage",
    "KVCache",
    "KVPageAddressing",
    "KVPool",
    "KVPoolStats",
    "KVPrefixCache",
    "KVRequestBookkeeping",
    "KVRequestForking",
    "LayerTransferCounter",
    "MaskSpec",
    "OffsetCache",
    "PageAllocator",
    "TokenHashes",
]

#: What ``make_mask`` returns: no mask, mlx's fused causal mask, or a boolean keep-mask.
MaskSpec = mx.array | Literal["causal"] | None


@runtime_checkable
class OffsetCache(Protocol):
    """The part of mlx-lm's cache protocol a model container needs to build its masks."""

    @property
    def offset(self) -> Any:
        """Absolute number of tokens processed so far (an ``int`` for a single request)."""
        ...

    @property
    def state(self) -> Any:
        """Everything needed to rebuild the cache (arrays), safe to hand to ``mx.eval``."""
        ...

    def make_mask(
        self, N: int, *, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The attention mask for ``N`` new queries at the current offset.

        ``return_array`` and ``window_size`` are keyword-only here because mlx-lm's own
        caches order them differently; mlx-lm's mask helpers pass them by keyword.
        """
        ...


@runtime_checkable
class KVCache(OffsetCache, Protocol):
    """mlx-lm's per-request, per-layer KV cache protocol (mlx-lm >= 0.32)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new ``(B, H, L, D)`` keys/values; return the keys/values attention sees now."""
        ...

    def is_trimmable(self) -> bool:
        """True if ``trim`` can move the cache back."""
        ...

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (speculative decoding); returns the number dropped."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the cache's arrays occupy."""
        ...

    def empty(self) -> bool:
        """True while the cache holds no data."""
        ...


@runtime_checkable
class DecodeKVCache(OffsetCache, Protocol):
    """A per-request cache with the single-token decode path used by batched decode."""

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """Append one token's ``(1, H, 1, D)`` key and value and advance ``offset`` by one."""
        ...

    def get_kv(self, window: int | None = None) -> tuple[mx.array, mx.array]:
        """The ``(1, H, S, D)`` keys/values held, limited to the trailing ``window`` if given."""
        ...


@runtime_checkable
class PageAllocator(Protocol):
    """A refcounted allocator of fixed-size pages with a reserved null page 0."""

    @property
    def num_pages(self) -> int:
        """Pages managed, the null page included."""
        ...

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now."""
        ...

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages atomically (all or none) with refcount 1 each."""
        ...

    def incref(self, pages: Sequence[int]) -> None:
        """Add one owner to each allocated page (prefix sharing)."""
        ...

    def free(self, pages: Sequence[int]) -> None:
        """Drop one owner of each page; a page returns to the free list at refcount 0.

        Freeing a page that is free already or that this allocator does not own raises and
        changes nothing.
        """
        ...

    def refcount(self, page: int) -> int:
        """Current owner count of ``page`` (0 when free)."""
        ...


@runtime_checkable
class LayerTransferCounter(Protocol):
    """A layer-wise transfer hook: KV arrives layer by layer while the model computes."""

    def wait_until(self, layer_id: int) -> None:
        """Block until the transfer of global layer ``layer_id`` is complete."""
        ...


@runtime_checkable
class KVRequestBookkeeping(Protocol):
    """The part of a paged KV pool a scheduler needs: requests, lengths, reservations, rollback.

    Requests are ``int`` ids reserving token positions ``0 .. seq_len - 1`` in every sub-pool.
    A scheduler makes one :meth:`try_reserve_batch` per step for everything the step will
    write, and is the one caller of :meth:`rollback` when the step fails; it never reads the
    arrays of the :class:`Reservation` (the decode step and the prefill caches do).
    """

    @property
    def layout(self) -> CacheLayout:
        """The layout the pool was built for."""
        ...

    def add_request(self, request_id: int) -> None:
        """Register a new request holding no tokens."""
        ...

    def free_request(self, request_id: int) -> None:
        """Release every page of the request and forget it."""
        ...

    def has_request(self, request_id: int) -> bool:
        """True while ``request_id`` is registered."""
        ...

    def seq_len(self, request_id: int) -> int:
        """Token positions reserved so far for the request."""
        ...

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        """Give back the request's last ``n_tokens`` reserved positions.

        Trimming back to the length a reservation started from always succeeds and undoes
        its new pages; a trim that would need positions a sliding sub-pool released raises
        ``CacheStateError`` and changes nothing.
        """
        ...

    def try_reserve_batch(
        self,
        demands: Mapping[int, int],
        *,
        headroom: Mapping[int, int] | None = None,
        page_tables: bool = True,
    ) -> Reservation | None:
        """Reserve ``demands[request_id]`` more positions for each request, or nothing.

        One atomic decision over every request and every sub-pool: either all of them get
        their pages (sliding sub-pools first release the pages no new query can see, and
        what one request releases is room for the others) and the :class:`Reservation`
        (rows in ``demands``' order) is returned, or ``None`` is returned and nothing
        changed. With ``headroom`` (requests not in ``demands``), ``None`` also when those
        requests could not then reserve their ``headroom`` positions together afterwards
        (they are not reserved). ``page_tables=False`` leaves the reservation's page tables
        empty. An unknown or repeated id, or a bad count, raises (``UnknownRequestError``,
        ``RequestStateError``) and changes nothing.
        """
        ...

    def rollback(self, reservation: Reservation) -> None:
        """Undo ``reservation``: each request still registered goes back to its start length.

        Always succeeds for a reservation that was the last one of its requests; requests
        freed since are skipped.
        """
        ...


@runtime_checkable
class KVPageAddressing(KVRequestBookkeeping, Protocol):
    """Reservations and their addresses: slots and page tables per sub-pool.

    Sliding sub-pools may release pages whose tokens have left every window, so a slot query
    for such a position fails. Every method taking a ``layer_id`` takes the model's global
    layer id and translates it through the layout, failing with the layout's error for a layer
    of the wrong kind.
    """

    def reserve(self, request_id: int, n_tokens: int) -> Reservation:
        """Reserve ``n_tokens`` more positions for one request, atomically over all sub-pools.

        :meth:`try_reserve_batch` for one request (page tables left empty) that raises
        ``PoolExhaustedError`` (the sub-pool, pages asked, pages available) on shortage
        instead of returning ``None``; nothing changes then.
        """
        ...

    def sub_pool_of(self, layer_id: int) -> str:
        """Name of the sub-pool that stores ``layer_id``."""
        ...

    def page_size(self, layer_id: int) -> int:
        """Tokens per page in the sub-pool of ``layer_id``."""
        ...

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        """int32 slots of token positions ``start .. stop - 1`` of the request for that layer."""
        ...


@runtime_checkable
class KVRequestForking(Protocol):
    """A pool that can start a request as a copy of another's first positions."""

    def fork_request(self, parent_id: int, child_id: int, n_tokens: int) -> None:
        """Register ``child_id`` holding the parent's first ``n_tokens`` positions.

        Whole pages are shared (no copy); a partial last page is copied for the child.
        Atomic: on any error (``PoolExhaustedError`` for the copy's page included) nothing
        changes.
        """
        ...


@runtime_checkable
class KVBufferStorage(Protocol):
    """The tensors of a paged KV pool: each attention layer's K/V buffers, by slot."""

    def get_key_buffer(self, layer_id: int) -> KVBuffer:
        """The layer's key buffer ``(n_kv_heads, num_slots, head_dim)``.

        A plain array, or a :class:`QuantizedKV` of that logical shape where the layer's
        sub-pool stores quantized pages (read it with :func:`gather_slots`).
        """
        ...

    def get_value_buffer(self, layer_id: int) -> KVBuffer:
        """The layer's value buffer ``(n_kv_heads, num_slots, head_dim)`` (as the keys)."""
        ...

    def kv_quantization(self, layer_id: int) -> KVQuantization | None:
        """How the layer's pages are quantized, or ``None`` when they hold the model's dtype."""
        ...

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        """Rebind the layer's buffers to arrays a kernel produced (same shape and dtype).

        Only for plain (unquantized) buffers.
        """
        ...

    def set_kv(self, layer_id: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Write token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``."""
        ...

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``."""
        ...


@runtime_checkable
class TokenHashes(Protocol):
    """One request's chained block hashes, made by a prefix cache and kept by the request.

    Computed once per token: :meth:`extend` hashes only what completes a new block, so a
    request's hashes grow with its text and are never recomputed for a lookup or a commit.
    """

    @property
    def num_tokens(self) -> int:
        """Tokens hashed so far (the last, incomplete block's included)."""
        ...

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the hashed text."""
        ...

    def copy(self) -> TokenHashes:
        """Independent hashes of the same text (for a sequence forked from this one)."""
        ...

    def prefix_hash(self, length: int) -> bytes:
        """The hash standing for the first ``length`` tokens (a block boundary).

        Equal hashes mean equal prefixes: what is kept for a prefix (its pages, a recurrent
        state snapshot) is registered under this key.
        """
        ...

    def truncate(self, length: int, text: Sequence[int]) -> None:
        """Keep the first ``length`` tokens only; ``text`` is the hashed text (at least them).

        Complete blocks are kept, not hashed again; the tokens of the last, incomplete block
        are taken from ``text``.
        """
        ...


@runtime_checkable
class KVPrefixCache(Protocol):
    """Complete pages kept for reuse by later requests with the same prefix.

    A request's hashes come from :meth:`hash_tokens` and stay with the request; the pool keeps
    no copy of its tokens. :meth:`commit` registers the pages its written tokens completed,
    :meth:`match_prefix` looks up a new request's longest cached prefix and
    :meth:`reuse_prefix` starts the request there.
    """

    def hash_tokens(self, tokens: Sequence[int]) -> TokenHashes:
        """New hashes of ``tokens`` (the text a request will write from position 0)."""
        ...

    def commit(self, request_id: int, hashes: TokenHashes, length: int) -> None:
        """The request's positions ``0 .. length - 1`` hold the K/V of ``hashes``' first tokens.

        Every page they complete is registered under its block hash, so a later request with
        the same prefix can reuse it; once no request holds it, it stays cached until an
        allocation evicts it.
        """
        ...

    @property
    def boundary(self) -> int:
        """Tokens a reusable prefix's length is a multiple of (a page of every sub-pool)."""
        ...

    def match_prefix(
        self, hashes: TokenHashes, *, usable: Callable[[int], bool] | None = None
    ) -> PrefixHit:
        """The longest cached prefix of the hashed text (below its length) a request can reuse.

        With ``usable``, only prefix lengths for which ``usable(length)`` is true count (the
        caller holds something else a hit needs at that length, such as a recurrent state).
        """
        ...

    def reuse_prefix(self, request_id: int, hit: PrefixHit) -> None:
        """Start the new, empty request at ``hit.length`` tokens, sharing ``hit``'s pages."""
        ...

    def holds_prefix(self, hashes: TokenHashes, length: int) -> bool:
        """Whether every sub-pool holds the page ending at ``length`` tokens of the text.

        Whatever a caller keeps under that prefix's hash is dropped by the eviction listener
        only if this is true when it is kept (another request's copy of the same block may
        be the one registered, and may be gone already).
        """
        ...

    def stats(self) -> PrefixCacheStats:
        """Lookups, reused tokens, cached pages and evictions so far."""
        ...

    def add_eviction_listener(self, listener: Callable[[str, bytes], None]) -> None:
        """Call ``listener(sub_pool, block_hash)`` whenever a sub-pool stops holding a block."""
        ...


@runtime_checkable
class KVPoolStats(Protocol):
    """What a pool reports about itself: pages and bytes per sub-pool, prefix caching."""

    def memory_report(self) -> PoolMemoryReport:
        """Bytes and pages used and free per sub-pool now (and the prefix cache's stats)."""
        ...


@runtime_checkable
class KVPoolMemory(Protocol):
    """A pool whose buffers grow with use and can give memory back (optional for a pool)."""

    def shrink(self, *, drop_cached: bool = False) -> int:
        """Cut the buffers back to what the pages in use need; return the bytes given back.

        Cached prefix pages count as needed unless ``drop_cached``; a preallocated pool
        gives back 0.
        """
        ...


@runtime_checkable
class KVPool(KVPageAddressing, KVBufferStorage, KVPoolStats, Protocol):
    """A paged KV pool with one sub-pool per (lifetime, geometry) group of attention layers.

    Bookkeeping (:class:`KVRequestBookkeeping`), addressing (:class:`KVPageAddressing`),
    storage (:class:`KVBufferStorage`) and reports (:class:`KVPoolStats`) together, and
    optionally a prefix cache. Requests are ``int`` ids. A request *reserves* token
    positions ``0 .. seq_len - 1``; sliding sub-pools may release pages whose tokens have
    left every window, so a slot query for such a position fails. Every method taking a
    ``layer_id`` takes the model's global layer id and translates it through the layout,
    failing with the layout's error for a layer of the wrong kind.
    """

    @property
    def prefix_cache(self) -> KVPrefixCache | None:
        """The pool's prefix cache, or ``None`` when it keeps no prefixes."""
        ...
