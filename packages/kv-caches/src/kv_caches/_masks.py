"""Attention masks with the meaning mlx-lm's caches give them."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import (
    CacheStateError,
    KVLifetime,
    LayoutError,
    MaskSpec,
    ShapeMismatchError,
    check_int,
)

from ._checks import check_count, check_flag

__all__ = ["causal_band_mask", "make_attention_mask", "trailing_window_mask"]


def _check_mask_args(
    N: object, offset: object, window_size: object, return_array: object = False
) -> tuple[int, int, int | None]:
    """``(N, offset, window_size)`` as ints, every argument checked before any is used."""
    n_queries = check_int(N, "N (number of new queries)", minimum=1, error=ShapeMismatchError)
    start = check_count("offset", offset)
    window = (
        None
        if window_size is None
        else check_int(window_size, "window_size", minimum=1, error=LayoutError)
    )
    check_flag("return_array", return_array)
    return n_queries, start, window


def causal_band_mask(N: int, offset: int, window_size: int | None = None) -> mx.array:
    """Boolean keep-mask ``(N, offset + N)`` for ``N`` queries after ``offset`` cached keys.

    Query ``i`` sits at key index ``offset + i``; it keeps key ``j`` when ``j <= offset + i``
    and, with a window, ``j > offset + i - window_size`` (``window_size`` keys, itself
    included).
    """
    N, offset, window_size = _check_mask_args(N, offset, window_size)
    queries = mx.arange(offset, offset + N)[:, None]
    keys = mx.arange(offset + N)[None]
    mask = queries >= keys
    if window_size is not None:
        mask = mask & (queries < keys + window_size)
    return mask


def make_attention_mask(
    N: int, offset: int, return_array: bool = False, window_size: int | None = None
) -> MaskSpec:
    """The mask mlx-lm's own (non-rotating) caches give for ``N`` queries at ``offset``.

    With ``window_size`` it is always the banded boolean array ``(N, offset + N)``; without
    one it is ``None`` for a single query, the causal array when ``return_array`` is set, and
    the string ``"causal"`` (mlx's fused causal path) otherwise.
    """
    N, offset, window_size = _check_mask_args(N, offset, window_size, return_array)
    if window_size is not None:
        return causal_band_mask(N, offset, window_size)
    if N == 1:
        return None
    if return_array:
        return causal_band_mask(N, offset)
    return "causal"


def trailing_window_mask(
    N: int,
    offset: int,
    window: int,
    return_array: bool,
    window_size: int | None,
    *,
    owner: str,
) -> MaskSpec:
    """The mask for a cache that returns only the keys a ``window``-wide band needs.

    Such a cache returns ``kept + N`` keys, ``kept = min(offset, window - 1)``, so the mask is
    built relative to the first returned key. ``"causal"`` / ``None`` are returned only when
    they admit exactly the keys the band would (every returned key within reach of every
    query). ``owner`` names the cache in the error raised when a full-context mask (or a
    window wider than the cache's) is asked for after older keys were dropped.
    """
    N, offset, window_size = _check_mask_args(N, offset, window_size, return_array)
    kept = KVLifetime(window).kept_before(offset)
    dropped = offset > kept
    if dropped and window_size is None:
        raise CacheStateError(
            f"{owner} holds only the trailing window and cannot serve a full-context attention mask"
        )
    if dropped and window_size is not None and window_size > window:
        raise CacheStateError(
            f"{owner} holds only the trailing window of {window} tokens and cannot serve an "
            f"attention mask with the wider window_size={window_size}"
        )
    if return_array or (window_size is not None and kept + N > window_size):
        return causal_band_mask(N, kept, window_size)
    if N == 1:
        return None
    return "causal"
