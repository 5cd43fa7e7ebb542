"""A data-free cache that only answers for an offset (masks during batched decode)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, MaskSpec

from ._checks import check_count, check_trim, is_empty_state
from ._masks import make_attention_mask

__all__ = ["AttentionOffsetCache"]


class AttentionOffsetCache:
    """Holds no K/V, only an ``offset``, so a model container can build its masks.

    ``make_mask`` answers exactly as mlx-lm's own ``KVCache`` would at this offset. Storing
    data through it is a bug and raises ``RuntimeError("AttentionOffsetCache should not store
    data")``.
    """

    def __init__(self, offset: int = 0) -> None:
        self._offset = check_count("offset", offset)

    def __repr__(self) -> str:
        return f"AttentionOffsetCache(offset={self._offset})"

    @property
    def offset(self) -> int:
        """The absolute position of the next query."""
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._offset = check_count("offset", value)

    @property
    def state(self) -> tuple[()]:
        """Always ``()``: there is nothing to evaluate or save."""
        return ()

    @state.setter
    def state(self, value: Any) -> None:
        if not is_empty_state(value):
            raise CacheStateError(
                f"AttentionOffsetCache holds no data; cannot set a non-empty state {value!r}"
            )

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask mlx-lm's ``KVCache`` gives for ``N`` queries at this offset."""
        return make_attention_mask(N, self._offset, return_array, window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Always raises: this cache must never be asked to store keys or values."""
        raise CacheStateError("AttentionOffsetCache should not store data")

    def is_trimmable(self) -> bool:
        """True: trimming only moves the offset back."""
        return True

    def trim(self, n: int) -> int:
        """Move the offset back by ``n`` (``0 <= n <= offset``); returns ``n``."""
        n = check_trim("AttentionOffsetCache", n, self._offset)
        self._offset -= n
        return n

    def size(self) -> int:
        """Tokens held: always 0."""
        return 0

    @property
    def nbytes(self) -> int:
        """Always 0."""
        return 0

    def empty(self) -> bool:
        """Always True: the cache never holds data."""
        return True
