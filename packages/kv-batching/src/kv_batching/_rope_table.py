"""RoPE of a prefill chunk from one table of cosines and sines shared by the model's layers.

On MLX's CPU backend ``mx.fast.rope`` is composed from operations, and its cosines and
sines run element by element: for Gemma 3 270M's 512-token chunk the RoPE of q and k took
120 ms over 18 layers (about a tenth of the chunk), although every layer of one kind
rotates the same positions by the same angles. :func:`rope_chunk` takes the angles' cosines
and sines once per chunk (from ``mx.fast.rope`` itself, applied to a probe, so they are its
own values bit for bit) and applies the same arithmetic ``mx.fast.rope`` applies: the result
is bit-identical, at 50 ms for those 18 layers.
"""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import RopeConfig

__all__ = ["rope_chunk", "rope_row_factors", "rope_rows"]

#: How many (config, offset, length, dtype) tables are kept: a forward's layer kinds.
_KEPT = 4
_tables: dict[tuple[RopeConfig, int, int, mx.Dtype], tuple[mx.array, mx.array]] = {}


_row_tables: dict[tuple[RopeConfig, mx.Dtype], tuple[mx.array, tuple[mx.array, mx.array]]] = {}
#: ``([cos, cos], [-sin, sin])`` of the step's ``offsets`` per (config, dtype, head count).
_row_factors: dict[
    tuple[RopeConfig, mx.Dtype, int], tuple[mx.array, tuple[mx.array, mx.array]]
] = {}
#: ``([cos, cos], [-sin, sin])``, each ``(B, dims)``, of the step's ``offsets`` per (config, dtype).
_flat_factors: dict[tuple[RopeConfig, mx.Dtype], tuple[mx.array, tuple[mx.array, mx.array]]] = {}


def _angles(
    rope: RopeConfig, lead: tuple[int, int, int], offset: int | mx.array, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """``(cos, sin)``, each ``(*lead, dims // 2)``, as ``mx.fast.rope`` computes them.

    A probe whose rotated halves are 1 and 0 comes out of ``mx.fast.rope`` as ``cos`` and
    ``sin`` exactly (``1 * c - 0 * s`` and ``1 * s + 0 * c``).
    """
    half = rope.dims // 2
    ones, zeros = mx.ones((*lead, half), dtype=dtype), mx.zeros((*lead, half), dtype=dtype)
    if rope.traditional:
        probe = mx.stack([ones, zeros], axis=-1).reshape(*lead, rope.dims)
    else:
        probe = mx.concatenate([ones, zeros], axis=-1)
    rotated = mx.fast.rope(
        probe,
        rope.dims,
        traditional=rope.traditional,
        base=rope.base,
        scale=rope.scale,
        offset=offset,
    )
    if rope.traditional:
        pairs = rotated.reshape(*lead, half, 2)
        return pairs[..., 0], pairs[..., 1]
    return rotated[..., :half], rotated[..., half:]


def _table(
    rope: RopeConfig, offset: int, length: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """``(cos, sin)``, each ``(length, dims // 2)`` in ``dtype``, for positions from ``offset``."""
    key = (rope, offset, length, dtype)
    held = _tables.get(key)
    if held is not None:
        return held
    cos, sin = _angles(rope, (1, 1, length), offset, dtype)
    table = (cos[0, 0], sin[0, 0])
    mx.eval(table)
    if len(_tables) >= _KEPT:
        del _tables[next(iter(_tables))]
    _tables[key] = table
    return table


def _rows_table(rope: RopeConfig, offsets: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """``(cos, sin)``, each ``(B, 1, 1, dims // 2)``, at row ``b``'s position ``offsets[b]``.

    Kept for the step's ``offsets`` object (every layer of a decode step passes the same
    one).
    """
    key = (rope, dtype)
    held = _row_tables.get(key)
    if held is not None and held[0] is offsets:
        return held[1]
    table = _angles(rope, (offsets.shape[0], 1, 1), offsets, dtype)
    if len(_row_tables) >= _KEPT:
        del _row_tables[next(iter(_row_tables))]
    _row_tables[key] = (offsets, table)
    return table


def rope_rows(x: mx.array, offsets: mx.array, rope: RopeConfig) -> mx.array:
    """``mx.fast.rope(x, ..., offset=offsets)`` of ``x (B, H, 1, D)``: row ``b`` at ``offsets[b]``.

    A decode step's rotation: bit-identical to ``mx.fast.rope`` on MLX's CPU backend, with
    the cosines and sines of the step's positions computed once for all its layers (their
    ``offsets`` is one array object) instead of once per layer, query and key. A rotation
    of the whole head in halves (not ``traditional``) is ``x * [cos, cos] + [x2, x1] *
    [-sin, sin]``, with those two factors made once per step and head count: six
    operations a call instead of thirteen (``a + x2 * -sin`` is ``a - x2 * sin`` exactly).
    """
    flat = None if rope.dims != x.shape[-1] else rope_row_factors(offsets, rope, x.dtype)
    if flat is None:
        cos, sin = _rows_table(rope, offsets, x.dtype)
        return _rotate(x, cos, sin, rope)
    key = (rope, x.dtype, x.shape[1])
    held = _row_factors.get(key)
    if held is None or held[0] is not offsets:
        rows, shape = x.shape[0], (x.shape[0], x.shape[1], 1, rope.dims)
        factors = (
            mx.contiguous(mx.broadcast_to(flat[0].reshape(rows, 1, 1, rope.dims), shape)),
            mx.contiguous(mx.broadcast_to(flat[1].reshape(rows, 1, 1, rope.dims), shape)),
        )
        if len(_row_factors) >= _KEPT:
            del _row_factors[next(iter(_row_factors))]
        held = _row_factors[key] = (offsets, factors)
    cos_both, sin_signed = held[1]
    half = rope.dims // 2
    swapped = mx.concatenate([x[..., half:], x[..., :half]], axis=-1)
    return x * cos_both + swapped * sin_signed


def rope_row_factors(
    offsets: mx.array, rope: RopeConfig, dtype: mx.Dtype
) -> tuple[mx.array, mx.array] | None:
    """``([cos, cos], [-sin, sin])``, each ``(B, dims)``, at row ``b``'s position ``offsets[b]``.

    The factors of :func:`rope_rows`' rotation in halves (``kv_protocol.NormRopeKernel``'s
    form), made once per step (``offsets`` object); ``None`` for a RoPE that does not rotate
    whole heads in halves (``traditional``; the caller checks ``dims`` against its heads).
    """
    if rope.traditional:
        return None
    key = (rope, dtype)
    held = _flat_factors.get(key)
    if held is not None and held[0] is offsets:
        return held[1]
    cos, sin = _rows_table(rope, offsets, dtype)
    rows = offsets.shape[0]
    factors = (
        mx.concatenate([cos, cos], axis=-1).reshape(rows, rope.dims),
        mx.concatenate([-sin, sin], axis=-1).reshape(rows, rope.dims),
    )
    if len(_flat_factors) >= _KEPT:
        del _flat_factors[next(iter(_flat_factors))]
    _flat_factors[key] = (offsets, factors)
    return factors


def rope_chunk(x: mx.array, offset: int, rope: RopeConfig) -> mx.array:
    """``mx.fast.rope(x, ...)`` of ``x (B, H, T, D)`` at positions ``offset .. offset + T - 1``.

    Bit-identical to ``mx.fast.rope`` on MLX's CPU backend (which composes it from the same
    operations), with the cosines and sines of a ``(rope, offset, T, dtype)`` computed once.
    """
    cos, sin = _table(rope, offset, x.shape[2], x.dtype)
    return _rotate(x, cos, sin, rope)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, rope: RopeConfig) -> mx.array:
    """The arithmetic ``mx.fast.rope`` applies, with its cosines and sines given."""
    dims, half = rope.dims, rope.dims // 2
    if rope.traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
    first = x1 * cos - x2 * sin
    second = x1 * sin + x2 * cos
    if rope.traditional:
        rotated = mx.stack([first, second], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        rotated = mx.concatenate([first, second], axis=-1)
    if dims < x.shape[-1]:
        rotated = mx.concatenate([rotated, x[..., dims:]], axis=-1)
    return rotated
