"""A per-request KV cache holding every token in one preallocated, growing buffer."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, LayoutError

from ._checks import check_kv, check_positive
from ._storage import StorageCache

__all__ = ["ContiguousAttentionKVCache"]

_NAME = "ContiguousAttentionKVCache"


class ContiguousAttentionKVCache(StorageCache[tuple[mx.array, mx.array]]):
    """Every token of one request and layer in a ``(B, H, capacity, D)`` buffer pair.

    Given ``n_kv_heads`` and ``head_dim`` the buffers ``(1, n_kv_heads, max_seq_len,
    head_dim)`` are allocated at construction (``dtype`` defaults to float32); otherwise they
    are allocated on the first write with that write's batch, heads, head dims and dtype
    (``dtype``, when given, is then required of every write). New tokens are written by slice
    assignment. Past the capacity the buffers are replaced by new ones of at least twice the
    size: a fresh allocation and a copy, never an in-place change of an array a pending lazy
    graph still reads, and O(log n) reallocations for n tokens (``allocations`` counts them).
    ``reset`` keeps the allocated buffers for reuse.
    """

    _NAME = _NAME
    _REUSE_BUFFERS_ON_RESET = True

    def __init__(
        self,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        max_seq_len: int = 4096,
        dtype: mx.Dtype | None = None,
    ) -> None:
        capacity = check_positive("max_seq_len", max_seq_len)
        if (n_kv_heads is None) != (head_dim is None):
            raise LayoutError(
                f"{_NAME}: give both n_kv_heads and head_dim (eager allocation) or neither "
                f"(lazy allocation); got n_kv_heads={n_kv_heads!r}, head_dim={head_dim!r}"
            )
        if dtype is not None and not isinstance(dtype, mx.Dtype):
            raise LayoutError(f"{_NAME}: dtype must be an mlx dtype or None, got {dtype!r}")
        if n_kv_heads is None or head_dim is None:
            super().__init__(initial_capacity=capacity, dtype=dtype)
            return
        heads = check_positive("n_kv_heads", n_kv_heads)
        dim = check_positive("head_dim", head_dim)
        super().__init__(
            initial_capacity=capacity,
            geometry=(1, heads, dim, dim),
            dtype=mx.float32 if dtype is None else dtype,
        )
        self._allocate(capacity)

    def __repr__(self) -> str:
        return (
            f"{_NAME}(offset={self._offset}, capacity={self.capacity}, "
            f"geometry={self._geometry}, dtype={self._dtype})"
        )

    @property
    def max_seq_len(self) -> int:
        """The initial capacity."""
        return self._initial_capacity

    @property
    def dtype(self) -> mx.Dtype | None:
        """The storage dtype (``None`` while lazy and unpinned)."""
        return self._dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, H, S, D)`` keys/values; return every token held, ``(B, H, offset, D)``."""
        self._append(keys, values)
        return self._state()

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """Append one token's ``(B, H, 1, D)`` key and value (the decode path)."""
        self._append(keys, values, single_token=True)

    def get_kv(self, window: int | None = None) -> tuple[mx.array, mx.array]:
        """The tokens held, only the trailing ``window`` of them if given."""
        keys, values = self._state()
        if window is None:
            return keys, values
        window = check_positive("window", window)
        start = max(0, self._offset - window)
        return keys[:, :, start:, :], values[:, :, start:, :]

    def _state(self) -> tuple[mx.array, mx.array]:
        keys, values = self._held()
        return keys, values

    def _load_state(self, value: Any) -> None:
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise CacheStateError(f"{_NAME}: state must be (keys, values), got {value!r}")
        keys, values = check_kv(
            _NAME, value[0], value[1], expect=self._fixed_geometry, dtype=self._fixed_dtype
        )
        self._release()
        self._append(keys, values)
