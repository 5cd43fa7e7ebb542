"""A per-request KV cache for a sliding-window layer: bounded storage, absolute offset."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, KVLifetime, MaskSpec

from ._checks import check_count, check_kv, check_positive
from ._masks import trailing_window_mask
from ._storage import StorageCache

__all__ = ["WindowedAttentionKVCache"]

_NAME = "WindowedAttentionKVCache"


class WindowedAttentionKVCache(StorageCache[tuple[mx.array, mx.array, int]]):
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
    ``reset`` releases the buffers.
    """

    _NAME = _NAME

    def __init__(self, window: int) -> None:
        self._window = check_positive("window", window)
        self._lifetime = KVLifetime(self._window)
        super().__init__(initial_capacity=2 * self._window)

    def __repr__(self) -> str:
        return (
            f"{_NAME}(window={self._window}, offset={self._offset}, held={self._fill}, "
            f"capacity={self.capacity})"
        )

    # -- storage ---------------------------------------------------------------------------

    def _kept(self) -> int:
        """Old tokens the next query still sees."""
        return self._lifetime.kept_before(self._offset)

    def _growth(self, n_new: int) -> tuple[int, int] | None:
        """Fresh buffers when out of room or much larger than needed, keeping the visible tail."""
        kept = self._kept()
        bound = max(self._initial_capacity, kept + n_new)
        if self._buffers is None or self._fill + n_new > self.capacity or self.capacity > bound:
            return bound, kept
        return None

    def _check_trim(self, n: int) -> None:
        new_offset = self._offset - n
        if self._fill - n < self._lifetime.kept_before(new_offset):
            raise CacheStateError(
                f"{_NAME}: cannot trim {n} tokens: the window before position {new_offset} "
                "is no longer stored"
            )

    # -- mlx-lm cache protocol -------------------------------------------------------------

    @property
    def window(self) -> int:
        """Keys a query sees, itself included."""
        return self._window

    @property
    def held(self) -> int:
        """Tokens currently stored (the trailing ones)."""
        return self._fill

    @property
    def has_dropped_history(self) -> bool:
        """True once tokens at the start of the sequence are no longer stored."""
        return self._offset > self._fill

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, H, S, D)`` keys/values; return the ``min(offset, window-1) + S`` visible.

        ``offset`` is the value before the call. The returned keys are in temporal order and
        match the width of ``make_mask(S, window_size=window)`` taken before the call.
        """
        kept = self._kept()
        start = self._append(keys, values)
        visible_k, visible_v = self._held(start - kept)
        return visible_k, visible_v

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """Append one token's ``(B, H, 1, D)`` key and value (the decode path)."""
        self._append(keys, values, single_token=True)

    def get_kv(self, window: int | None = None) -> tuple[mx.array, mx.array]:
        """The trailing ``window`` tokens (default: this cache's window), ``(B, H, n, D)``.

        Raises ``CacheStateError`` when more tokens are asked for than are still stored.
        """
        if self._buffers is None:
            raise CacheStateError(f"{_NAME} holds no data yet: nothing has been written")
        wanted = self._window if window is None else check_positive("window", window)
        n = min(wanted, self._offset)
        if n > self._fill:
            raise CacheStateError(
                f"{_NAME} holds only the last {self._fill} tokens; cannot return the last {n}"
            )
        keys, values = self._held(self._fill - n)
        return keys, values

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

    def _state(self) -> tuple[mx.array, mx.array, int]:
        """``(keys, values, offset)``: the tokens held in temporal order and the offset."""
        keys, values = self._held()
        return keys, values, self._offset

    def _load_state(self, value: Any) -> None:
        if not isinstance(value, tuple | list) or len(value) != 3:
            raise CacheStateError(f"{_NAME}: state must be (keys, values, offset), got {value!r}")
        keys, values = check_kv(_NAME, value[0], value[1])
        offset = check_count("offset", value[2])
        n_tokens = keys.shape[2]
        if n_tokens > offset:
            raise CacheStateError(f"{_NAME}: state holds {n_tokens} tokens but offset is {offset}")
        needed = self._lifetime.kept_before(offset)
        if n_tokens < needed:
            raise CacheStateError(
                f"{_NAME}: state holds {n_tokens} tokens, fewer than the "
                f"{needed} the next query at offset {offset} needs"
            )
        self._release()
        self._append(keys, values)
        self._offset = offset
