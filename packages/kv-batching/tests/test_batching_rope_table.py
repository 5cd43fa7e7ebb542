"""A prefill chunk's RoPE from a shared table equals ``mx.fast.rope`` bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching._rope_table import _KEPT, _table, _tables, rope_chunk
from kv_protocol import RopeConfig

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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
    dims = max(2, int(head_dim * share) // 2 * 2)
    rope = RopeConfig(dims=dims, traditional=traditional, base=base, scale=scale)
    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(size=(2, heads, length, head_dim)).astype(np.float32))
    x = x.astype(DTYPES[dtype])
    want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    got = rope_chunk(x, offset, rope)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    )


def test_a_chunk_s_table_is_computed_once_and_few_are_kept() -> None:
    rope = RopeConfig(dims=8)
    first = _table(rope, 3, 5, mx.float32)
    assert _table(rope, 3, 5, mx.float32) is first  # every layer of the chunk shares it
    assert _table(rope, 4, 5, mx.float32) is not first  # another offset, another table
    for offset in range(10, 10 + 2 * _KEPT):
        _table(rope, offset, 5, mx.float32)
    assert len(_tables) <= _KEPT
