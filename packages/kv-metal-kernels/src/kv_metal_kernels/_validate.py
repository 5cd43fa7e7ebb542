"""Argument checks shared by every backend; they run before any work is queued."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import RopeConfig, ShapeMismatchError

__all__ = [
    "FLOAT_DTYPES",
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
        raise ShapeMismatchError(f"positions must be >= 0, got minimum {int(mx.min(positions))}")


def check_paged_attention_args(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    page_table: mx.array,
    seq_lens: mx.array,
    page_size: int,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
) -> None:
    """Check shapes and dtypes of a paged decode attention call (no device sync)."""
    for name, x in (
        ("q", q),
        ("k_pool", k_pool),
        ("v_pool", v_pool),
        ("page_table", page_table),
        ("seq_lens", seq_lens),
    ):
        _require_array(name, x)
    if q.ndim != 4 or q.shape[2] != 1:
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
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ShapeMismatchError(f"page_size must be an int >= 1, got {page_size!r}")
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
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ShapeMismatchError(f"scale must be a float, got {scale!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ShapeMismatchError(f"window must be None or an int >= 1, got {window!r}")
    if sinks is not None:
        _require_array("sinks", sinks)
        if sinks.ndim != 1 or sinks.shape[0] != hq:
            raise ShapeMismatchError(
                f"sinks must have one logit per query head: expected ({hq},), "
                f"got {tuple(sinks.shape)}"
            )
        _require_float("sinks", sinks)


def check_paged_attention_values(
    page_table: mx.array, seq_lens: mx.array, page_size: int, num_slots: int
) -> None:
    """Check index *values* (a device sync, so only in validate mode)."""
    if seq_lens.size == 0:
        return
    lo = int(mx.min(seq_lens))
    if lo < 1:
        raise ShapeMismatchError(
            f"seq_lens must be >= 1 (they include the token being decoded), got {lo}"
        )
    hi = int(mx.max(seq_lens))
    capacity = page_table.shape[1] * page_size
    if hi > capacity:
        raise ShapeMismatchError(
            f"seq_len {hi} needs more pages than the page table's {page_table.shape[1]} "
            f"columns of {page_size} tokens"
        )
    num_pages = num_slots // page_size
    pmin = int(mx.min(page_table))
    pmax = int(mx.max(page_table))
    if pmin < 0 or pmax >= num_pages:
        raise ShapeMismatchError(
            f"page_table entries must lie in 0 .. {num_pages - 1}, got {pmin} .. {pmax}"
        )
