"""A per-request KV cache holding every token in one preallocated, growing buffer."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, LayoutError, MaskSpec

from ._checks import check_kv, check_positive, check_trim
from ._masks import make_attention_mask

__all__ = ["ContiguousAttentionKVCache"]

_NAME = "ContiguousAttentionKVCache"


class ContiguousAttentionKVCache:
    """Every token of one request and layer in a ``(B, H, capacity, D)`` buffer pair.

    Given ``n_kv_heads`` and ``head_dim`` the buffers ``(1, n_kv_heads, max_seq_len,
    head_dim)`` are allocated at construction (``dtype`` defaults to float32); otherwise they
    are allocated on the first write with that write's batch, heads, head dims and dtype
    (``dtype``, when given, is then required of every write). New tokens are written by slice
    assignment. Past the capacity the buffers are replaced by new ones of at least twice the
    size: a fresh allocation and a copy, never an in-place change of an array a pending lazy
    graph still reads, and O(log n) reallocations for n tokens (``allocations`` counts them).
    """

    def __init__(
        self,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        max_seq_len: int = 4096,
        dtype: mx.Dtype | None = None,
    ) -> None:
        self._max_seq_len = check_positive("max_seq_len", max_seq_len)
        if (n_kv_heads is None) != (head_dim is None):
            raise LayoutError(
                f"{_NAME}: give both n_kv_heads and head_dim (eager allocation) or neither "
                f"(lazy allocation); got n_kv_heads={n_kv_heads!r}, head_dim={head_dim!r}"
            )
        if dtype is not None and not isinstance(dtype, mx.Dtype):
            raise LayoutError(f"{_NAME}: dtype must be an mlx dtype or None, got {dtype!r}")
        self._dtype = dtype
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._offset = 0
        self._allocations = 0
        self._geometry: tuple[int, int, int, int] | None = None
        # Set for an eager cache: the geometry every write (and every new state) must have.
        self._fixed_geometry: tuple[int, int, int, int] | None = None
        self._fixed_dtype = dtype
        if n_kv_heads is not None and head_dim is not None:
            heads = check_positive("n_kv_heads", n_kv_heads)
            dim = check_positive("head_dim", head_dim)
            self._dtype = self._fixed_dtype = dtype if dtype is not None else mx.float32
            self._geometry = self._fixed_geometry = (1, heads, dim, dim)
            self._allocate(self._max_seq_len)

    def __repr__(self) -> str:
        return (
            f"{_NAME}(offset={self._offset}, capacity={self.capacity}, "
            f"geometry={self._geometry}, dtype={self._dtype})"
        )

    # -- storage ---------------------------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        """Bind fresh zero buffers of ``capacity`` tokens holding a copy of ``[:offset]``."""
        assert self._geometry is not None and self._dtype is not None
        batch, heads, k_dim, v_dim = self._geometry
        new_k = mx.zeros((batch, heads, capacity, k_dim), dtype=self._dtype)
        new_v = mx.zeros((batch, heads, capacity, v_dim), dtype=self._dtype)
        if self._keys is not None and self._values is not None and self._offset:
            # A new graph node: arrays built from the old buffers keep reading them.
            new_k[:, :, : self._offset, :] = self._keys[:, :, : self._offset, :]
            new_v[:, :, : self._offset, :] = self._values[:, :, : self._offset, :]
        self._keys, self._values = new_k, new_v
        self._allocations += 1

    def _write(self, keys: mx.array, values: mx.array, *, single_token: bool) -> None:
        keys, values = check_kv(
            _NAME,
            keys,
            values,
            expect=self._geometry,
            dtype=self._dtype,
            single_token=single_token,
        )
        n_new = keys.shape[2]
        if self._keys is None:
            self._geometry = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            self._dtype = keys.dtype
            self._allocate(max(self._max_seq_len, self._offset + n_new))
        elif self._offset + n_new > self.capacity:
            self._allocate(max(2 * self.capacity, self._offset + n_new))
        assert self._keys is not None and self._values is not None
        stop = self._offset + n_new
        self._keys[:, :, self._offset : stop, :] = keys
        self._values[:, :, self._offset : stop, :] = values
        self._offset = stop

    def _held(self) -> tuple[mx.array, mx.array]:
        if self._keys is None or self._values is None:
            raise CacheStateError(f"{_NAME} holds no data yet: nothing has been written")
        if self._offset == self._keys.shape[2]:
            return self._keys, self._values
        return self._keys[:, :, : self._offset, :], self._values[:, :, : self._offset, :]

    # -- mlx-lm cache protocol -------------------------------------------------------------

    @property
    def offset(self) -> int:
        """Tokens held (the absolute position of the next token)."""
        return self._offset

    @property
    def capacity(self) -> int:
        """Tokens the current buffers can hold before they grow (0 before allocation)."""
        return 0 if self._keys is None else int(self._keys.shape[2])

    @property
    def allocations(self) -> int:
        """How many times buffers were allocated (the first allocation included)."""
        return self._allocations

    @property
    def max_seq_len(self) -> int:
        """The initial capacity."""
        return self._max_seq_len

    @property
    def dtype(self) -> mx.Dtype | None:
        """The storage dtype (``None`` while lazy and unpinned)."""
        return self._dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, H, S, D)`` keys/values; return every token held, ``(B, H, offset, D)``."""
        self._write(keys, values, single_token=False)
        return self._held()

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """Append one token's ``(B, H, 1, D)`` key and value (the decode path)."""
        self._write(keys, values, single_token=True)

    def get_kv(self, window: int | None = None) -> tuple[mx.array, mx.array]:
        """The tokens held, only the trailing ``window`` of them if given."""
        keys, values = self._held()
        if window is None:
            return keys, values
        window = check_positive("window", window)
        start = max(0, self._offset - window)
        return keys[:, :, start:, :], values[:, :, start:, :]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask for ``N`` new queries over all tokens held (as mlx-lm's ``KVCache``)."""
        return make_attention_mask(N, self._offset, return_array, window_size)

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        """``(keys, values)`` of the tokens held; ``()`` before the first write."""
        if self._keys is None:
            return ()
        return self._held()

    @state.setter
    def state(self, value: Any) -> None:
        if not value:
            self.reset()
            return
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise CacheStateError(f"{_NAME}: state must be (keys, values), got {value!r}")
        keys, values = check_kv(
            _NAME, value[0], value[1], expect=self._fixed_geometry, dtype=self._fixed_dtype
        )
        self._keys = self._values = None
        self._offset = 0
        self._geometry, self._dtype = self._fixed_geometry, self._fixed_dtype
        self._write(keys, values, single_token=False)

    def is_trimmable(self) -> bool:
        """True: ``trim`` moves the offset back (speculative decoding)."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (``0 <= n <= offset``); returns ``n``."""
        n = check_trim(_NAME, n, self._offset)
        self._offset -= n
        return n

    def reset(self) -> None:
        """Forget every token; allocated buffers are kept for reuse."""
        self._offset = 0

    def size(self) -> int:
        """Tokens held."""
        return self._offset

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated key and value buffers (capacity, not just the tokens held)."""
        if self._keys is None or self._values is None:
            return 0
        return int(self._keys.nbytes + self._values.nbytes)

    def empty(self) -> bool:
        """True while the cache holds no token."""
        return self._offset == 0
