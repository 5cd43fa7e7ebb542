"""The shared core of the caches that keep a request's K/V in buffers of their own."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import mlx.core as mx

from kv_protocol import CacheStateError, MaskSpec

from ._checks import check_kv, check_trim, is_empty_state
from ._masks import make_attention_mask

__all__ = ["Geometry", "StorageCache"]

#: ``(B, n_kv_heads, head_dim_k, head_dim_v)``.
Geometry = tuple[int, int, int, int]

StateT = TypeVar("StateT")


class StorageCache(Generic[StateT]):
    """Buffers ``(B, H, capacity, d)``, an absolute ``offset`` and the rules every store shares.

    The tokens held sit at buffer indices ``[0, fill)`` in temporal order; they are the
    absolute positions ``offset - fill .. offset - 1`` (``fill == offset`` unless a subclass
    drops old tokens). A subclass says which buffers it keeps (``_buffer_layout``), how a chunk
    is encoded into them (``_encode``), when and how far they grow (``_growth``) and what its
    ``state`` is; this class owns the checks, the writes, ``trim``, ``reset``, ``size``,
    ``nbytes`` and ``empty``. Every write checks its input before it changes anything, and
    buffers are only ever replaced by fresh arrays (a copy), never resized in place, so a
    pending lazy graph keeps reading what it read.
    """

    _NAME: ClassVar[str] = "StorageCache"
    #: Whether ``reset`` keeps the allocated buffers (and geometry) for reuse.
    _REUSE_BUFFERS_ON_RESET: ClassVar[bool] = False

    def __init__(
        self,
        *,
        initial_capacity: int,
        geometry: Geometry | None = None,
        dtype: mx.Dtype | None = None,
    ) -> None:
        self._initial_capacity = initial_capacity
        # What every write (and every new state) must match; None: set by the first write.
        self._fixed_geometry = geometry
        self._fixed_dtype = dtype
        self._geometry = geometry
        self._dtype = dtype
        self._buffers: tuple[mx.array, ...] | None = None
        self._offset = 0
        self._fill = 0
        self._allocations = 0

    # -- hooks -----------------------------------------------------------------------------

    def _buffer_layout(self) -> tuple[tuple[int, mx.Dtype], ...]:
        """``(last dim, dtype)`` of each buffer for the current geometry: keys, values."""
        assert self._geometry is not None and self._dtype is not None
        _, _, k_dim, v_dim = self._geometry
        return ((k_dim, self._dtype), (v_dim, self._dtype))

    def _check_new(self, keys: mx.array, values: mx.array) -> None:
        """Further checks of a chunk that passed ``check_kv`` (none by default)."""

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        """The chunk as one array per buffer (the keys and values as they are by default)."""
        return keys, values

    def _growth(self, n_new: int) -> tuple[int, int] | None:
        """``(capacity, tokens to keep)`` of fresh buffers ``n_new`` more tokens need, or None.

        By default the buffers start at the initial capacity (or the chunk) and at least
        double when full, keeping every token held: O(log n) allocations for n tokens.
        """
        needed = self._fill + n_new
        if self._buffers is None:
            return max(self._initial_capacity, needed), 0
        if needed > self.capacity:
            return max(2 * self.capacity, needed), self._fill
        return None

    def _check_trim(self, n: int) -> None:
        """Raise if ``n`` valid tokens cannot be dropped (any can, by default)."""

    def _state(self) -> StateT:
        """The state of a cache that holds buffers."""
        raise NotImplementedError

    def _load_state(self, value: Any) -> None:
        """Check a non-empty ``value`` completely, then replace the contents with it."""
        raise NotImplementedError

    # -- storage ---------------------------------------------------------------------------

    def _release(self) -> None:
        """Drop the buffers and every token; the geometry is what construction fixed."""
        self._buffers = None
        self._geometry, self._dtype = self._fixed_geometry, self._fixed_dtype
        self._offset = self._fill = 0

    def _allocate(self, capacity: int, *, keep: int = 0) -> None:
        """Bind fresh zero buffers of ``capacity`` tokens starting with the last ``keep`` held."""
        assert self._geometry is not None
        batch, heads, _, _ = self._geometry
        fresh = tuple(
            mx.zeros((batch, heads, capacity, dim), dtype=dtype)
            for dim, dtype in self._buffer_layout()
        )
        if self._buffers is not None and keep:
            lo = self._fill - keep
            for new, old in zip(fresh, self._buffers, strict=True):
                # A new graph node: arrays built from the old buffers keep reading them.
                new[:, :, :keep, :] = old[:, :, lo : self._fill, :]
        self._buffers = fresh
        self._fill = keep
        self._allocations += 1

    def _append(self, keys: object, values: object, *, single_token: bool = False) -> int:
        """Check, encode and store a chunk; return the buffer index it starts at."""
        keys, values = check_kv(
            self._NAME,
            keys,
            values,
            expect=self._geometry,
            dtype=self._dtype,
            single_token=single_token,
        )
        self._check_new(keys, values)
        parts = self._encode(keys, values)
        if self._buffers is None:
            self._geometry = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            self._dtype = keys.dtype
        return self._store(parts, keys.shape[2])

    def _store(self, parts: tuple[mx.array, ...], n_new: int) -> int:
        """Write ``n_new`` encoded tokens after those held (growing first if needed)."""
        grow = self._growth(n_new)
        if grow is not None:
            capacity, keep = grow
            self._allocate(capacity, keep=keep)
        assert self._buffers is not None
        start, stop = self._fill, self._fill + n_new
        for buffer, part in zip(self._buffers, parts, strict=True):
            buffer[:, :, start:stop, :] = part
        self._fill = stop
        self._offset += n_new
        return start

    def _held(self, start: int = 0) -> tuple[mx.array, ...]:
        """New arrays (slices, never the buffers themselves) of buffer indices ``start..fill``.

        A slice is a separate array, so a later write into the buffers (after a ``trim``,
        say) never changes what an earlier call returned.
        """
        if self._buffers is None:
            raise CacheStateError(f"{self._NAME} holds no data yet: nothing has been written")
        return tuple(buffer[:, :, start : self._fill, :] for buffer in self._buffers)

    # -- mlx-lm cache protocol -------------------------------------------------------------

    @property
    def offset(self) -> int:
        """Absolute number of tokens processed (the position of the next token)."""
        return self._offset

    @property
    def capacity(self) -> int:
        """Tokens the current buffers can store (0 before the first allocation)."""
        return 0 if self._buffers is None else int(self._buffers[0].shape[2])

    @property
    def allocations(self) -> int:
        """How many times buffers were allocated (the first allocation included)."""
        return self._allocations

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask for ``N`` new queries over every token held (as mlx-lm's ``KVCache``)."""
        return make_attention_mask(N, self._offset, return_array, window_size)

    @property
    def state(self) -> StateT | tuple[()]:
        """The tokens held as arrays mlx can evaluate and save; ``()`` before the first write."""
        if self._buffers is None:
            return ()
        return self._state()

    @state.setter
    def state(self, value: Any) -> None:
        if is_empty_state(value):
            self.reset()
            return
        self._load_state(value)

    def is_trimmable(self) -> bool:
        """True: ``trim`` moves the offset back (speculative decoding)."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (``0 <= n <= offset``); returns ``n``.

        Checked completely first: a refused trim leaves the cache as it was.
        """
        n = check_trim(self._NAME, n, self._offset)
        self._check_trim(n)
        self._offset -= n
        self._fill -= n
        return n

    def reset(self) -> None:
        """Forget every token (the contiguous cache keeps its buffers for reuse)."""
        if self._REUSE_BUFFERS_ON_RESET:
            self._offset = self._fill = 0
        else:
            self._release()

    def size(self) -> int:
        """Tokens held."""
        return self._fill

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated buffers (their capacity, not just the tokens held)."""
        if self._buffers is None:
            return 0
        return int(sum(buffer.nbytes for buffer in self._buffers))

    def empty(self) -> bool:
        """True while the cache holds no token."""
        return self._fill == 0
