"""Snapshots of recurrent state, kept by prefix hash so a later request can resume from them.

A STATE layer's state after ``p`` tokens depends on every one of them, so it cannot be cut
back to a shared prefix the way attention pages can. Instead the engine copies each
request's state caches at some prefix boundaries (:class:`StateSnapshot`) and keeps the
copies in a :class:`StateSnapshotCache` under the prefix's block hash (the same hash the
pool's page ending there is registered under, which stands for the whole prefix). Entries
are counted in bytes against their own budget and evicted least recently used; the engine
also drops an entry as soon as the pool stops holding the page that ends at its boundary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kv_protocol import check_int

from ._state_cache import copy_state_caches, state_nbytes

__all__ = ["StateSnapshot", "StateSnapshotCache", "StateSnapshotStats"]


class StateSnapshot:
    """A copy of one request's state caches (every STATE layer) after ``position`` tokens.

    MLX arrays are immutable and recurrent layers replace their slots, so copying each cache
    object (its lists copied) is a complete, independent snapshot. ``detach`` copies the
    arrays too: a decode row's state is a slice of the step's stacked state, which would keep
    the whole batch's buffer alive (call :meth:`arrays` into one ``mx.eval``).
    """

    __slots__ = ("_caches", "nbytes", "position")

    def __init__(self, caches: Sequence[Any], position: int, *, detach: bool = False) -> None:
        self.position = position
        self._caches = copy_state_caches(caches)
        if detach:
            for cache in self._caches:
                slots = getattr(cache, "cache", None)
                if isinstance(slots, list):
                    cache.cache = [
                        mx.array(value) if isinstance(value, mx.array) else value for value in slots
                    ]
        self.nbytes = state_nbytes(self._caches)

    def arrays(self) -> list[mx.array]:
        """The snapshot's state arrays (to evaluate a detached copy)."""
        return [
            value
            for cache in self._caches
            for value in getattr(cache, "cache", ())
            if isinstance(value, mx.array)
        ]

    def caches(self) -> list[Any]:
        """Fresh state caches holding this state; the snapshot stays as it is."""
        return copy_state_caches(self._caches)


@dataclass(frozen=True, kw_only=True)
class StateSnapshotStats:
    """What a snapshot cache holds and did: entries, bytes against the budget, hits.

    ``stored`` counts snapshots put in, ``hits`` the requests that resumed from one (and
    ``hit_tokens`` the tokens they did not prefill), ``evictions`` entries dropped for the
    budget and ``dropped`` those dropped because the pool evicted their page.
    """

    snapshots: int
    bytes: int
    budget_bytes: int
    stored: int
    hits: int
    hit_tokens: int
    evictions: int
    dropped: int


class StateSnapshotCache:
    """Recurrent-state snapshots by prefix hash, least recently used first out of a byte budget.

    A snapshot larger than the whole budget is not kept. Putting a key that is present keeps
    the entry there (the same prefix has the same state) and marks it used.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = check_int(budget_bytes, "state_cache_bytes", minimum=0)
        self._entries: OrderedDict[bytes, StateSnapshot] = OrderedDict()
        self._bytes = 0
        self._stored = self._hits = self._hit_tokens = self._evictions = self._dropped = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the snapshots held now."""
        return self._bytes

    def put(self, key: bytes, snapshot: StateSnapshot) -> bool:
        """Keep ``snapshot`` under ``key``, evicting the least recently used to make room.

        False when it is larger than the budget (nothing changes then).
        """
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if snapshot.nbytes > self.budget_bytes:
            return False
        while self._bytes + snapshot.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
        self._entries[key] = snapshot
        self._bytes += snapshot.nbytes
        self._stored += 1
        return True

    def get(self, key: bytes) -> StateSnapshot | None:
        """The snapshot under ``key`` (marked used), or ``None``."""
        snapshot = self._entries.get(key)
        if snapshot is not None:
            self._entries.move_to_end(key)
        return snapshot

    def note_hit(self, tokens: int) -> None:
        """A request resumed from a snapshot, skipping ``tokens`` tokens of prefill."""
        self._hits += 1
        self._hit_tokens += tokens

    def discard(self, key: bytes) -> None:
        """Drop the snapshot under ``key`` if there is one (its page left the pool)."""
        snapshot = self._entries.pop(key, None)
        if snapshot is not None:
            self._bytes -= snapshot.nbytes
            self._dropped += 1

    def forget_block(self, sub_pool: str, block: object) -> None:
        """A sub-pool stopped holding ``block``: drop the snapshot at that prefix, if any.

        The listener the engine gives the prefix cache (``add_eviction_listener``).
        """
        if isinstance(block, bytes):
            self.discard(block)

    def clear(self) -> None:
        """Drop every snapshot."""
        self._dropped += len(self._entries)
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> StateSnapshotStats:
        """Entries, bytes, budget and counters now."""
        return StateSnapshotStats(
            snapshots=len(self._entries),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            stored=self._stored,
            hits=self._hits,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            dropped=self._dropped,
        )
