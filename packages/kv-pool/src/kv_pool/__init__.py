"""A paged hybrid KV pool: full and sliding-window sub-pools over a refcounted page allocator."""

from ._allocator import PageAllocator
from ._counter import LayerDoneCounter
from ._page_tables import ForkPlan, PageTable, ReservePlan, SubPoolPages, block_hashes
from ._pool import HybridKVPool, PrefixCacheStats
from ._report import PoolMemoryReport, SubPoolReport
from ._sizing import (
    MAX_SLOTS_PER_LAYER,
    SubPoolGroup,
    SubPoolSpec,
    budget_page_counts,
    pages_per_request,
    required_bytes,
    sub_pool_groups,
    sub_pool_specs,
)
from ._storage import KVStorage

__all__ = [
    "MAX_SLOTS_PER_LAYER",
    "ForkPlan",
    "HybridKVPool",
    "KVStorage",
    "LayerDoneCounter",
    "PageAllocator",
    "PageTable",
    "PoolMemoryReport",
    "PrefixCacheStats",
    "ReservePlan",
    "SubPoolGroup",
    "SubPoolPages",
    "SubPoolReport",
    "SubPoolSpec",
    "block_hashes",
    "budget_page_counts",
    "pages_per_request",
    "required_bytes",
    "sub_pool_groups",
    "sub_pool_specs",
]
