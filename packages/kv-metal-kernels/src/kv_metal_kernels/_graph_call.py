"""Native CPU kernels as nodes of MLX's lazy graph instead of evaluation points.

A native kernel called through ctypes needs its inputs' values, so each call evaluated
them first: a hand-off to MLX's CPU stream and back (30-40 us on a 2-core x86_64) that a
one-row decode step of a small model paid about 150 times. :class:`GraphCalls` puts the
call in the graph instead: one MLX primitive (C++, :mod:`~kv_metal_kernels._graph_call_source`,
built against the installed MLX by :func:`~kv_metal_kernels._cpu_library.build_mlx_library`)
whose evaluation runs the kernel on MLX's stream, after the operations it depends on, so a
whole decode step is evaluated once.

The primitive is attached to Python arrays by reading MLX's Python objects directly (their
binding's instance layout). Before first use :func:`graph_calls` checks that layout and the
whole path on arrays of known values; anything that differs (or ``KV_CPU_GRAPH=off``, or no
C++ compiler or MLX headers) leaves :attr:`GraphCalls.available` false with the reason, and
the kernels keep evaluating their inputs and calling through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx

from ._cpu_library import CpuLibrary, build_mlx_library
from ._graph_call_source import GRAPH_CALL_SOURCE

__all__ = [
    "GRAPH_CALLS_ENV",
    "GraphCalls",
    "GraphEntry",
    "GraphNodeKernel",
    "graph_calls",
    "graph_entry",
    "kernel_address",
]

#: ``off``: native CPU kernels evaluate their inputs and run outside MLX's graph.
GRAPH_CALLS_ENV = "KV_CPU_GRAPH"

_ARRAY_TYPE = ctypes.c_void_p(id(mx.array))


def kernel_address(function: object) -> int:
    """The address of a ctypes function of a loaded library (for :meth:`GraphCalls.call`)."""
    address = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]
    if not address:
        raise ValueError("not a loaded native function")
    return int(address)


class GraphCalls:
    """Builds graph nodes that run native kernels of the form ``kernel(inputs, params, out)``.

    ``kernel`` is ``int (*)(const void *const *inputs, const double *params, void *out)``:
    row-contiguous input buffers in order, the parameters, the float32 output; non-zero
    means it failed (its scratch could not be allocated, or an index was out of range):
    the evaluation raises.
    """

    def __init__(self, library: CpuLibrary, reason: str = "") -> None:
        self._library = library
        self._reason = reason
        self._call = None
        self._fast: Callable[..., mx.array] | None = None
        if library.handle is not None and not reason:
            call = library.handle.kv_graph_call
            call.restype = ctypes.c_int
            call.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_char_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.py_object,
            ]
            self._call = call
            self._fast = _fast_entry(library.handle)

    def scatter_rows_kernel(self) -> int:
        """The library's own row scatter (``KvScatterRows``' kernel), 0 where not available.

        Inputs: the head-major buffer ``(H, S, D)`` (updated in place: :meth:`update`),
        int32 slots ``(T,)`` and token-major rows ``(T, H, D)``; params ``H, S, D, T`` and
        the item size. A slot outside ``0 .. S - 1`` makes the evaluation raise.
        """
        handle = self._library.handle
        if self._call is None or handle is None:
            return 0
        address = handle.kv_graph_scatter_rows
        address.restype = ctypes.c_void_p
        return int(address() or 0)

    @property
    def available(self) -> bool:
        """Whether :meth:`call` builds graph nodes here."""
        return self._call is not None

    def set_timing(self, on: bool) -> None:
        """Time every node's kernel call from now (``on``) or stop (a profiling aid).

        The times are the kernel calls alone (a clock read either side), summed by node
        name until :meth:`take_timing`; off, a node pays one flag read. Nothing happens
        where the graph calls are not available.
        """
        handle = self._library.handle
        if self._call is not None and handle is not None:
            handle.kv_graph_timing(ctypes.c_int(1 if on else 0))

    def take_timing(self) -> dict[str, tuple[float, int]]:
        """Seconds and calls of each node name timed since the last take; then cleared."""
        handle = self._library.handle
        if self._call is None or handle is None:
            return {}
        take = handle.kv_graph_timing_take
        take.restype = ctypes.c_int
        take.argtypes = [ctypes.c_char_p, ctypes.c_int]
        size = 1 << 16  # a line a node name: a few dozen bytes each
        buffer = ctypes.create_string_buffer(size)
        needed = int(take(buffer, size))
        lines = buffer.value.decode().splitlines()
        if needed >= size:
            lines = lines[:-1]  # the text was cut: its last line is not whole
        sums: dict[str, tuple[float, int]] = {}
        for line in lines:
            name, seconds, calls = line.rsplit(" ", 2)
            sums[name] = (float(seconds), int(calls))
        return sums

    @property
    def reason(self) -> str:
        """Why the graph calls are not available (``""`` when they are)."""
        if self._call is not None:
            return ""
        return self._reason or self._library.reason

    def call(
        self,
        kernel: int,
        name: str,
        inputs: Sequence[mx.array],
        params: Sequence[float],
        shape: Sequence[int],
    ) -> mx.array:
        """A lazy float32 array of ``shape``: ``kernel`` run on ``inputs`` when evaluated.

        The caller vouches that ``kernel`` reads and writes within the buffers its
        ``inputs``, ``params`` and ``shape`` describe; the arrays are MLX's CPU arrays.
        """
        fast = self._fast
        if fast is not None:
            return fast(kernel, name.encode(), inputs, params, shape)
        out = mx.array(0.0)
        self._ctypes_call(kernel, name, inputs, params, shape, out)
        return out

    def update(
        self,
        kernel: int,
        name: str,
        target: mx.array,
        inputs: Sequence[mx.array],
        params: Sequence[float],
    ) -> None:
        """Make ``target`` (the object itself) a node: ``kernel`` updating its value.

        Input 0 of the kernel is ``target``'s current value, and its output buffer is that
        value's buffer where nothing else holds it (MLX's own donation), else a copy of it;
        the kernel writes what changes. Like MLX's indexed assignment, every other holder of
        the ``target`` object sees the new value.
        """
        fast = self._fast
        if fast is not None:
            fast(kernel, name.encode(), [target, *inputs], params, None)
            return
        self._ctypes_call(kernel, name, [target, *inputs], params, (), target)

    def _ctypes_call(
        self,
        kernel: int,
        name: str,
        inputs: Sequence[mx.array],
        params: Sequence[float],
        shape: Sequence[int],
        out: mx.array,
    ) -> None:
        """The node through the ctypes entry point (in place where ``inputs[0] is out``)."""
        call = self._call
        if call is None:
            raise RuntimeError(f"graph calls are not available: {self.reason}")
        # The objects' addresses (CPython's ``id``); ``inputs`` holds them through the call.
        objects = (ctypes.c_void_p * max(len(inputs), 1))(*(id(array) for array in inputs))
        values = (ctypes.c_double * max(len(params), 1))(*params)
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        status = call(
            _ARRAY_TYPE,
            ctypes.c_void_p(kernel),
            name.encode(),
            ctypes.cast(objects, ctypes.c_void_p),
            len(inputs),
            ctypes.cast(values, ctypes.c_void_p),
            len(params),
            ctypes.cast(dims, ctypes.c_void_p),
            len(shape),
            out,
        )
        if status != 0:
            raise RuntimeError(f"{name}: could not add the native call to MLX's graph")


def _fast_entry(handle: ctypes.CDLL) -> Callable[..., mx.array] | None:
    """The library's CPython function ``graph_call``, where it was built with Python's headers."""
    try:
        make = handle.kv_graph_function
    except AttributeError:
        return None
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.py_object]
    function = make(mx.array)
    return cast(Callable[..., mx.array], function) if callable(function) else None


_calls: GraphCalls | None = None
_lock = threading.Lock()

#: What a kernel object keeps to build its nodes: the graph calls and its kernel's address,
#: or ``()`` where they are not available.
GraphEntry = tuple[GraphCalls, int] | tuple[()]


class GraphNodeKernel:
    """Base of a kernel that runs one C function (``SYMBOL``) of its library as graph nodes.

    A subclass names the function and says how its library is built (:attr:`library`);
    the function is resolved on first use, and :attr:`available` / :attr:`reason` say
    whether it runs here and why not.
    """

    SYMBOL = ""

    def __init__(self) -> None:
        self._graph: GraphEntry | None = None

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        raise NotImplementedError

    @property
    def available(self) -> bool:
        """Whether the kernel's nodes are built here."""
        return bool(self._resolve())

    @property
    def reason(self) -> str:
        """Why it is not available (``""`` when it is)."""
        if self.available:
            return ""
        library = self.library
        if library.handle is None:
            return library.reason
        return graph_calls().reason or f"the kernel library has no {self.SYMBOL}"

    def _resolve(self) -> GraphEntry:
        graph = self._graph
        if graph is None:
            graph = self._graph = graph_entry(self.library.handle, self.SYMBOL)
        return graph


def graph_entry(library: ctypes.CDLL | None, symbol: str) -> GraphEntry:
    """The process's graph calls and ``symbol``'s address in ``library``, else ``()``."""
    calls = graph_calls()
    if not calls.available or library is None:
        return ()
    return calls, kernel_address(getattr(library, symbol))


def graph_calls() -> GraphCalls:
    """The process's :class:`GraphCalls`, built and checked on first use."""
    global _calls
    with _lock:
        if _calls is None:
            _calls = _load()
        return _calls


def _load() -> GraphCalls:
    choice = os.environ.get(GRAPH_CALLS_ENV, "auto").strip().lower() or "auto"
    unbuilt = CpuLibrary(handle=None, path="", openmp="", reason="")
    if choice == "off":
        return GraphCalls(unbuilt, f"{GRAPH_CALLS_ENV}=off")
    if choice != "auto":
        return GraphCalls(unbuilt, f"{GRAPH_CALLS_ENV}={choice!r} is neither 'auto' nor 'off'")
    library = build_mlx_library("kv_graph_call", GRAPH_CALL_SOURCE)
    if library.handle is None:
        return GraphCalls(library)
    problem = _self_check(library.handle)
    calls = GraphCalls(library, problem)
    if problem:
        return calls
    problem = _round_trip(calls, library.handle)
    return GraphCalls(library, problem) if problem else calls


def _self_check(handle: ctypes.CDLL) -> str:
    """``""`` when the library reads MLX's Python arrays as they are, else what differed."""
    probe = handle.kv_graph_probe
    probe.restype = ctypes.c_int
    probe.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p]
    samples = (
        mx.array(1.5),
        mx.zeros((3, 5), dtype=mx.int32),
        mx.ones((2, 4, 7), dtype=mx.uint8),
    )
    for sample in samples:
        info = (ctypes.c_int64 * 4)()
        status = probe(sample, _ARRAY_TYPE, ctypes.cast(info, ctypes.c_void_p))
        expected = [
            sample.ndim,
            sample.size,
            sample.itemsize,
            sample.shape[-1] if sample.ndim else -1,
        ]
        if status != 0 or list(info) != expected:
            return (
                "MLX's Python arrays are not laid out as the graph calls expect "
                f"(read {list(info)} for {expected})"
            )
    return ""


def _round_trip(calls: GraphCalls, handle: ctypes.CDLL) -> str:
    """``""`` when a graph call on a strided lazy input computes what MLX computes."""
    address = handle.kv_graph_add_scalar
    address.restype = ctypes.c_void_p
    kernel = address()
    x = (mx.arange(24, dtype=mx.float32).reshape(4, 6) * 2.0)[:, 1::2].T
    try:
        out = calls.call(int(kernel), "kv_graph_check", [x], [0.5, x.size], x.shape)
        expected = (x + 0.5).reshape(-1).tolist()
        got = out.reshape(-1).tolist()
    except RuntimeError as err:
        return f"the graph calls' check failed: {err}"
    if got != expected or out.shape != x.shape:
        return f"the graph calls' check computed {got} for {expected}"
    return ""
