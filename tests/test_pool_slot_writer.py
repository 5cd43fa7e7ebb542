"""The pool writing through kv-metal-kernels' ``CpuSlotWriter`` against the pool writing with MLX.

The oracle is the same pool without a writer (MLX's indexed assignment): after any sequence
of requests, reservations and writes, both hold the same buffers; a one-token write stays
in place (no copy of the buffer); ``build_engine`` wires the writer on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import CpuSlotWriter
from kv_pool import HybridKVPool
from kv_protocol import CacheLayout, LayerKind, LayerSpec, layout_from_model
from kv_serve import build_pool
from kv_testing import build_tiny_model

WRITER = CpuSlotWriter()
needs_writer = pytest.mark.skipif(not WRITER.available, reason="graph calls not available")


def layout() -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=4, n_kv_heads=2, head_dim=8),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=16),
        ]
    )


@needs_writer
@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), min_size=1, max_size=8),
    seed=st.integers(0, 2**31 - 1),
)
def test_writes_through_the_writer_equal_mlx_s(steps: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    pools = [
        HybridKVPool(layout(), num_pages=64, page_size=2, slot_writer=WRITER),
        HybridKVPool(layout(), num_pages=64, page_size=2),
    ]
    for pool in pools:
        for rid in range(3):
            pool.add_request(rid)
    for rid, count in steps:
        values = {
            layer: rng.standard_normal((count, heads, dim)).astype(np.float32)
            for layer, heads, dim in ((0, 2, 8), (1, 1, 16))
        }
        for pool in pools:
            slots = pool.reserve(rid, count).slots
            for layer, name in ((0, "sliding-w4-2x8"), (1, "full-1x16")):
                rows = mx.array(values[layer])
                pool.set_kv(layer, slots[name], rows, rows * 2.0)
    for layer in (0, 1):
        for read in ("get_key_buffer", "get_value_buffer"):
            ours, theirs = (getattr(pool, read)(layer) for pool in pools)
            assert np.array_equal(np.array(ours), np.array(theirs))


@needs_writer
def test_a_one_token_write_stays_in_place() -> None:
    pool = HybridKVPool(layout(), num_pages=4096, page_size=16, slot_writer=WRITER)
    pool.add_request(0)
    slots = pool.reserve(0, 1).slots["full-1x16"]
    mx.eval(pool.get_key_buffer(1), pool.get_value_buffer(1))
    kv = mx.ones((1, 1, 16))
    mx.eval(kv, slots)
    buffer_bytes = pool.get_key_buffer(1).nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(3):
        pool.set_kv(1, slots, kv, kv)
        mx.eval(pool.get_key_buffer(1), pool.get_value_buffer(1))
    assert mx.get_peak_memory() - base < buffer_bytes // 4
    assert np.array_equal(np.array(pool.get_kv(1, slots)[0]), np.ones((1, 1, 16)))


def test_build_pool_wires_the_writer_where_it_works() -> None:
    model_layout = layout_from_model(build_tiny_model("gpt_oss", window=8, num_layers=2))
    pool = build_pool(model_layout, max_running=1, max_context=16, page_size=4)
    assert isinstance(pool, HybridKVPool)
    if WRITER.available and mx.default_device().type == mx.cpu:
        assert isinstance(pool.slot_writer, CpuSlotWriter)
    else:
        assert pool.slot_writer is None
