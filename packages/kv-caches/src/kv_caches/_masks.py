"""Attention masks with the meaning mlx-lm's caches give them."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import CacheStateError, LayoutError, MaskSpec, ShapeMismatchError

__all__ = ["causal_band_mask", "make_attention_mask", "trailing_window_mask"]


def _check_mask_args(N: int, offset: int, window_size: int | None) -> None:
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ShapeMismatchError(f"N (number of new queries) must be an int >= 1, got {N!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ShapeMismatchError(f"offset must be an int >= 0, got {offset!r}")
    if window_size is not None and (
        isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1
    ):
        raise LayoutError(f"window_size must be None or an int >= 1, got {window_size!r}")


def causal_band_mask(N: int, offset: int, window_size: int | None = None) -> mx.array:
    """Boolean keep-mask ``(N, offset + N)`` for ``N`` queries after ``offset`` cached keys.

    Query ``i`` sits at key index ``offset + i``; it keeps key ``j`` when ``j <= offset + i``
    and, with a window, ``j > offset + i - window_size`` (``window_size`` keys, itself
    included).
    """
    _check_mask_args(N, offset, window_size)
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
    _check_mask_args(N, offset, window_size)
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
    _check_mask_args(N, offset, window_size)
    kept = min(offset, window - 1)
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
