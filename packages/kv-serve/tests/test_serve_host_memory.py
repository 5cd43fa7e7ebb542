"""``trim_host_memory``: what is only cached goes back to the system."""

from __future__ import annotations

import platform
import sys

import mlx.core as mx

from kv_serve._host_memory import trim_host_memory


def test_trim_empties_mlx_s_buffer_cache_and_trims_the_c_heap_on_glibc() -> None:
    block = mx.ones((1 << 20,))
    mx.eval(block)
    size = block.nbytes
    del block
    assert mx.get_cache_memory() >= size  # MLX kept the freed buffer for reuse
    trimmed = trim_host_memory()
    # The 4 MiB buffer is gone. (Not necessarily every byte: a thread an earlier test left
    # running, a server finishing its shutdown, may free a small array after the trim.)
    assert mx.get_cache_memory() < size
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert trimmed == glibc
    # Nothing in use was touched: MLX still computes.
    assert mx.array([1.0, 2.0]).sum().item() == 3.0
