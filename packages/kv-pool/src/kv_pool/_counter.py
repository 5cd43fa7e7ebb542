"""A thread-safe layer-wise transfer counter (``kv_protocol.LayerTransferCounter``)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable

from kv_protocol import (
    LayerKindError,
    LayoutError,
    TransferTimeoutError,
    as_int,
    check_int,
    check_int_sequence,
    check_number,
    is_int,
)

__all__ = ["LayerDoneCounter"]


def _timeout(value: object, what: str) -> float | None:
    """A timeout in seconds: ``None`` or ``math.inf`` wait forever, else a finite number >= 0."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    return check_number(value, what, minimum=0)


class LayerDoneCounter:
    """Tracks which layers' KV transfers (host or disk to device) have completed.

    A loader thread calls :meth:`mark_done` for each global layer id as its KV lands in the
    pool; the model thread's buffer accessors call :meth:`wait_until` for the layer they are
    about to read, blocking until that layer is marked. Layers may complete in any order.

    ``layer_ids`` is the ids to track (ints >= 0) or a count ``n`` (ids ``0 .. n - 1``); a
    float, bool or negative value is a ``LayoutError``. ``timeout`` (seconds) is the default
    for :meth:`wait_until`: ``None`` or ``math.inf`` waits forever, ``0`` only checks, any
    other value must be a finite number >= 0 (a negative number, ``nan`` or ``-inf`` is a
    ``RequestStateError``); on expiry :meth:`wait_until` raises ``TransferTimeoutError``.
    """

    def __init__(self, layer_ids: Iterable[int] | int, *, timeout: float | None = None) -> None:
        if is_int(layer_ids) or isinstance(layer_ids, bool | float):
            count = check_int(
                layer_ids, "LayerDoneCounter layer count", minimum=0, error=LayoutError
            )
            ids: list[int] = list(range(count))
        else:
            ids = check_int_sequence(
                layer_ids, "LayerDoneCounter layer_ids", minimum=0, error=LayoutError
            )
        self._layer_ids = frozenset(ids)
        self._timeout = _timeout(timeout, "LayerDoneCounter timeout")
        self._done: set[int] = set()
        self._cond = threading.Condition()

    @property
    def layer_ids(self) -> frozenset[int]:
        """The global layer ids this counter tracks."""
        return self._layer_ids

    def _check(self, layer_id: object) -> int:
        number = as_int(layer_id)
        if number is None or number not in self._layer_ids:
            raise LayerKindError(
                f"{layer_id=} is not tracked by this LayerDoneCounter: {sorted(self._layer_ids)}"
            )
        return number

    def mark_done(self, layer_id: int) -> None:
        """Mark the transfer of global layer ``layer_id`` complete and wake its waiters."""
        number = self._check(layer_id)
        with self._cond:
            self._done.add(number)
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
        number = self._check(layer_id)
        with self._cond:
            return number in self._done

    def wait_until(self, layer_id: int, timeout: float | None = None) -> None:
        """Block until the transfer of global layer ``layer_id`` is complete.

        ``timeout`` overrides the counter's default with the same rules (``None`` keeps the
        default, ``math.inf`` waits forever, else a finite number of seconds >= 0);
        ``TransferTimeoutError`` on expiry.
        """
        number = self._check(layer_id)
        limit = self._timeout if timeout is None else _timeout(timeout, "wait_until timeout")
        deadline = None if limit is None else time.monotonic() + limit
        with self._cond:
            while number not in self._done:
                if deadline is None:
                    self._cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeoutError(
                        f"layer {number} was not marked done within {limit} s"
                    )
                # Condition.wait raises OverflowError above threading.TIMEOUT_MAX.
                self._cond.wait(min(remaining, threading.TIMEOUT_MAX))
