"""Read-only views into a :class:`HybridKVPool`'s internals, for tests and debugging.

Not part of the package's public face: a pool is driven through its methods; these read what
its sub-pools hold (page tables, allocators) without changing anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kv_protocol import RequestStateError, ShapeMismatchError

from ._allocator import PageAllocator
from ._page_tables import SubPoolPages
from ._pool import HybridKVPool
from ._storage import KVStorage, int32_array

__all__ = [
    "allocator",
    "batch_page_table",
    "batch_slots",
    "held_pages",
    "num_free_pages",
    "page_table",
    "request_ids",
    "storage",
    "sub_pool_names",
    "sub_pool_pages",
]


def sub_pool_pages(pool: HybridKVPool, sub_pool: str) -> SubPoolPages:
    """The page tables of the named sub-pool."""
    return pool._pages[pool._pool_index(sub_pool)]


def allocator(pool: HybridKVPool, sub_pool: str) -> PageAllocator:
    """The page allocator of the named sub-pool."""
    return sub_pool_pages(pool, sub_pool).allocator


def storage(pool: HybridKVPool) -> KVStorage:
    """The pool's buffers and slot checks."""
    return pool._storage


def sub_pool_names(pool: HybridKVPool) -> tuple[str, ...]:
    """Every sub-pool's name, in order."""
    return tuple(spec.name for spec in pool.sub_pools)


def request_ids(pool: HybridKVPool) -> tuple[int, ...]:
    """Ids of the registered requests, in registration order."""
    return tuple(pool._lengths)


def num_free_pages(pool: HybridKVPool, sub_pool: str) -> int:
    """Pages of the sub-pool that can be allocated now."""
    return allocator(pool, sub_pool).num_free


def held_pages(pool: HybridKVPool, request_id: int, sub_pool: str) -> list[int]:
    """Physical pages the request holds in the sub-pool, in logical order."""
    pool.seq_len(request_id)
    return sub_pool_pages(pool, sub_pool).table(int(request_id)).held()


def page_table(pool: HybridKVPool, request_id: int, sub_pool: str) -> mx.array:
    """``(n_pages,)`` int32 logical page table of one request; released entries are 0."""
    pool.seq_len(request_id)
    table = sub_pool_pages(pool, sub_pool).table(int(request_id))
    if not table.pages:
        return mx.zeros((0,), dtype=mx.int32)
    return int32_array(table.pages)


def batch_page_table(pool: HybridKVPool, request_ids: Sequence[int], sub_pool: str) -> mx.array:
    """``(B, max_pages)`` int32 logical page tables, padded and unheld entries = page 0."""
    for r in request_ids:
        pool.seq_len(r)
    return pool._page_tables(sub_pool_pages(pool, sub_pool), [int(r) for r in request_ids])


def batch_slots(
    pool: HybridKVPool, request_ids: Sequence[int], sub_pool: str, positions: Sequence[int]
) -> mx.array:
    """``(B,)`` int32 slots of ``positions[b]`` of each request ``b``, issued for writes.

    Two requests sharing a page can name one slot: such an array is not issued (reads only).
    """
    index = pool._pool_index(sub_pool)
    ids, where = list(request_ids), list(positions)
    if len(ids) != len(where):
        raise ShapeMismatchError(
            f"batch_slots got {len(ids)} request ids but {len(where)} positions"
        )
    pages = pool._pages[index]
    slots: list[int] = []
    held: list[int] = []
    for request_id, pos in zip(ids, where, strict=True):
        if not isinstance(request_id, int):
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        pool.seq_len(request_id)
        pool._check_position(request_id, index, pos)
        slot, page = pages.slot(request_id, pos)
        held.append(page)
        slots.append(slot)
    out = mx.array(slots, dtype=mx.int32)
    return pool._storage.issue(out, index, held) if len(set(slots)) == len(slots) else out
