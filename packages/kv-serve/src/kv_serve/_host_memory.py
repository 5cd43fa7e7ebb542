"""Giving freed memory back to the operating system, so a server's RSS follows its load."""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable
from functools import cache

__all__ = ["trim_host_memory"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim`` (glibc), or ``None`` where it has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def trim_host_memory() -> bool:
    """Free what is only cached: Python's garbage, MLX's buffer cache, the C heap's free pages.

    Loading a model's tokenizer and weights allocates and frees a few hundred MiB on the C
    heap that the allocator keeps; MLX keeps freed buffers for reuse. Neither is in use, but
    both count in the process's RSS until given back. Returns whether the C heap was trimmed
    (glibc only). Cheap enough for idle moments, not for every step.
    """
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
