"""A paged hybrid KV pool: full and sliding-window sub-pools over a refcounted page allocator."""

from ._allocator import PageAllocator
from ._counter import LayerDoneCounter
from ._pool import HybridKVPool, SubPoolSpec
from ._report import PoolMemoryReport, SubPoolReport

__all__ = [
    "HybridKVPool",
    "LayerDoneCounter",
    "PageAllocator",
    "PoolMemoryReport",
    "SubPoolReport",
    "SubPoolSpec",
]
