"""Writing token rows into head-major, slot-addressed pools without a device sync."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["scatter_token_rows"]


def scatter_token_rows(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """Return ``pool`` with ``rows[t]`` written at column ``slots[t]``.

    ``pool`` is ``(H, num_slots, D)``, ``rows`` is token-major ``(T, H, D)`` and ``slots``
    is int32 ``(T,)``. A slot outside ``0 .. num_slots - 1`` (negative = "do not write")
    writes nothing, so an out-of-range slot can never write out of bounds. The result is a
    new array in MLX's functional sense; MLX performs the scatter in place when ``pool`` is
    not referenced elsewhere by the time the graph runs.
    """
    num_slots = pool.shape[1]
    t = slots.shape[0]
    if t == 0:
        return pool
    rows = rows.astype(pool.dtype)
    valid = (slots >= 0) & (slots < num_slots)
    target = mx.where(valid, slots, 0)
    # Tokens that must not write are redirected to column 0 and write back the value column 0
    # has to end with. All such writes carry identical bits, so the order in which the
    # scatter applies duplicates cannot matter. If a real token also writes column 0 (only
    # possible when the caller ignores the null-page convention), the last such token wins,
    # and the redirected writes carry its row too.
    hits0 = valid & (slots == 0)
    last_hit = (t - 1) - mx.argmax(hits0[::-1].astype(mx.int32))
    col0 = mx.where(mx.any(hits0), rows[last_hit], pool[:, 0, :])
    values = mx.where(valid[:, None, None], rows, col0[None])
    return mx.put_along_axis(pool, target[None, :, None], values.swapaxes(0, 1), axis=1)
