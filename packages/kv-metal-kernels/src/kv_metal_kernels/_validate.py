"""Argument checks shared by every backend; they run before any work is queued.

Error types follow the pool's: a wrong rank, shape, dtype or geometry argument is a
:class:`kv_protocol.ShapeMismatchError`; a bad index *value* (a page id outside the pool, a
``seq_len`` the page table cannot hold, a slot past the pool end or written twice, a negative
position) is a :class:`kv_protocol.RequestStateError`, as ``HybridKVPool.set_kv`` raises for
bad slot values. Both are ``ValueError``.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from kv_protocol import (
    KVBuffer,
    QuantizedKV,
    RequestStateError,
    RopeConfig,
    ShapeMismatchError,
    as_int,
    check_int,
    check_number,
    check_quantized_shape,
)

from ._memo import IdentityMemo

__all__ = [
    "FLOAT_DTYPES",
    "PagedIndexCheck",
    "check_paged_attention_args",
    "check_paged_attention_values",
    "check_rope_scatter_args",
    "check_rope_scatter_values",
]

#: The floating dtypes every kernel accepts for q, k, v and the pools.
FLOAT_DTYPES: tuple[mx.Dtype, ...] = (mx.float16, mx.bfloat16, mx.float32)


def _is_array(x: object) -> bool:
    return isinstance(x, mx.array)


def _require_array(name: str, x: object) -> mx.array:
    if not _is_array(x):
        raise ShapeMismatchError(f"{name} must be an mx.array, got {type(x).__name__}")
    assert isinstance(x, mx.array)
    return x


def _require_float(name: str, x: mx.array) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ShapeMismatchError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def check_rope_scatter_args(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    positions: mx.array,
    slots: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    rope: RopeConfig,
) -> None:
    """Check shapes and dtypes of a RoPE + pool-scatter call (no device sync).

    Raises :class:`kv_protocol.ShapeMismatchError` saying what was wrong and what was
    expected; nothing is computed or written before the checks pass.
    """
    if not isinstance(rope, RopeConfig):
        raise ShapeMismatchError(f"rope must be a kv_protocol.RopeConfig, got {rope!r}")
    names = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
    arrays = (q, k, v, positions, slots, k_pool, v_pool)
    for name, x in zip(names, arrays, strict=True):
        _require_array(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ShapeMismatchError(
                f"{name} must be 3-D (tokens, heads, head_dim), got shape {tuple(x.shape)}"
            )
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool)):
        if x.ndim != 3:
            raise ShapeMismatchError(
                f"{name} must be 3-D (n_kv_heads, num_slots, head_dim), got shape {tuple(x.shape)}"
            )
    t, hq, d = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ShapeMismatchError(
            f"v shape must match k shape, got v {tuple(v.shape)} vs k {tuple(k.shape)}"
        )
    tk, hkv, dk = k.shape
    if tk != t:
        raise ShapeMismatchError(f"q and k must have the same token count, got {t} and {tk}")
    if dk != d:
        raise ShapeMismatchError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hq % hkv:
        raise ShapeMismatchError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    for name, x in (("positions", positions), ("slots", slots)):
        if x.dtype != mx.int32:
            raise ShapeMismatchError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != 1 or x.shape[0] != t:
            raise ShapeMismatchError(
                f"{name} must have one entry per token: expected shape ({t},), got {tuple(x.shape)}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_float(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise ShapeMismatchError(
            f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if tuple(k_pool.shape) != tuple(v_pool.shape):
        raise ShapeMismatchError(
            f"k_pool and v_pool must have the same shape, got {tuple(k_pool.shape)} and "
            f"{tuple(v_pool.shape)}"
        )
    if k_pool.shape[0] != hkv or k_pool.shape[2] != d:
        raise ShapeMismatchError(
            f"pool shape {tuple(k_pool.shape)} does not match k: expected ({hkv}, num_slots, {d})"
        )
    if k_pool.dtype != k.dtype or v_pool.dtype != k.dtype:
        raise ShapeMismatchError(
            f"pool dtypes must match q/k/v dtype {k.dtype}, got {k_pool.dtype} and {v_pool.dtype}"
        )
    if rope.dims > d:
        raise ShapeMismatchError(f"rope dims ({rope.dims}) must be <= head_dim ({d})")
    if d % 2:
        raise ShapeMismatchError(f"head_dim must be even, got {d}")


def check_rope_scatter_values(positions: mx.array) -> None:
    """Check that positions are >= 0 (reads them back: a device sync, validate mode only)."""
    if positions.size and int(mx.min(positions)) < 0:
        raise RequestStateError(f"positions must be >= 0, got minimum {int(mx.min(positions))}")


def check_paged_attention_args(
    q: mx.array,
    k_pool: KVBuffer,
    v_pool: KVBuffer,
    page_table: mx.array,
    seq_lens: mx.array,
    page_size: int,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
    *,
    queries: bool = False,
) -> tuple[int, float, int | None]:
    """Check shapes and dtypes of a paged decode attention call (no device sync).

    ``q`` is ``(batch, q_heads, 1, head_dim)``, or with ``queries`` any number ``>= 1`` of
    queries per request. Returns ``(page_size, scale, window)`` as plain ``int`` /
    ``float`` / ``int | None``.
    """
    for name, x in (
        ("q", q),
        ("k_pool", k_pool),
        ("v_pool", v_pool),
        ("page_table", page_table),
        ("seq_lens", seq_lens),
    ):
        if isinstance(x, QuantizedKV):
            check_quantized_shape(x, name)
        else:
            _require_array(name, x)
    if queries:
        if q.ndim != 4 or q.shape[2] < 1:
            raise ShapeMismatchError(
                f"q must be (batch, q_heads, queries, head_dim) with at least one query, got "
                f"shape {tuple(q.shape)}"
            )
    elif q.ndim != 4 or q.shape[2] != 1:
        raise ShapeMismatchError(
            f"q must be (batch, q_heads, 1, head_dim) for decode, got shape {tuple(q.shape)}"
        )
    b, hq, _, d = q.shape
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool)):
        if x.ndim != 3:
            raise ShapeMismatchError(
                f"{name} must be 3-D (n_kv_heads, num_slots, head_dim), got shape {tuple(x.shape)}"
            )
    if tuple(k_pool.shape) != tuple(v_pool.shape):
        raise ShapeMismatchError(
            f"k_pool and v_pool must have the same shape, got {tuple(k_pool.shape)} and "
            f"{tuple(v_pool.shape)}"
        )
    hkv, num_slots, dk = k_pool.shape
    if dk != d:
        raise ShapeMismatchError(f"pool head_dim {dk} does not match q head_dim {d}")
    if hq % hkv:
        raise ShapeMismatchError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    _require_float("q", q)
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise ShapeMismatchError(
            f"q and the pools must share one dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    page_size = check_int(page_size, "page_size", minimum=1, error=ShapeMismatchError)
    if num_slots % page_size:
        raise ShapeMismatchError(
            f"pool slots ({num_slots}) must be a whole number of pages of {page_size}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ShapeMismatchError(
            f"page_table must be (batch={b}, max_pages), got shape {tuple(page_table.shape)}"
        )
    if page_table.shape[1] < 1:
        raise ShapeMismatchError("page_table must have at least one column")
    if page_table.dtype != mx.int32:
        raise ShapeMismatchError(f"page_table must be int32, got {page_table.dtype}")
    if seq_lens.dtype != mx.int32:
        raise ShapeMismatchError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if seq_lens.ndim != 1 or seq_lens.shape[0] != b:
        raise ShapeMismatchError(
            f"seq_lens must have one entry per request: expected ({b},), "
            f"got {tuple(seq_lens.shape)}"
        )
    scale = check_number(scale, "scale", error=ShapeMismatchError)
    if window is not None:
        checked_window = as_int(window)
        if checked_window is None or checked_window < 1:
            raise ShapeMismatchError(f"window must be None or an int >= 1, got {window!r}")
        window = checked_window
    if sinks is not None:
        _require_array("sinks", sinks)
        if sinks.ndim != 1 or sinks.shape[0] != hq:
            raise ShapeMismatchError(
                f"sinks must have one logit per query head: expected ({hq},), "
                f"got {tuple(sinks.shape)}"
            )
        _require_float("sinks", sinks)
    return page_size, scale, window


def _value_ranges(arrays: list[mx.array]) -> list[tuple[int, int]]:
    """``(min, max)`` of each array, from one reduction and one host read (a device sync)."""
    stats = mx.stack([r for x in arrays for r in (mx.min(x), mx.max(x))])
    flat = cast(list[int], stats.tolist())
    return [(int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(len(arrays))]


def _check_lens(lo: int, hi: int, page_table: mx.array, page_size: int) -> None:
    if lo < 1:
        raise RequestStateError(
            f"seq_lens must be >= 1 (they include the token being decoded), got {lo}"
        )
    capacity = page_table.shape[1] * page_size
    if hi > capacity:
        raise RequestStateError(
            f"seq_len {hi} needs more pages than the page table's {page_table.shape[1]} "
            f"columns of {page_size} tokens"
        )


def _check_pages(lo: int, hi: int, num_pages: int) -> None:
    if lo < 0 or hi >= num_pages:
        raise RequestStateError(
            f"page_table entries must lie in 0 .. {num_pages - 1} (the pool has {num_pages} "
            f"pages), got {lo} .. {hi}"
        )


def check_paged_attention_values(
    page_table: mx.array, seq_lens: mx.array, page_size: int, num_slots: int
) -> None:
    """Check index *values*: every page id a page of the pool, every length servable.

    Page ids must lie in ``0 .. num_slots // page_size - 1`` (page 0, the null page, is
    allowed: padding points to it) and each ``seq_len`` in ``1 .. max_pages * page_size``.
    Raises :class:`kv_protocol.RequestStateError`. One fused min/max reduction read back to
    the host (a small device sync); :class:`PagedIndexCheck` does it once per array object.
    """
    if seq_lens.size == 0:
        return
    (pmin, pmax), (lo, hi) = _value_ranges([page_table, seq_lens])
    _check_lens(lo, hi, page_table, page_size)
    _check_pages(pmin, pmax, num_slots // page_size)


class PagedIndexCheck:
    """The page-id and ``seq_lens`` value checks of paged attention, once per array object.

    An out-of-range page id makes the gather (or a native kernel) read outside the pool,
    which can crash the process, so every backend checks values before any work. Batched
    decode hands every layer of a step the same ``seq_lens`` object and one page-table
    object per sub-pool, so the check (one fused min/max reduction and a host read) runs
    once per step and sub-pool, not once per layer. Like the plans, it trusts that an array
    already checked is not written in place afterwards; ``every_call=True`` checks anyway.
    A failed check is never remembered.
    """

    def __init__(self) -> None:
        self._tables: IdentityMemo[bool] = IdentityMemo()
        self._lens: IdentityMemo[bool] = IdentityMemo()

    def clear(self) -> None:
        """Forget every array checked so far."""
        self._tables.clear()
        self._lens.clear()

    def __call__(
        self,
        page_table: mx.array,
        seq_lens: mx.array,
        page_size: int,
        num_slots: int,
        *,
        every_call: bool = False,
    ) -> None:
        """Raise :class:`kv_protocol.RequestStateError` for a bad page id or length."""
        if seq_lens.size == 0:
            return
        num_pages = num_slots // page_size
        capacity = page_table.shape[1] * page_size
        todo: list[mx.array] = []
        table_known = not every_call and self._tables.get(page_table, num_pages) is not None
        lens_known = not every_call and self._lens.get(seq_lens, capacity) is not None
        if not lens_known:
            todo.append(seq_lens)
        if not table_known:
            todo.append(page_table)
        if not todo:
            return
        ranges = _value_ranges(todo)
        if not lens_known:
            _check_lens(*ranges[0], page_table, page_size)
        if not table_known:
            _check_pages(*ranges[-1], num_pages)
        if not lens_known:
            self._lens.put(seq_lens, capacity, True)
        if not table_known:
            self._tables.put(page_table, num_pages, True)
