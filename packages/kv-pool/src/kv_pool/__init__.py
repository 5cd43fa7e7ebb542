"""A paged hybrid KV pool: full and sliding-window sub-pools over a refcounted page allocator.

:class:`HybridKVPool` is the pool (``kv_protocol.KVPool``); its prefix cache is a
:class:`PrefixCache` (``kv_protocol.KVPrefixCache``) whose requests keep their own
:class:`BlockHashes`. :func:`required_bytes`, :func:`pages_per_request` and
:func:`sub_pool_groups` size a pool before it is built. The page tables, storage and
allocator internals stay importable from their private modules for tests.
"""

from kv_protocol import PoolMemoryReport, PrefixCacheStats, SubPoolReport

from ._allocator import PageAllocator
from ._counter import LayerDoneCounter
from ._pool import HybridKVPool
from ._prefix import BlockHashes, PrefixCache
from ._sizing import SubPoolSpec, pages_per_request, required_bytes, sub_pool_groups

__all__ = [
    "BlockHashes",
    "HybridKVPool",
    "LayerDoneCounter",
    "PageAllocator",
    "PoolMemoryReport",
    "PrefixCache",
    "PrefixCacheStats",
    "SubPoolReport",
    "SubPoolSpec",
    "pages_per_request",
    "required_bytes",
    "sub_pool_groups",
]
