"""Native CPU kernels as nodes of MLX's graph, against the same kernels called on evaluated inputs.

The oracle is each kernel's evaluating path (``KV_CPU_GRAPH=off``'s), itself tested against
MLX's products and a float64 attention elsewhere: the graph node must give the same bits
for lazy, strided and already-evaluated inputs, stay lazy until evaluated, and refuse
anything that is not an MLX array. Where no C++ compiler or MLX headers are found the
calls are unavailable with a reason, and the kernels keep their evaluating path.
"""

from __future__ import annotations

import shutil
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import (
    CpuPagedAttention,
    CpuQuantizedHead,
    CpuSlotWriter,
    _cpu_library,
    _graph_call,
)
from kv_metal_kernels._graph_call import GRAPH_CALLS_ENV, graph_calls

CALLS = graph_calls()
HEAD = CpuQuantizedHead()
needs_calls = pytest.mark.skipif(
    not CALLS.available or HEAD.library.handle is None,
    reason=f"graph calls not available: {CALLS.reason or HEAD.library.reason}",
)


def test_the_calls_are_built_where_a_compiler_and_mlx_headers_are() -> None:
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is not None and _cpu_library._refusal() is None:
        assert CALLS.available, CALLS.reason
        assert CALLS.reason == ""
    else:
        assert not CALLS.available and CALLS.reason


def test_turned_off_or_misnamed_they_are_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GRAPH_CALLS_ENV, "off")
    off = _graph_call._load()
    assert not off.available and off.reason == f"{GRAPH_CALLS_ENV}=off"
    with pytest.raises(RuntimeError, match="not available"):
        off.call(0, "x", [], [], (1,))
    monkeypatch.setenv(GRAPH_CALLS_ENV, "always")
    wrong = _graph_call._load()
    assert not wrong.available and "neither 'auto' nor 'off'" in wrong.reason


def dot_of(array: mx.array, tmp_path: object) -> str:
    path = f"{tmp_path}/graph.dot"
    mx.export_to_dot(path, array)
    with open(path) as handle:
        return handle.read()


@needs_calls
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20),
    lead=st.sampled_from([(), (1,), (2, 1)]),
    bits=st.sampled_from([4, 8]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_projection_nodes_equal_the_evaluating_call(
    rows: int, lead: tuple[int, ...], bits: int, strided: bool, seed: int
) -> None:
    key = mx.random.key(seed)
    weight = mx.random.normal((37, 128), key=key) * 0.05
    codes, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
    lazy = HEAD.prepare(codes, scales, biases, group_size=32, bits=bits)
    eager = HEAD.prepare(codes, scales, biases, group_size=32, bits=bits)
    assert lazy is not None and eager is not None
    eager._graph = ()  # type: ignore[attr-defined]
    count = rows * int(np.prod(lead))
    source = mx.random.normal((128, count), key=mx.random.key(seed + 1))
    x = (source.T if strided else source.reshape(count, 128)) * 1.5
    x = x.reshape(*lead, rows, 128)
    got = lazy(x)
    assert got.shape == (*lead, rows, 37)
    assert np.array_equal(np.array(got), np.array(eager(x)))


@needs_calls
def test_a_projection_node_is_lazy_until_evaluated(tmp_path: object) -> None:
    codes, scales, biases = mx.quantize(mx.ones((16, 64)), group_size=32, bits=8)
    project = HEAD.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    out = project(mx.ones((2, 64)) * 2.0)
    assert "KvQuantizedRows" in dot_of(out, tmp_path)
    assert np.allclose(np.array(out), 128.0)


@needs_calls
@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 3),
    window=st.sampled_from([None, 3]),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_nodes_equal_the_evaluating_call(
    batch: int, group: int, queries: int, window: int | None, sinks: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    kv_heads, dim, page_size, pages = 2, 64, 4, 12
    heads = kv_heads * group
    k_pool = mx.array(rng.standard_normal((kv_heads, pages * page_size, dim)), dtype=mx.float32)
    v_pool = mx.array(rng.standard_normal((kv_heads, pages * page_size, dim)), dtype=mx.float32)
    lens = rng.integers(queries, 3 * page_size + 1, size=batch)
    table = np.zeros((batch, 3), dtype=np.int32)
    for b in range(batch):
        table[b] = rng.choice(np.arange(1, pages), size=3, replace=False)
    q = mx.array(rng.standard_normal((batch, queries, heads, dim)), dtype=mx.float32)
    q = q.transpose(0, 2, 1, 3) * 1.0  # a strided, lazy query
    sink = mx.array(rng.standard_normal(heads), dtype=mx.float32) if sinks else None
    kwargs: dict[str, Any] = {
        "page_size": page_size,
        "scale": dim**-0.5,
        "window": window,
        "sinks": sink,
    }
    lazy, eager = CpuPagedAttention(), CpuPagedAttention()
    eager._graph = ()
    args = (q, k_pool * 1.0, v_pool, mx.array(table), mx.array(lens, dtype=mx.int32))
    got = lazy.attend_queries(*args, **kwargs)
    want = eager.attend_queries(*args, **kwargs)
    assert np.array_equal(np.array(got), np.array(want))
    if queries == 1:
        one = lazy(*args, **kwargs)
        assert np.array_equal(np.array(one), np.array(eager(*args, **kwargs)))


@needs_calls
def test_an_attention_node_is_lazy(tmp_path: object) -> None:
    pool = mx.ones((1, 8, 64))
    out = CpuPagedAttention()(
        mx.ones((1, 1, 1, 64)) * 0.5,
        pool,
        pool * 3.0,
        mx.array([[1]], dtype=mx.int32),
        mx.array([2], dtype=mx.int32),
        page_size=4,
        scale=0.125,
    )
    assert "KvPagedAttention" in dot_of(out, tmp_path)
    assert np.allclose(np.array(out), 3.0)


@needs_calls
def test_anything_but_an_mlx_array_is_refused() -> None:
    kernel = int(_graph_call.kernel_address(HEAD.library.handle.kv_qhead_call))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="KvTest: could not add"):
        CALLS.call(kernel, "KvTest", [np.zeros(4, dtype=np.float32)], [1, 4], (4,))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a loaded native function"):
        _graph_call.kernel_address(None)


@needs_calls
@pytest.mark.parametrize("entry", ["cpython", "ctypes"])
def test_both_entry_points_build_the_same_node(entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if entry == "ctypes":
        monkeypatch.setattr(CALLS, "_fast", None)
    elif CALLS._fast is None:
        pytest.skip("built without Python's headers: ctypes entry points only")
    codes, scales, biases = mx.quantize(mx.random.normal((40, 64)), group_size=32, bits=4)
    lazy = HEAD.prepare(codes, scales, biases, group_size=32, bits=4)
    eager = HEAD.prepare(codes, scales, biases, group_size=32, bits=4)
    assert lazy is not None and eager is not None
    eager._graph = ()  # type: ignore[attr-defined]
    x = mx.random.normal((64, 3)).T
    assert np.array_equal(np.array(lazy(x)), np.array(eager(x)))
    buffer, want = mx.zeros((2, 6, 4)), mx.zeros((2, 6, 4))
    rows, slots = mx.random.normal((2, 2, 4)), mx.array([4, 1], dtype=mx.int32)
    assert CpuSlotWriter()(buffer, slots, rows)
    want[:, slots] = rows.transpose(1, 0, 2)
    assert np.array_equal(np.array(buffer), np.array(want))
    with pytest.raises(RuntimeError, match="KvTest: could not add"):
        kernel = _graph_call.kernel_address(HEAD.library.handle.kv_qhead_call)  # type: ignore[union-attr]
        CALLS.call(kernel, "KvTest", [np.zeros(4, dtype=np.float32)], [1, 4], (4,))  # type: ignore[list-item]


WRITER = CpuSlotWriter()


@needs_calls
@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 4),
    tokens=st.integers(1, 6),
    dim=st.sampled_from([4, 64, 80]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    strided=st.booleans(),
    shared=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_slot_writes_equal_mlx_s_indexed_assignment(
    heads: int, tokens: int, dim: int, dtype: str, strided: bool, shared: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    kind = getattr(mx, dtype)
    start = mx.array(rng.standard_normal((heads, 24, dim)), dtype=mx.float32).astype(kind)
    mx.eval(start)
    slots = mx.array(rng.choice(24, size=tokens, replace=False), dtype=mx.int32)
    source = mx.array(rng.standard_normal((heads, tokens, dim)), dtype=mx.float32).astype(kind)
    rows = source.transpose(1, 0, 2) if strided else mx.contiguous(source.transpose(1, 0, 2))
    want = mx.array(start)
    want[:, slots] = rows.transpose(1, 0, 2)
    buffer = mx.array(start)
    mx.eval(buffer)
    before = buffer[:1] if shared else None  # a view: the write must not reach it
    holder = [buffer]
    assert WRITER(buffer, slots, rows)
    assert holder[0] is buffer  # the object itself holds the result
    assert np.array_equal(np.array(buffer.astype(mx.float32)), np.array(want.astype(mx.float32)))
    if before is not None:
        assert np.array_equal(
            np.array(before.astype(mx.float32)), np.array(start[:1].astype(mx.float32))
        )


@needs_calls
def test_slot_writes_it_does_not_serve_are_left_to_the_caller() -> None:
    buffer = mx.zeros((2, 8, 4))
    rows = mx.ones((1, 2, 4))
    slots = mx.array([3], dtype=mx.int32)
    assert not WRITER(buffer, slots.astype(mx.int64), rows)
    assert not WRITER(buffer, slots, rows.astype(mx.float16))
    assert not WRITER(buffer, slots, mx.ones((1, 2, 5)))
    assert not WRITER(buffer, slots, mx.ones((2, 2, 4)))
    assert not WRITER(mx.zeros((8, 4)), slots, rows)
    assert np.array_equal(np.array(buffer), np.zeros((2, 8, 4)))


@needs_calls
def test_a_slot_out_of_range_raises_when_evaluated() -> None:
    buffer = mx.zeros((1, 4, 4))
    assert WRITER(buffer, mx.array([4], dtype=mx.int32), mx.ones((1, 1, 4)))
    with pytest.raises(RuntimeError, match="KvScatterRows: the native kernel failed"):
        mx.eval(buffer)


@needs_calls
def test_timing_sums_each_node_names_kernel_calls_while_on() -> None:
    codes, scales, biases = mx.quantize(mx.ones((16, 64)), group_size=32, bits=8)
    project = HEAD.prepare(codes, scales, biases, group_size=32, bits=8)
    assert project is not None
    CALLS.take_timing()
    mx.eval(project(mx.ones((2, 64))))  # off: not counted
    assert CALLS.take_timing() == {}
    CALLS.set_timing(True)
    try:
        mx.eval(project(mx.ones((2, 64))), project(mx.ones((3, 64)) * 2.0))
        mx.eval(project(mx.ones((1, 64))))
    finally:
        CALLS.set_timing(False)
    timed = CALLS.take_timing()
    assert set(timed) == {"KvQuantizedRows"}
    seconds, calls = timed["KvQuantizedRows"]
    assert calls == 3 and 0.0 < seconds < 10.0
    assert CALLS.take_timing() == {}  # taken: cleared
    mx.eval(project(mx.ones((2, 64))))
    assert CALLS.take_timing() == {}  # off again
