"""Input checks shared by the caches: every failure leaves the cache untouched.

Counts and sizes follow kv_protocol's one rule (``check_int``/``as_int``): an ``int`` or an
integer type with ``__index__`` (numpy's), never a ``bool`` and never a ``float``. Each check
raises the project error the caches have always raised for it: ``LayoutError`` for a size
that configures a cache, ``ShapeMismatchError`` for a count or an array that does not fit,
``CacheStateError`` for a trim the cache cannot do.
"""

from __future__ import annotations

from collections.abc import Collection

import mlx.core as mx

from kv_protocol import (
    CacheStateError,
    KVCacheError,
    LayoutError,
    ShapeMismatchError,
    as_int,
    check_int,
)

__all__ = [
    "check_choice",
    "check_count",
    "check_flag",
    "check_kv",
    "check_positive",
    "check_trim",
    "is_empty_state",
]


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def check_positive(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int >= minimum``, or a ``LayoutError`` naming ``name``."""
    return check_int(value, name, minimum=minimum, error=LayoutError)


def check_count(name: str, value: object) -> int:
    """``value`` as an ``int >= 0``, or a ``ShapeMismatchError`` naming ``name``."""
    return check_int(value, name, minimum=0, error=ShapeMismatchError)


def check_choice(
    name: str,
    value: object,
    choices: Collection[int],
    *,
    error: type[KVCacheError] = LayoutError,
) -> int:
    """``value`` as an ``int`` among ``choices`` (``8.0`` and ``True`` are refused)."""
    number = as_int(value)
    if number is None or number not in choices:
        raise error(f"{name} must be one of {tuple(choices)}, got {_describe(value)}")
    return number


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else a ``LayoutError`` naming ``name``."""
    if not isinstance(value, bool):
        raise LayoutError(f"{name} must be a bool, got {_describe(value)}")
    return value


def is_empty_state(value: object) -> bool:
    """True for the values that reset a cache's ``state``: ``None``, ``()`` and ``[]``."""
    return value is None or (isinstance(value, tuple | list) and len(value) == 0)


def check_kv(
    owner: str,
    keys: object,
    values: object,
    *,
    expect: tuple[int, int, int, int] | None = None,
    dtype: mx.Dtype | None = None,
    single_token: bool = False,
) -> tuple[mx.array, mx.array]:
    """Check new keys/values ``(B, H, S, D)`` and return them typed.

    ``expect = (B, H, D_k, D_v)`` pins the batch, head count and head dims (``None`` before
    the cache knows its geometry); ``dtype`` pins the dtype; ``single_token`` requires
    ``S == 1``. Batch, heads and head dims must be at least 1, ``S`` at least 1.
    """
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise ShapeMismatchError(
            f"{owner}: keys and values must be mlx arrays, got "
            f"{type(keys).__name__} and {type(values).__name__}"
        )
    if keys.ndim != 4 or values.ndim != 4:
        raise ShapeMismatchError(
            f"{owner}: keys and values must be 4-D (B, n_kv_heads, S, head_dim), got shapes "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise ShapeMismatchError(
            f"{owner}: keys {tuple(keys.shape)} and values {tuple(values.shape)} must agree on "
            "(B, n_kv_heads, S)"
        )
    if keys.shape[2] < 1:
        raise ShapeMismatchError(f"{owner}: expected at least one new token, got S = 0")
    if min(keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) < 1:
        raise ShapeMismatchError(
            f"{owner}: B, n_kv_heads and head_dim must be at least 1, got keys "
            f"{tuple(keys.shape)} and values {tuple(values.shape)}"
        )
    if single_token and keys.shape[2] != 1:
        raise ShapeMismatchError(
            f"{owner}: write_token takes one token (B, n_kv_heads, 1, head_dim), got S = "
            f"{keys.shape[2]}"
        )
    if keys.dtype != values.dtype:
        raise ShapeMismatchError(
            f"{owner}: keys ({keys.dtype}) and values ({values.dtype}) must share a dtype"
        )
    if expect is not None:
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != expect:
            raise ShapeMismatchError(
                f"{owner}: expected (B, n_kv_heads, head_dim_k, head_dim_v) = {expect}, got "
                f"{got} (keys {tuple(keys.shape)}, values {tuple(values.shape)})"
            )
    if dtype is not None and keys.dtype != dtype:
        raise ShapeMismatchError(f"{owner}: expected dtype {dtype}, got {keys.dtype}")
    return keys, values


def check_trim(owner: str, n: object, offset: int) -> int:
    """``n`` as an ``int`` in ``0 .. offset``, or a ``CacheStateError``."""
    count = check_int(n, f"{owner}: trim's n", error=CacheStateError)
    if count < 0 or count > offset:
        raise CacheStateError(
            f"{owner}: cannot trim {count} tokens from offset {offset}; expected 0 <= n <= {offset}"
        )
    return count
