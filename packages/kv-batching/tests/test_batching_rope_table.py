"""RoPE from a shared table (a prefill chunk's, a decode step's) equals ``mx.fast.rope``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching._rope_table import (
    _KEPT,
    _row_factors,
    _row_tables,
    _rows_table,
    _table,
    _tables,
    rope_chunk,
    rope_rows,
)
from kv_protocol import RopeConfig

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _case(
    shape: tuple[int, int, int],
    head_dim: int,
    share: float,
    rope_args: tuple[bool, float, float],
    dtype: str,
    seed: int,
) -> tuple[RopeConfig, mx.array]:
    """A RoPE rotating ``share`` of ``head_dim`` and a random ``(*shape, head_dim)`` input."""
    traditional, base, scale = rope_args
    dims = max(2, int(head_dim * share) // 2 * 2)
    rope = RopeConfig(dims=dims, traditional=traditional, base=base, scale=scale)
    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(size=(*shape, head_dim)).astype(np.float32))
    return rope, x.astype(DTYPES[dtype])


def _assert_is_fast_rope(
    got: mx.array, x: mx.array, rope: RopeConfig, offset: int | mx.array
) -> None:
    """``got`` is ``mx.fast.rope(x, ...)`` at ``offset`` bit for bit."""
    want = mx.fast.rope(
        x,
        rope.dims,
        traditional=rope.traditional,
        base=rope.base,
        scale=rope.scale,
        offset=offset,
    )
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    )


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    length=st.integers(1, 40),
    head_dim=st.sampled_from([8, 16, 64, 80]),
    share=st.sampled_from([1.0, 0.5, 0.25]),
    traditional=st.booleans(),
    base=st.sampled_from([10000.0, 1_000_000.0, 500.0]),
    scale=st.sampled_from([1.0, 0.25, 2.0]),
    offset=st.integers(0, 5000),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_table_rotation_is_mx_fast_rope(
    heads: int,
    length: int,
    head_dim: int,
    share: float,
    traditional: bool,
    base: float,
    scale: float,
    offset: int,
    dtype: str,
    seed: int,
) -> None:
    rope, x = _case((2, heads, length), head_dim, share, (traditional, base, scale), dtype, seed)
    _assert_is_fast_rope(rope_chunk(x, offset, rope), x, rope, offset)


def test_a_chunk_s_table_is_computed_once_and_few_are_kept() -> None:
    rope = RopeConfig(dims=8)
    first = _table(rope, 3, 5, mx.float32)
    assert _table(rope, 3, 5, mx.float32) is first  # every layer of the chunk shares it
    assert _table(rope, 4, 5, mx.float32) is not first  # another offset, another table
    for offset in range(10, 10 + 2 * _KEPT):
        _table(rope, offset, 5, mx.float32)
    assert len(_tables) <= _KEPT


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([8, 16, 64, 80]),
    share=st.sampled_from([1.0, 0.5, 0.25]),
    traditional=st.booleans(),
    base=st.sampled_from([10000.0, 1_000_000.0, 500.0]),
    scale=st.sampled_from([1.0, 0.25, 2.0]),
    offsets=st.lists(st.integers(0, 200_000), min_size=1, max_size=17),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_decode_step_s_rotation_is_mx_fast_rope(
    heads: int,
    head_dim: int,
    share: float,
    traditional: bool,
    base: float,
    scale: float,
    offsets: list[int],
    dtype: str,
    seed: int,
) -> None:
    rope, x = _case(
        (len(offsets), heads, 1), head_dim, share, (traditional, base, scale), dtype, seed
    )
    positions = mx.array(offsets, dtype=mx.int32)
    _assert_is_fast_rope(rope_rows(x, positions, rope), x, rope, positions)


def test_a_decode_step_s_table_is_shared_by_its_layers_only() -> None:
    rope = RopeConfig(dims=8)
    step = mx.array([3, 70, 5], dtype=mx.int32)
    first = _rows_table(rope, step, mx.float32)
    assert _rows_table(rope, step, mx.float32) is first  # the step's layers share it
    same_values = mx.array([3, 70, 5], dtype=mx.int32)
    assert _rows_table(rope, same_values, mx.float32) is not first  # the next step's array
    assert _rows_table(rope, same_values, mx.bfloat16) is not first
    for base in range(2 * _KEPT):
        _rows_table(RopeConfig(dims=8, base=1000.0 + base), step, mx.float32)
    assert len(_row_tables) <= _KEPT


def test_a_decode_step_s_factors_are_made_once_per_head_count() -> None:
    _row_factors.clear()  # other tests' steps may have left this rope's factors for them
    rope = RopeConfig(dims=16)
    step = mx.array([3, 70], dtype=mx.int32)
    for heads in (4, 1, 4):
        x = mx.random.normal((2, heads, 1, 16), key=mx.random.key(heads))
        _assert_is_fast_rope(rope_rows(x, step, rope), x, rope, step)
    held = {key[2]: value for key, value in _row_factors.items() if key[0] == rope}
    assert set(held) == {1, 4} and all(value[0] is step for value in held.values())
    later = mx.array([4, 71], dtype=mx.int32)
    x = mx.random.normal((2, 4, 1, 16), key=mx.random.key(9))
    _assert_is_fast_rope(rope_rows(x, later, rope), x, rope, later)
    assert _row_factors[(rope, mx.float32, 4)][0] is later
