"""LayerDoneCounter refuses ids, counts and timeouts it cannot honour, instead of hanging."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from kv_pool import LayerDoneCounter
from kv_protocol import (
    KVCacheError,
    LayerKindError,
    LayoutError,
    RequestStateError,
    TransferTimeoutError,
)

BAD_TIMEOUTS: list[Any] = [math.nan, -math.inf, -1, -0.001, True, "1", [1.0], 10**400]
BAD_IDS: list[Any] = [1.0, 2.5, True, False, None, "1", [1], (1,), {1: 1}, math.nan, -1, 99]


def mark_later(counter: LayerDoneCounter, layer_id: int, delay: float = 0.05) -> threading.Thread:
    def mark() -> None:
        time.sleep(delay)
        counter.mark_done(layer_id)

    thread = threading.Thread(target=mark, daemon=True)
    thread.start()
    return thread


def bounded(call: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    """Run ``call`` in a thread for at most 2 s; what it raised (None if it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call(*args, **kwargs)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(2.0)
    assert not thread.is_alive(), f"{call.__name__}{args}{kwargs} is still waiting"
    return outcome[0]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=lambda v: repr(v)[:20])
def test_wait_until_refuses_a_timeout_it_cannot_honour(bad: Any) -> None:
    counter = LayerDoneCounter(2)
    # Refused at once: nan used to make the wait loop never expire.
    err = bounded(counter.wait_until, 1, timeout=bad)
    assert isinstance(err, RequestStateError), repr(err)
    assert "wait_until timeout must be a finite number" in str(err)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=lambda v: repr(v)[:20])
def test_the_counter_refuses_a_default_timeout_it_cannot_honour(bad: Any) -> None:
    with pytest.raises(RequestStateError, match="LayerDoneCounter timeout") as info:
        LayerDoneCounter(2, timeout=bad)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVCacheError)


def test_a_nan_default_timeout_is_refused_before_any_wait() -> None:
    with pytest.raises(RequestStateError, match="nan"):
        LayerDoneCounter(1, timeout=math.nan)


def test_inf_means_no_timeout_and_overrides_the_default() -> None:
    counter = LayerDoneCounter(3, timeout=0.01)
    mark_later(counter, 2, delay=0.1)
    counter.wait_until(2, timeout=math.inf)  # the 0.01 s default would have expired
    assert counter.is_done(2)
    forever = LayerDoneCounter(3, timeout=math.inf)
    mark_later(forever, 0)
    forever.wait_until(0)


def test_a_huge_finite_timeout_waits_instead_of_overflowing() -> None:
    # threading.Condition.wait raises OverflowError above threading.TIMEOUT_MAX.
    counter = LayerDoneCounter(2, timeout=1e300)
    mark_later(counter, 1)
    counter.wait_until(1)
    mark_later(counter, 0)
    counter.wait_until(0, timeout=float(threading.TIMEOUT_MAX) * 10)


def test_zero_and_numeric_timeouts_still_work() -> None:
    counter = LayerDoneCounter(2)
    with pytest.raises(TransferTimeoutError):
        counter.wait_until(0, timeout=0)
    with pytest.raises(TransferTimeoutError):
        counter.wait_until(0, timeout=np.float32(0.01))  # type: ignore[arg-type]
    counter.mark_done(0)
    counter.wait_until(0, timeout=0)


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_untracked_or_non_int_layer_ids_are_layer_kind_errors(bad: Any) -> None:
    counter = LayerDoneCounter(4)
    for call in (counter.wait_until, counter.mark_done, counter.is_done):
        # Bounded: wait_until(1.0) used to wait for layer 1.
        err = bounded(call, bad)
        assert isinstance(err, LayerKindError), repr(err)
        assert "is not tracked by this LayerDoneCounter" in str(err)
        assert isinstance(err, ValueError)
    # 1.0 == 1 (and True == 1): neither may mark or wait on layer 1.
    assert not counter.is_done(1)


def test_numpy_layer_ids_are_ints() -> None:
    counter = LayerDoneCounter(np.int64(3))  # type: ignore[arg-type]
    counter.mark_done(np.int32(2))  # type: ignore[arg-type]
    assert counter.is_done(2)
    counter.wait_until(np.int64(2), timeout=0)  # type: ignore[arg-type]
    assert counter.layer_ids == frozenset({0, 1, 2})


@pytest.mark.parametrize("bad", [-3, -1, 4.0, 2.5, True, math.nan, "4", None, b"ab"], ids=repr)
def test_the_counter_refuses_a_bad_layer_count_or_id_list(bad: Any) -> None:
    with pytest.raises(LayoutError, match="LayerDoneCounter layer") as info:
        LayerDoneCounter(bad)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [[0, 1.0], [0, -1], [True], ["0"], [None], [[0]]], ids=repr)
def test_the_counter_refuses_bad_ids_in_a_list(bad: list[Any]) -> None:
    with pytest.raises(LayoutError, match=r"LayerDoneCounter layer_ids\[\d\]"):
        LayerDoneCounter(bad)


def test_ids_lists_counts_and_ranges_are_accepted() -> None:
    assert LayerDoneCounter([0, 2, 5]).layer_ids == frozenset({0, 2, 5})
    assert LayerDoneCounter(range(1, 3)).layer_ids == frozenset({1, 2})
    assert LayerDoneCounter(0).layer_ids == frozenset()
