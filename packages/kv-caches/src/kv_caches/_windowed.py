"""A per-request KV cache for a sliding-window layer: bounded storage, absolute offset."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, MaskSpec

from ._checks import check_count, check_kv, check_positive, check_trim
from ._masks import trailing_window_mask

__all__ = ["WindowedAttentionKVCache"]

_NAME = "WindowedAttentionKVCache"


class WindowedAttentionKVCache:
    """The trailing keys/values a sliding-window layer of width ``window`` still needs.

    A query at absolute position ``p`` sees keys ``p - window + 1 .. p``. ``offset`` stays
    absolute (RoPE positions, batching) while storage is bounded: after a chunk of ``S``
    tokens the buffers hold at most ``max(2 * window, window - 1 + S)`` tokens, so
    ``2 * window`` in steady decode. Tokens are kept in temporal order; when the buffers run
    out of room (or are much larger than needed) the still-visible tail is copied into fresh
    buffers, which happens once every ~``window`` decode steps (amortised O(1)) and never
    changes an array a pending lazy graph reads.

    ``update_and_fetch`` returns exactly the keys the new chunk's queries can see: the last
    ``min(offset, window - 1)`` old tokens plus the chunk. ``make_mask`` is built for that
    width; a full-context mask once older tokens are gone raises ``CacheStateError``.
    """

    def __init__(self, window: int) -> None:
        self._window = check_positive("window", window)
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._geometry: tuple[int, int, int, int] | None = None
        self._dtype: mx.Dtype | None = None
        self._offset = 0
        # Tokens held, at buffer indices [0, _fill): absolute positions offset - _fill .. offset-1.
        self._fill = 0
        self._allocations = 0

    def __repr__(self) -> str:
        return (
            f"{_NAME}(window={self._window}, offset={self._offset}, held={self._fill}, "
            f"capacity={self.capacity})"
        )

    # -- storage ---------------------------------------------------------------------------

    def _kept(self) -> int:
        """Old tokens the next query still sees."""
        return min(self._offset, self._window - 1)

    def _append(self, keys: mx.array, values: mx.array, *, single_token: bool) -> int:
        """Store the chunk; return the buffer index of the first key its queries see."""
        keys, values = check_kv(
            _NAME,
            keys,
            values,
            expect=self._geometry,
            dtype=self._dtype,
            single_token=single_token,
        )
        n_new = keys.shape[2]
        kept = self._kept()
        needed = kept + n_new
        bound = max(2 * self._window, needed)
        if (
            self._keys is None
            or self._values is None
            or self._fill + n_new > self.capacity
            or self.capacity > bound
        ):
            if kept:
                assert self._keys is not None and self._values is not None
                lo = self._fill - kept
                keys = mx.concatenate([self._keys[:, :, lo : self._fill, :], keys], axis=2)
                values = mx.concatenate([self._values[:, :, lo : self._fill, :], values], axis=2)
            self._bind(keys, values, capacity=bound)
            self._offset += n_new
            return 0
        start = self._fill - kept
        stop = self._fill + n_new
        self._keys[:, :, self._fill : stop, :] = keys
        self._values[:, :, self._fill : stop, :] = values
        self._fill = stop
        self._offset += n_new
        return start

    def _bind(self, keys: mx.array, values: mx.array, *, capacity: int) -> None:
        """Replace the buffers by fresh ones of ``capacity`` tokens starting with ``keys``."""
        batch, heads, held, k_dim = keys.shape
        v_dim = values.shape[3]
        pad = capacity - held
        if pad:
            keys = mx.concatenate(
                [keys, mx.zeros((batch, heads, pad, k_dim), dtype=keys.dtype)], axis=2
            )
            values = mx.concatenate(
                [values, mx.zeros((batch, heads, pad, v_dim), dtype=values.dtype)], axis=2
            )
        # Fresh arrays: the old buffers stay intact for any graph still reading them.
        self._keys, self._values = keys, values
        self._geometry = (batch, heads, k_dim, v_dim)
        self._dtype = keys.dtype
        self._fill = held
        self._allocations += 1

    # -- mlx-lm cache protocol -------------------------------------------------------------

    @property
    def window(self) -> int:
        """Keys a query sees, itself included."""
        return self._window

    @property
    def offset(self) -> int:
        """Absolute number of tokens processed (not the number held)."""
        return self._offset

    @property
    def held(self) -> int:
        """Tokens currently stored (the trailing ones)."""
        return self._fill

    @property
    def capacity(self) -> int:
        """Tokens the current buffers can store (0 before the first write)."""
        return 0 if self._keys is None else int(self._keys.shape[2])

    @property
    def allocations(self) -> int:
        """How many times buffers were allocated (first allocation and compactions)."""
        return self._allocations

    @property
    def has_dropped_history(self) -> bool:
        """True once tokens at the start of the sequence are no longer stored."""
        return self._offset > self._fill

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, H, S, D)`` keys/values; return the ``min(offset, window-1) + S`` visible.

        ``offset`` is the value before the call. The returned keys are in temporal order and
        match the width of ``make_mask(S, window_size=window)`` taken before the call.
        """
        start = self._append(keys, values, single_token=False)
        assert self._keys is not None and self._values is not None
        return (
            self._keys[:, :, start : self._fill, :],
            self._values[:, :, start : self._fill, :],
        )

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """Append one token's ``(B, H, 1, D)`` key and value (the decode path)."""
        self._append(keys, values, single_token=True)

    def get_kv(self, window: int | None = None) -> tuple[mx.array, mx.array]:
        """The trailing ``window`` tokens (default: this cache's window), ``(B, H, n, D)``.

        Raises ``CacheStateError`` when more tokens are asked for than are still stored.
        """
        if self._keys is None or self._values is None:
            raise CacheStateError(f"{_NAME} holds no data yet: nothing has been written")
        wanted = self._window if window is None else check_positive("window", window)
        n = min(wanted, self._offset)
        if n > self._fill:
            raise CacheStateError(
                f"{_NAME} holds only the last {self._fill} tokens; cannot return the last {n}"
            )
        return (
            self._keys[:, :, self._fill - n : self._fill, :],
            self._values[:, :, self._fill - n : self._fill, :],
        )

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask for ``N`` new queries over the keys ``update_and_fetch`` will return.

        The keys start ``min(offset, window - 1)`` tokens before the chunk. Without a
        ``window_size`` the mask is full-context causal, which is possible only while no
        token has been dropped.
        """
        return trailing_window_mask(
            N, self._offset, self._window, return_array, window_size, owner=_NAME
        )

    @property
    def state(self) -> tuple[mx.array, mx.array, int] | tuple[()]:
        """``(keys, values, offset)``: the tokens held in temporal order and the offset."""
        if self._keys is None or self._values is None:
            return ()
        return (
            self._keys[:, :, : self._fill, :],
            self._values[:, :, : self._fill, :],
            self._offset,
        )

    @state.setter
    def state(self, value: Any) -> None:
        if not value:
            self.reset()
            return
        if not isinstance(value, tuple | list) or len(value) != 3:
            raise CacheStateError(f"{_NAME}: state must be (keys, values, offset), got {value!r}")
        keys, values = check_kv(_NAME, value[0], value[1])
        offset = check_count("offset", value[2])
        if keys.shape[2] > offset:
            raise CacheStateError(
                f"{_NAME}: state holds {keys.shape[2]} tokens but offset is {offset}"
            )
        if keys.shape[2] < min(offset, self._window - 1):
            raise CacheStateError(
                f"{_NAME}: state holds {keys.shape[2]} tokens, fewer than the "
                f"{min(offset, self._window - 1)} the next query at offset {offset} needs"
            )
        self.reset()
        self._bind(keys, values, capacity=max(2 * self._window, keys.shape[2]))
        self._offset = offset

    def is_trimmable(self) -> bool:
        """True: ``trim`` works while the tokens the next query needs remain stored."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; raises if the window before them was already dropped."""
        n = check_trim(_NAME, n, self._offset)
        new_offset = self._offset - n
        if self._fill - n < min(new_offset, self._window - 1):
            raise CacheStateError(
                f"{_NAME}: cannot trim {n} tokens: the window before position {new_offset} "
                "is no longer stored"
            )
        self._offset = new_offset
        self._fill -= n
        return n

    def reset(self) -> None:
        """Forget every token and release the buffers."""
        self._keys = self._values = None
        self._geometry = None
        self._dtype = None
        self._offset = 0
        self._fill = 0

    def size(self) -> int:
        """Tokens held."""
        return self._fill

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated key and value buffers."""
        if self._keys is None or self._values is None:
            return 0
        return int(self._keys.nbytes + self._values.nbytes)

    def empty(self) -> bool:
        """True while the cache holds no token."""
        return self._fill == 0
