"""The error hierarchy shared by every kv-* package.

Each concrete error derives from :class:`KVCacheError` *and* from the builtin exception a
caller would naturally catch, so both ``except KVCacheError`` and, say, ``except ValueError``
work.
"""

from __future__ import annotations

__all__ = [
    "CacheStateError",
    "FusedRopeConfigError",
    "InvalidPageError",
    "KVCacheError",
    "KernelUnavailableError",
    "LayerKindError",
    "LayoutError",
    "PoolExhaustedError",
    "RequestStateError",
    "ShapeMismatchError",
    "TransferTimeoutError",
    "UnknownBackendError",
    "UnknownRequestError",
    "UnsupportedModelError",
]


class KVCacheError(Exception):
    """Base class of every error raised by the kv-* packages."""


class LayoutError(KVCacheError, ValueError):
    """A layer specification or a cache layout is malformed (ids, kinds, windows, geometry)."""


class LayerKindError(KVCacheError, ValueError):
    """A layer id was used where a layer of another kind (or an unknown id) was required."""


class ShapeMismatchError(KVCacheError, ValueError):
    """An array has the wrong rank, shape or dtype for the operation it was passed to."""


class UnsupportedModelError(KVCacheError, ValueError):
    """A model's configuration cannot be served correctly, so it is refused up front."""


class CacheStateError(KVCacheError, RuntimeError):
    """A cache was asked for something its current state cannot provide."""


class PoolExhaustedError(KVCacheError, MemoryError):
    """An atomic page reservation could not be granted; nothing was allocated."""

    def __init__(self, *, sub_pool: str, pages_requested: int, pages_free: int) -> None:
        self.sub_pool = sub_pool
        self.pages_requested = pages_requested
        self.pages_free = pages_free
        super().__init__(
            f"sub-pool {sub_pool!r} is exhausted: {pages_requested} pages requested, "
            f"{pages_free} free; nothing was allocated"
        )


class InvalidPageError(KVCacheError, ValueError):
    """A page operation named a page that is free already (double free) or foreign."""


class UnknownRequestError(KVCacheError, KeyError):
    """A request id is not known to the pool or engine."""

    def __str__(self) -> str:
        # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class RequestStateError(KVCacheError, ValueError):
    """A request id is used twice, or a request operation does not fit its state."""


class KernelUnavailableError(KVCacheError, RuntimeError):
    """A kernel backend was requested that this machine or MLX build cannot run."""


class UnknownBackendError(KernelUnavailableError, ValueError):
    """A kernel backend name is not one of the known choices (a bad argument or env value).

    It is a :class:`KernelUnavailableError` (no kernel can be built for that name) and a
    ``ValueError`` (the name itself is wrong), so ``except RuntimeError`` and ``except
    ValueError`` both catch it.
    """


class FusedRopeConfigError(KVCacheError, ValueError):
    """Batched decode enables the fused RoPE + pool-scatter kernel without what it needs.

    The kernel writes K into the full-attention sub-pool, so the decode context must map
    each full layer to its pool index (``full_kv_pool_index_by_layer``).
    """


class TransferTimeoutError(KVCacheError, TimeoutError):
    """Waiting for a layer-wise KV transfer took longer than the allowed timeout."""
