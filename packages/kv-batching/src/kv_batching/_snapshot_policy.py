"""When a request's recurrent state is snapshotted for prefix reuse, and where it is kept.

A recurrent state cannot be cut back to an earlier position, so on a model with STATE layers
a cached prefix is usable only where a snapshot of the state after it is kept. The policy
snapshots every ``interval`` tokens (a multiple of the pool's prefix boundary), at each
prompt's last boundary, and at the last boundary a request decoded past (kept when it leaves
the pool); the snapshots live in a :class:`StateSnapshotCache` under the prefix's hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kv_protocol import KVPrefixCache, RequestStateError, check_int

from ._engine_core import EngineCore, kv_length
from ._requests import EngineRequest
from ._state_snapshots import StateSnapshot, StateSnapshotCache

__all__ = ["DEFAULT_STATE_CACHE_BYTES", "SnapshotPolicy", "rewind", "snapshot_at"]

logger = logging.getLogger(__name__)

#: Bytes of recurrent-state snapshots an engine keeps for prefix reuse unless told otherwise.
DEFAULT_STATE_CACHE_BYTES = 1 << 30

#: The default snapshot interval is the largest multiple of the prefix boundary up to this.
_SNAPSHOT_INTERVAL_TOKENS = 256


class SnapshotPolicy:
    """The snapshot points of a text and the cache the snapshots are kept in.

    ``prefix_cache`` is the pool's, whose pages the snapshots sit on: its ``boundary`` (the
    page sizes' least common multiple) is the policy's; ``interval`` a positive multiple of it.
    """

    def __init__(
        self, cache: StateSnapshotCache, interval: int, prefix_cache: KVPrefixCache
    ) -> None:
        self.cache = cache
        self.interval = interval
        self.prefix_cache = prefix_cache
        self.boundary = prefix_cache.boundary

    @classmethod
    def choose(
        cls,
        prefix_cache: KVPrefixCache | None,
        has_state_layers: bool,
        interval: int | None,
        budget: int | None,
    ) -> SnapshotPolicy | None:
        """The policy of an engine (prefix caching on a model with STATE layers), else ``None``.

        Both arguments are checked whatever the model, so a bad value is refused even where
        it would have no effect.
        """
        boundary = prefix_cache.boundary if prefix_cache is not None else None
        if interval is not None:
            interval = check_int(interval, "state_snapshot_interval", minimum=1)
            if boundary is not None and interval % boundary:
                raise RequestStateError(
                    f"state_snapshot_interval={interval} is not a multiple of the pool's prefix "
                    f"boundary of {boundary} tokens (the page sizes' least common multiple); "
                    f"use a positive multiple of {boundary}"
                )
        if budget is not None:
            budget = check_int(budget, "state_cache_bytes", minimum=0)
        if prefix_cache is None or boundary is None or not has_state_layers:
            return None
        if interval is None:
            interval = max(boundary, _SNAPSHOT_INTERVAL_TOKENS // boundary * boundary)
        cache = StateSnapshotCache(DEFAULT_STATE_CACHE_BYTES if budget is None else budget)
        return cls(cache, interval, prefix_cache)

    def chunk_limit(self, begin: int, total: int) -> int:
        """Tokens from ``begin`` to the next snapshot point of a text of ``total`` tokens.

        Snapshot points are the multiples of the interval and the text's last prefix
        boundary (its end rounded down to a page of every sub-pool); past the last one, the
        rest of the text. Prefill chunks end there, so a snapshot costs no forward.
        """
        stop = (begin // self.interval + 1) * self.interval
        end = self.last_boundary(total)
        if begin < end < stop:
            stop = end
        return min(stop, total) - begin

    def is_point(self, position: int, total: int) -> bool:
        """Whether a prefill chunk ending at ``position`` of ``total`` tokens is snapshotted."""
        if position <= 0:
            return False
        return position % self.interval == 0 or position == self.last_boundary(total)

    def last_boundary(self, total: int) -> int:
        """The last prefix boundary of a text of ``total`` tokens (0 if it has none)."""
        return total // self.boundary * self.boundary

    def keep(self, request: EngineRequest, snapshot: StateSnapshot) -> None:
        """Keep ``snapshot`` (of ``request``'s state) under its prefix's hash.

        Only while the pool holds the page ending there in every sub-pool: the snapshot
        leaves with that page (the eviction listener), and a page another request registered
        first may be gone by the time this request keeps its pending snapshot.
        """
        hashes = request.hashes
        if hashes is None or not snapshot.nbytes:
            return
        try:
            if not self.prefix_cache.holds_prefix(hashes, snapshot.position):
                return
            self.cache.put(hashes.prefix_hash(snapshot.position), snapshot)
        except Exception as error:  # only a later request's reuse is lost
            logger.warning("state snapshot of request %d not kept: %r", request.rid, error)

    def after_decode(
        self, request: EngineRequest, length: int, states: Sequence[Any] | None = None
    ) -> None:
        """After a decode step to ``length`` tokens: snapshot the state at a boundary.

        At an interval it is kept at once; at another boundary it becomes the request's
        pending snapshot, kept when the request leaves the pool (finished or preempted), so a
        later turn of the conversation or the request's own re-admission resumes there.
        ``states`` is the state after ``length`` tokens when it is not the request's own.
        """
        if length % self.boundary:
            return
        # A decode row's state is a slice of the batch's; the copy holds only its own.
        own = (request.states or []) if states is None else states
        snapshot = StateSnapshot(own, length, detach=True)
        mx.eval(snapshot.arrays())
        if length % self.interval == 0:
            self.keep(request, snapshot)
            request.pending_snapshot = None
        else:
            request.pending_snapshot = snapshot

    def after_verification(
        self,
        request: EngineRequest,
        start: int,
        end: int,
        state_after: Callable[[int], list[Any]] | None,
    ) -> None:
        """Snapshot the state at the last prefix boundary a verification passed, if known.

        The verification took ``request`` from ``start`` to ``end`` tokens; the boundary is
        the last in ``(start, end]`` (see :meth:`after_decode`): at ``end`` the state is the
        request's own, inside from ``state_after(n)`` (the state after the step's first
        ``n`` rows).
        """
        boundary = self.last_boundary(end)
        if boundary <= start:
            return
        if boundary == end:
            self.after_decode(request, end)
            return
        if state_after is None:
            return
        try:
            states = state_after(boundary - start)
        except Exception as error:  # the snapshot is an optimisation: go on without it
            logger.warning("state snapshot of request %d not taken: %r", request.rid, error)
            return
        self.after_decode(request, boundary, states)

    def keep_pending(self, request: EngineRequest) -> None:
        """``request`` leaves the pool with a sound state: keep its pending snapshot."""
        pending = request.pending_snapshot
        if pending is not None:
            self.keep(request, pending)
            request.pending_snapshot = None


def snapshot_at(
    request: EngineRequest, position: int, policy: SnapshotPolicy | None
) -> StateSnapshot | None:
    """A snapshot of ``request``'s own state after ``position`` tokens, if one is kept.

    The request's state before its last decode step, its pending snapshot, or one the
    policy's cache keeps at a prefix boundary of its text.
    """
    for own in (request.step_snapshot, request.pending_snapshot):
        if own is not None and own.position == position:
            return own
    hashes = request.hashes
    if hashes is None or policy is None or position % policy.boundary or position == 0:
        return None
    if position > hashes.num_tokens:
        return None
    return policy.cache.get(hashes.prefix_hash(position))


def rewind(
    request: EngineRequest, position: int, core: EngineCore, policy: SnapshotPolicy | None
) -> None:
    """Roll running ``request`` back to its first ``position`` tokens of text.

    Generated tokens past it are dropped (with their logprobs), the pool gives back the
    positions past it, and a recurrent state becomes the snapshot taken there (see
    :func:`snapshot_at`). Every check comes first: nothing changes on an error.
    """
    request_id = request.rid
    position = check_int(position, "position", minimum=0)
    length = kv_length(request)
    if not len(request.prompt) <= position <= length:
        raise RequestStateError(
            f"request {request_id} can be restored to positions {len(request.prompt)}.."
            f"{length} (its prompt to its current length), not {position}"
        )
    if getattr(request, "constraint", None) is not None:
        raise RequestStateError(
            f"request {request_id} decodes under a constraint whose state cannot be rolled back"
        )
    states: list[Any] | None = None
    if core.state_layer_ids:
        snapshot = snapshot_at(request, position, policy)
        if snapshot is None:
            raise RequestStateError(
                f"request {request_id} has no state snapshot at position {position}: "
                "restore to the position before its last decode step (step_snapshots=True) "
                "or to a prefix boundary where a snapshot is kept"
            )
        states = snapshot.caches()
    core.pool.trim_request(request.rid, length - position)
    text = request.prompt + request.generated
    if request.hashes is not None:
        request.hashes.truncate(position, text)
    kept = position - len(request.prompt) + 1
    del request.generated[kept:]
    if request.logprobs is not None:
        del request.logprobs[kept:]
    if states is not None:
        request.states = states
    pending = request.pending_snapshot
    if pending is not None and pending.position > position:
        request.pending_snapshot = None
    request.step_snapshot = None
