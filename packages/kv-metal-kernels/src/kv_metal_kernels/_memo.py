"""A tiny memo keyed by the identity of an input array, for per-step host plans."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["IdentityMemo"]

_V = TypeVar("_V")


class IdentityMemo(Generic[_V]):
    """The last ``size`` values computed from an array object, keyed by ``is`` plus parameters.

    Batched decode passes the same ``seq_lens`` / ``slots`` array object to every layer of a
    step, so a plan read from it on the host is computed once and reused. Each entry holds a
    reference to its array, so the array's ``id`` cannot be reused by a new array while the
    entry lives. The memo trusts that an array's values do not change: an array written in
    place (``a[i] = x``) after a call must be passed as a new array instead.
    """

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._size = size
        self._entries: list[tuple[object, Hashable, _V]] = []

    def get(self, array: object, params: Hashable) -> _V | None:
        """The value stored for this very ``array`` object and equal ``params``, or ``None``."""
        for held, key, value in reversed(self._entries):
            if held is array and key == params:
                return value
        return None

    def put(self, array: object, params: Hashable, value: _V) -> None:
        """Store ``value`` for ``(array, params)``, dropping the oldest entry beyond ``size``."""
        self._entries.append((array, params, value))
        if len(self._entries) > self._size:
            del self._entries[0]

    def clear(self) -> None:
        """Forget every entry (and release the arrays they hold)."""
        self._entries.clear()
