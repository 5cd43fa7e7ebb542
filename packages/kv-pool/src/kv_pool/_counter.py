"""A thread-safe layer-wise transfer counter (``kv_protocol.LayerTransferCounter``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from kv_protocol import LayerKindError, RequestStateError, TransferTimeoutError

__all__ = ["LayerDoneCounter"]


class LayerDoneCounter:
    """Tracks which layers' KV transfers (host or disk to device) have completed.

    A loader thread calls :meth:`mark_done` for each global layer id as its KV lands in the
    pool; the model thread's buffer accessors call :meth:`wait_until` for the layer they are
    about to read, blocking until that layer is marked. Layers may complete in any order.
    ``timeout`` (seconds, ``None`` = wait forever) is the default for :meth:`wait_until`; on
    expiry it raises ``TransferTimeoutError``.
    """

    def __init__(self, layer_ids: Iterable[int] | int, *, timeout: float | None = None) -> None:
        ids = range(layer_ids) if isinstance(layer_ids, int) else layer_ids
        self._layer_ids = frozenset(ids)
        if timeout is not None and not timeout >= 0:
            raise RequestStateError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        self._timeout = timeout
        self._done: set[int] = set()
        self._cond = threading.Condition()

    @property
    def layer_ids(self) -> frozenset[int]:
        """The global layer ids this counter tracks."""
        return self._layer_ids

    def _check(self, layer_id: int) -> None:
        if layer_id not in self._layer_ids or isinstance(layer_id, bool):
            raise LayerKindError(
                f"{layer_id=} is not tracked by this LayerDoneCounter: {sorted(self._layer_ids)}"
            )

    def mark_done(self, layer_id: int) -> None:
        """Mark the transfer of global layer ``layer_id`` complete and wake its waiters."""
        self._check(layer_id)
        with self._cond:
            self._done.add(layer_id)
            self._cond.notify_all()

    def mark_all_done(self) -> None:
        """Mark every tracked layer complete."""
        with self._cond:
            self._done.update(self._layer_ids)
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget every completion (start of the next transfer)."""
        with self._cond:
            self._done.clear()

    def is_done(self, layer_id: int) -> bool:
        """True if the transfer of ``layer_id`` has been marked complete."""
        self._check(layer_id)
        with self._cond:
            return layer_id in self._done

    def wait_until(self, layer_id: int, timeout: float | None = None) -> None:
        """Block until the transfer of global layer ``layer_id`` is complete.

        ``timeout`` overrides the counter's default; ``TransferTimeoutError`` on expiry.
        """
        self._check(layer_id)
        limit = self._timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._cond:
            while layer_id not in self._done:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TransferTimeoutError(
                        f"layer {layer_id} was not marked done within {limit} s"
                    )
                self._cond.wait(remaining)
