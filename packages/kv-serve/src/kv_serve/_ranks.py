"""The ranks of one tensor-parallel engine: ``mx.distributed`` collectives and a watchdog.

Rank 0 (the leader) decides; every other rank (a follower) applies what it decided. All
messages are int32 arrays summed over the group with zeros from the followers (MLX has no
broadcast), never pickled objects: the ring backend's sockets are unauthenticated.

A rank whose peers stop answering must not hang: every blocking exchange runs under a
watchdog (:meth:`RankGroup.watch`), and a collective that raises (a peer's socket closed) or
outlives its deadline ends the process with :data:`RANK_LOST_EXIT` through ``on_lost``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import mlx.core as mx

from kv_protocol import check_number

__all__ = ["RANK_LOST_EXIT", "RankGroup", "RankLostError", "init_ranks"]

logger = logging.getLogger(__name__)

#: The exit status of a rank that lost its peers (a collective failed or timed out).
RANK_LOST_EXIT = 3

#: How long the first exchange waits for the other ranks to load their model (seconds).
STARTUP_TIMEOUT = 600.0

_INT32 = 2**31


class RankLostError(RuntimeError):
    """A collective failed or timed out: the ranks can no longer run in lock step."""


def _exit_process(message: str) -> None:
    logger.critical("%s; exiting with status %d", message, RANK_LOST_EXIT)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(RANK_LOST_EXIT)


class RankGroup:
    """One rank's view of its group: the leader's messages, agreement and a watchdog.

    ``timeout`` (seconds) bounds any one exchange once serving (a step, or a follower's
    wait for the leader's next message; the leader sends one at least every ``heartbeat``
    seconds). ``on_lost(message)`` is called when a collective raises or outlives its
    deadline; by default it ends the process with :data:`RANK_LOST_EXIT`.
    """

    def __init__(
        self,
        group: mx.distributed.Group,
        *,
        timeout: float = 60.0,
        heartbeat: float = 1.0,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout = check_number(timeout, "rank timeout", minimum=0.0, min_inclusive=False)
        self.heartbeat = check_number(heartbeat, "heartbeat", minimum=0.0, min_inclusive=False)
        if self.heartbeat >= self.timeout:
            raise ValueError(
                f"the heartbeat ({self.heartbeat} s) must be shorter than the rank timeout "
                f"({self.timeout} s)"
            )
        self._on_lost = on_lost or _exit_process
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._lost = False
        self._watchdog: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this rank decides (rank 0)."""
        return self.rank == 0

    # ------------------------------------------------------------------ watchdog

    @contextlib.contextmanager
    def watch(self, what: str, seconds: float | None = None) -> Iterator[None]:
        """Run the block under the watchdog: ``seconds`` (default ``timeout``) at most.

        A collective raising inside it (a peer gone) is reported to ``on_lost`` too, then
        re-raised as :class:`RankLostError`.
        """
        self._start_watchdog()
        with self._lock:
            outer = self._deadline, self._what
            self._deadline = time.monotonic() + (self.timeout if seconds is None else seconds)
            self._what = what
        try:
            yield
        except RuntimeError as error:
            if not isinstance(error, RankLostError):
                self.lost(f"rank {self.rank}: {what} failed: {error}")
                raise RankLostError(str(error)) from error
            raise
        finally:
            with self._lock:
                # A nested exchange (the prefill budget inside a step) hands the step's
                # deadline back.
                self._deadline, self._what = outer

    def lost(self, message: str) -> None:
        """Report that the ranks can no longer agree (once); ``on_lost`` decides what follows."""
        with self._lock:
            if self._lost:
                return
            self._lost = True
        self._on_lost(message)

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_loop, name=f"kv-serve-rank-{self.rank}-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch_loop(self) -> None:
        while not self._lost:
            time.sleep(0.2)
            with self._lock:
                deadline, what = self._deadline, self._what
            if deadline is not None and time.monotonic() > deadline:
                self.lost(
                    f"rank {self.rank}: no answer from the other ranks within the deadline "
                    f"during {what}"
                )

    # ------------------------------------------------------------------ messages

    def broadcast(self, values: Sequence[int] | None, what: str) -> list[int]:
        """The leader's ``values`` on every rank (followers pass ``None``); int32 each."""
        if self.is_leader:
            if values is None:
                raise ValueError("the leader rank must give the values it broadcasts")
            data = [int(v) for v in values]
            bad = [v for v in data if not -_INT32 <= v < _INT32]
            if bad:
                raise ValueError(f"a rank message holds int32 values only, got {bad[:3]}")
        else:
            data = []
        with self.watch(what):
            length = self._leader_sum(mx.array([len(data)], dtype=mx.int32))
            count = int(cast(int, length.item()))
            if count == 0:
                return []
            local = mx.array(data, dtype=mx.int32) if self.is_leader else None
            payload = self._leader_sum(
                local if local is not None else mx.zeros((count,), dtype=mx.int32)
            )
            return [int(v) for v in cast(list[int], payload.tolist())]

    def _leader_sum(self, values: mx.array) -> mx.array:
        total = mx.distributed.all_sum(values, group=self.group)
        mx.eval(total)
        return total

    def all_min(self, values: Sequence[int], what: str, seconds: float | None = None) -> list[int]:
        """The element-wise minimum of every rank's ``values`` (the same length on all)."""
        with self.watch(what, seconds):
            out = mx.distributed.all_min(mx.array(list(values), dtype=mx.int64), group=self.group)
            mx.eval(out)
        return [int(v) for v in cast(list[int], out.tolist())]

    def all_gather(self, value: int, what: str, seconds: float | None = None) -> list[int]:
        """Every rank's ``value``, in rank order."""
        with self.watch(what, seconds):
            out = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=self.group)
            mx.eval(out)
        return [int(v) for v in cast(list[int], out.tolist())]

    # ------------------------------------------------------------------ RankAgreement

    def tokens(self, tokens: mx.array) -> mx.array:
        """The leader's sampled tokens on every rank (lazy; still depending on this rank's)."""
        mine = tokens.astype(mx.int32)
        share = mine if self.is_leader else mine * 0
        return mx.distributed.all_sum(share, group=self.group).astype(tokens.dtype)

    def prefill_budget(self, tokens: int) -> int:
        """The leader's prefill budget for this step."""
        return self.broadcast([tokens] if self.is_leader else None, "the prefill budget")[0]


def init_ranks(
    *, backend: str = "any", timeout: float = 60.0, heartbeat: float = 1.0
) -> RankGroup | None:
    """The :class:`RankGroup` of this process when it was started as one of several ranks.

    ``mx.distributed.init`` reads what ``mlx.launch`` (or ``MLX_HOSTFILE`` / ``MLX_RANK``)
    set; a single process gets ``None``.
    """
    group = mx.distributed.init(backend=backend)
    if group.size() == 1:
        return None
    return RankGroup(group, timeout=timeout, heartbeat=heartbeat)
