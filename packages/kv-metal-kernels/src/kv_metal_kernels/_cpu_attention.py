"""Paged decode attention on the CPU through a C kernel that reads K/V in place.

The reference (:class:`~kv_metal_kernels._paged_reference.ReferencePagedAttention`) gathers
each request's pages into a copy, then attends it with MLX operations. On MLX's CPU backend
that is dozens of graph nodes a layer and a gather that copies element by element: on
Gemma 3 270M (2-core x86_64) a decode step spent about 10 ms of 48 at one request and
50 ms of 157 at sixteen in that attention. :class:`CpuPagedAttention` runs one C
function (:mod:`~kv_metal_kernels._cpu_attention_source`, built by
:func:`~kv_metal_kernels._cpu_library.build_cpu_library`) that walks each query's pages
through the page table: the same contract and checks as the reference, float32 pools.
Anything else (a quantized pool, another dtype, no compiler) is the reference's call. The
function is a node of MLX's graph where the graph calls work
(:mod:`~kv_metal_kernels._graph_call`); otherwise it evaluates its inputs first, and the
seconds it evaluates and computes go to ``kv_protocol.EVALUATION_CLOCK`` (device time).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, cast

import mlx.core as mx

from kv_protocol import EVALUATION_CLOCK, KVBuffer

from ._cpu_attention_source import CPU_ATTENTION_SOURCE
from ._cpu_library import CpuLibrary, build_cpu_library
from ._graph_call import GraphEntry, graph_entry
from ._paged_reference import ReferencePagedAttention
from ._validate import PagedIndexCheck, check_paged_attention_args

__all__ = ["CpuPagedAttention"]


def _cpu_attention_library() -> CpuLibrary:
    """The built kernel library (``handle is None``: not available, with the reason)."""
    return build_cpu_library("kv_paged_attention", CPU_ATTENTION_SOURCE)


def _buffer(array: mx.array) -> tuple[mx.array, memoryview]:
    """``array`` (made row-contiguous where it is not) and a view of its evaluated data."""
    view = memoryview(cast(Any, array))
    if not view.c_contiguous or view.nbytes != array.nbytes:
        array = mx.contiguous(array)
        mx.eval(array)
        view = memoryview(cast(Any, array))
    return array, view


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class CpuPagedAttention:
    """Paged decode attention (``kv_protocol.PagedDecodeAttention``) by a native CPU kernel.

    Also a ``kv_protocol.PagedQueryAttention`` (:meth:`attend_queries`: consecutive queries
    per request, as speculative verification asks). Served: float32 ``q`` and plain
    (unquantized) float32 pools, when the kernel builds here (:attr:`library`); anything
    else goes to a :class:`ReferencePagedAttention`, as do all calls when MLX's default
    device is not the CPU. Page ids and lengths are checked as the reference checks them,
    once per array object (every call with ``validate=True``), before the kernel reads
    through them.
    """

    def __init__(self, *, validate: bool = False) -> None:
        self._validate = validate
        self._reference = ReferencePagedAttention(validate=validate)
        self._index_check = PagedIndexCheck()
        self._fn: Any = None  # the C function, looked up on the first call it serves
        self._graph: GraphEntry | None = None  # likewise

    @property
    def name(self) -> str:
        """Backend name: ``cpu``."""
        return "cpu"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return _cpu_attention_library()

    def __call__(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, 1, D)``; see :class:`kv_protocol.PagedDecodeAttention`."""
        checked = check_paged_attention_args(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks
        )
        return self._attend(q, k_pool, v_pool, page_table, seq_lens, *checked, sinks)

    def attend_queries(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, L, D)`` of ``L`` consecutive queries per request.

        See :class:`kv_protocol.PagedQueryAttention`: query ``l`` is at position
        ``seq_lens[b] - L + l``.
        """
        checked = check_paged_attention_args(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks, queries=True
        )
        return self._attend(q, k_pool, v_pool, page_table, seq_lens, *checked, sinks)

    def _attend(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        page_size: int,
        scale: float,
        window: int | None,
        sinks: mx.array | None,
    ) -> mx.array:
        """The checked call: ``q.shape[2]`` consecutive queries per row."""
        fn = self._fn
        if fn is None:
            handle = self.library.handle
            if handle is not None:
                fn = self._fn = handle.kv_paged_attention
                fn.restype = ctypes.c_int
        if (
            fn is None
            or mx.default_device().type != mx.cpu
            or not isinstance(k_pool, mx.array)
            or not isinstance(v_pool, mx.array)
            or q.dtype != mx.float32
            or k_pool.dtype != mx.float32
        ):
            return self._reference.attend_queries(
                q,
                k_pool,
                v_pool,
                page_table,
                seq_lens,
                page_size=page_size,
                scale=scale,
                window=window,
                sinks=sinks,
            )
        b, hq, t, d = q.shape
        if b == 0:
            return mx.zeros_like(q)
        self._index_check(
            page_table, seq_lens, page_size, k_pool.shape[1], every_call=self._validate
        )
        logits = None if sinks is None else sinks.astype(mx.float32)
        graph = self._graph
        if graph is None:
            graph = self._graph = graph_entry(self.library.handle, "kv_paged_attention_call")
        if graph:
            calls, kernel = graph
            params: list[float] = [b, hq, t, d, k_pool.shape[0], k_pool.shape[1]]
            params += [page_table.shape[1]]
            params += [page_size, scale, 0 if window is None else window, logits is not None]
            return calls.call(
                kernel,
                "KvPagedAttention",
                [q, k_pool, v_pool, page_table, seq_lens, *([] if logits is None else [logits])],
                params,
                (b, hq, t, d),
            )
        tic = time.perf_counter()
        mx.eval(q, k_pool, v_pool, page_table, seq_lens, *([] if logits is None else [logits]))
        held = [_buffer(a) for a in (q, k_pool, v_pool, page_table, seq_lens)]
        sink_view = None if logits is None else _buffer(logits)
        out = bytearray(4 * q.size)
        status = fn(
            ctypes.c_void_p(_address(held[0][1])),
            ctypes.c_int(b),
            ctypes.c_int(hq),
            ctypes.c_int(t),
            ctypes.c_int(d),
            ctypes.c_void_p(_address(held[1][1])),
            ctypes.c_void_p(_address(held[2][1])),
            ctypes.c_int(k_pool.shape[0]),
            ctypes.c_longlong(k_pool.shape[1]),
            ctypes.c_void_p(_address(held[3][1])),
            ctypes.c_int(page_table.shape[1]),
            ctypes.c_void_p(_address(held[4][1])),
            ctypes.c_int(page_size),
            ctypes.c_float(scale),
            ctypes.c_int(0 if window is None else window),
            ctypes.c_void_p(None if sink_view is None else _address(sink_view[1])),
            ctypes.c_void_p(_address(memoryview(out))),
        )
        if status != 0:
            raise MemoryError(f"the CPU paged attention kernel could not allocate for {b} rows")
        result = mx.array(cast(Any, memoryview(out).cast("f", (b, hq, t, d))))
        EVALUATION_CLOCK.add(time.perf_counter() - tic)
        return result
