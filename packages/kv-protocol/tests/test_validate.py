from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_protocol import (
    KVCacheError,
    LayoutError,
    RequestStateError,
    ShapeMismatchError,
    UnsupportedModelError,
    as_int,
    check_int,
    check_int_sequence,
    check_number,
    is_int,
)

ERRORS = st.sampled_from(
    [RequestStateError, LayoutError, ShapeMismatchError, UnsupportedModelError]
)


def _stable_id(value: object) -> str:
    """A test id that is the same in every process (a bare object's repr holds its address)."""
    return "object()" if type(value) is object else repr(value)


#: Values that are never an int id or count.
NOT_INTS: list[Any] = [
    8.0,
    1.5,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    "8",
    b"8",
    None,
    [1],
    (1,),
    {1: 1},
    object(),
    np.float32(8.0),
    np.float64(8.0),
    np.bool_(True),
    complex(8, 0),
]
NOT_NUMBERS: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    "1.0",
    None,
    [1.0],
    complex(1, 0),
    np.float64(math.nan),
    10**400,
]


@st.composite
def int_in_range(draw: st.DrawFn) -> tuple[int, int | None, int | None]:
    value = draw(st.integers(min_value=-(10**30), max_value=10**30))
    low = draw(st.none() | st.integers(max_value=value))
    high = draw(st.none() | st.integers(min_value=value))
    return value, low, high


@given(int_in_range(), ERRORS)
def test_any_int_in_range_passes_and_round_trips(
    case: tuple[int, int | None, int | None], error: type[KVCacheError]
) -> None:
    value, low, high = case
    out = check_int(value, "count", minimum=low, maximum=high, error=error)
    assert out == value
    assert type(out) is int
    assert as_int(value) == value
    assert is_int(value)


@given(st.integers(min_value=-(2**62), max_value=2**62))
def test_numpy_integers_are_ints(value: int) -> None:
    out = check_int(np.int64(value), "layer_id")
    assert out == value
    assert type(out) is int


@pytest.mark.parametrize("bad", NOT_INTS, ids=_stable_id)
@pytest.mark.parametrize("error", [RequestStateError, LayoutError, ShapeMismatchError])
def test_non_ints_are_refused_with_the_named_error(bad: Any, error: type[KVCacheError]) -> None:
    assert as_int(bad) is None
    assert not is_int(bad)
    with pytest.raises(error) as info:
        check_int(bad, "page_size of sub-pool 'full'", error=error)
    assert "page_size of sub-pool 'full'" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVCacheError)


@given(st.integers(), st.integers(min_value=1, max_value=10**6), ERRORS)
def test_ints_out_of_range_are_refused(value: int, span: int, error: type[KVCacheError]) -> None:
    with pytest.raises(error, match="window"):
        check_int(value, "window", minimum=value + 1, error=error)
    with pytest.raises(error, match="window"):
        check_int(value, "window", maximum=value - 1, error=error)
    with pytest.raises(error, match="window"):
        check_int(value, "window", minimum=value + span, maximum=value + 2 * span, error=error)


def test_the_default_error_is_request_state_error() -> None:
    with pytest.raises(RequestStateError, match=r"max_tokens must be an int >= 1, got 0"):
        check_int(0, "max_tokens", minimum=1)


@given(st.lists(st.integers(min_value=0, max_value=31), max_size=20))
def test_int_sequences_round_trip(values: list[int]) -> None:
    assert check_int_sequence(values, "prompt_tokens", minimum=0, maximum=31) == values
    assert check_int_sequence(tuple(values), "prompt_tokens") == values


@given(
    st.lists(st.integers(min_value=0, max_value=31), max_size=10),
    st.sampled_from(NOT_INTS),
    st.integers(min_value=0, max_value=10),
)
def test_a_bad_element_is_named_with_its_index(values: list[int], bad: Any, where: int) -> None:
    where = min(where, len(values))
    items: list[Any] = [*values[:where], bad, *values[where:]]
    with pytest.raises(LayoutError) as info:
        check_int_sequence(items, "prompt_tokens", error=LayoutError)
    assert f"prompt_tokens[{where}]" in str(info.value)


@pytest.mark.parametrize("bad", ["1,2", b"12", None, 5, 1.0, object()], ids=_stable_id)
def test_non_sequences_are_refused(bad: Any) -> None:
    with pytest.raises(ShapeMismatchError, match="slots must be a sequence of ints"):
        check_int_sequence(bad, "slots", error=ShapeMismatchError)


@given(
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
    | st.integers(min_value=-(10**30), max_value=10**30)
)
def test_any_finite_number_passes_and_round_trips(value: float) -> None:
    out = check_number(value, "temperature")
    assert out == float(value)
    assert type(out) is float
    assert check_number(value, "temperature", minimum=value, maximum=value) == float(value)


@pytest.mark.parametrize("bad", NOT_NUMBERS, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("error", [RequestStateError, LayoutError])
def test_non_numbers_and_non_finite_numbers_are_refused(
    bad: Any, error: type[KVCacheError]
) -> None:
    with pytest.raises(error) as info:
        check_number(bad, "timeout", error=error)
    assert "timeout must be a finite number" in str(info.value)


def test_numpy_floats_are_numbers() -> None:
    assert check_number(np.float32(0.5), "top_p") == 0.5
    assert check_number(np.float64(0.25), "top_p") == 0.25


def test_number_bounds() -> None:
    assert check_number(1.0, "top_p", minimum=0.0, maximum=1.0, min_inclusive=False) == 1.0
    with pytest.raises(RequestStateError, match=r"top_p must be a finite number in \(0.0, 1.0\]"):
        check_number(0.0, "top_p", minimum=0.0, maximum=1.0, min_inclusive=False)
    with pytest.raises(RequestStateError, match="timeout must be a finite number >= 0"):
        check_number(-0.5, "timeout", minimum=0)
    with pytest.raises(RequestStateError, match="must be a finite number <= 2"):
        check_number(3, "temperature", maximum=2)


def test_long_values_are_shortened_in_the_message() -> None:
    with pytest.raises(RequestStateError) as info:
        check_int("x" * 500, "request_id")
    assert len(str(info.value)) < 200
    assert "(str)" in str(info.value)
