"""One validation rule for the ids, counts, sizes and numbers every kv-* entry point takes.

An id, count or size is an ``int`` (or an integer type with ``__index__``, such as numpy's),
never a ``bool`` and never a ``float`` (``8.0`` is refused: silently truncating ``1.7`` to
``1`` or naming a sub-pool ``sliding-w8.0`` is worse than an error). A number (temperature,
top-p, a timeout) is a real, finite ``int`` or ``float`` (or another real number type, such as
numpy's ``float32``), not a ``bool``. Each check raises
the project error the caller names, so ``except KVCacheError`` and the builtin the error
derives from (``ValueError`` for most) both catch it.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import NoReturn

from ._errors import KVCacheError, RequestStateError

__all__ = ["as_int", "check_int", "check_int_sequence", "check_number", "is_int"]


def as_int(value: object) -> int | None:
    """``value`` as a plain ``int`` if it is an integer (not a bool, not a float), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float | complex | str | bytes):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def is_int(value: object) -> bool:
    """True if ``value`` is an integer id or count (not a bool, not a float)."""
    return as_int(value) is not None


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in {minimum}..{maximum}"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def _fail(error: type[KVCacheError], message: str) -> NoReturn:
    raise error(message)


def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[KVCacheError] = RequestStateError,
) -> int:
    """Return ``value`` as an ``int`` within ``minimum..maximum`` or raise ``error``.

    The message names ``what`` and the range expected, e.g. ``"max_tokens must be an int >=
    1, got 0.5 (float)"``.
    """
    number = as_int(value)
    if (
        number is None
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
    ):
        _fail(error, f"{what} must be {_range_text(minimum, maximum)}, got {_describe(value)}")
    return number


def check_int_sequence(
    values: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[KVCacheError] = RequestStateError,
) -> list[int]:
    """Return ``values`` (an iterable of ints, not a string) as a list of checked ints.

    The first bad element is named with its index: ``"prompt_tokens[3] must be an int in
    0..31, got 40 (int)"``.
    """
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        _fail(error, f"{what} must be a sequence of ints, got {_describe(values)}")
    out: list[int] = []
    for index, value in enumerate(values):
        out.append(
            check_int(value, f"{what}[{index}]", minimum=minimum, maximum=maximum, error=error)
        )
    return out


def check_number(
    value: object,
    what: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    error: type[KVCacheError] = RequestStateError,
) -> float:
    """Return ``value`` as a finite ``float`` within the bounds or raise ``error``.

    ``min_inclusive=False`` makes the lower bound strict (``top_p`` in ``(0, 1]``).
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    try:
        number = float(value) if ok else math.nan  # type: ignore[arg-type]
    except OverflowError:  # an int too large for a float
        number = math.inf
    # Compare an int exactly: float(2**53 + 1) rounds down and would fail a bound it meets.
    exact: float = value if ok and isinstance(value, int) else number
    low_ok = minimum is None or (exact >= minimum if min_inclusive else exact > minimum)
    high_ok = maximum is None or exact <= maximum
    if not ok or not math.isfinite(number) or not low_ok or not high_ok:
        if minimum is not None and maximum is not None:
            bracket = "[" if min_inclusive else "("
            expected = f"a finite number in {bracket}{minimum}, {maximum}]"
        elif minimum is not None:
            expected = f"a finite number {'>=' if min_inclusive else '>'} {minimum}"
        elif maximum is not None:
            expected = f"a finite number <= {maximum}"
        else:
            expected = "a finite number"
        _fail(error, f"{what} must be {expected}, got {_describe(value)}")
    return number
