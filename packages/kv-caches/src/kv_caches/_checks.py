"""Input checks shared by the caches: every failure leaves the cache untouched."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import CacheStateError, LayoutError, ShapeMismatchError

__all__ = ["check_count", "check_kv", "check_positive", "check_trim"]


def check_positive(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int >= minimum``, or a ``LayoutError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LayoutError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_count(name: str, value: object) -> int:
    """``value`` as an ``int >= 0``, or a ``ShapeMismatchError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShapeMismatchError(f"{name} must be an int >= 0, got {value!r}")
    return value


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
    ``S == 1``.
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
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheStateError(f"{owner}: trim takes an int, got {n!r}")
    if n < 0 or n > offset:
        raise CacheStateError(
            f"{owner}: cannot trim {n} tokens from offset {offset}; expected 0 <= n <= {offset}"
        )
    return n
