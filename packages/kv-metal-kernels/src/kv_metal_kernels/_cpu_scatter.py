"""A decode step's K/V rows written into a pool's buffer as one node of MLX's graph.

MLX's indexed assignment ``buffer[:, slots] = rows.transpose(1, 0, 2)`` (how a pool writes a
step's keys and values into its head-major buffers) is about a dozen operations on MLX's
CPU backend (the index arithmetic, broadcasts, the scatter), twice a layer and step.
:class:`CpuSlotWriter` (``kv_protocol.SlotWriter``) makes it one graph call
(:mod:`~kv_metal_kernels._graph_call`) that copies each row to its slot, in the buffer
itself where nothing else holds it, as MLX's scatter does: the same values.
"""

from __future__ import annotations

import mlx.core as mx

from ._graph_call import GraphEntry, graph_calls

__all__ = ["CpuSlotWriter"]


class CpuSlotWriter:
    """``kv_protocol.SlotWriter`` on MLX's CPU device through the graph calls.

    Serves ``buffer (H, S, D)`` and ``rows (T, H, D)`` of one dtype with int32 ``slots
    (T,)`` on the CPU; anything else is left to the caller (``False``).
    """

    def __init__(self) -> None:
        self._graph: GraphEntry | None = None

    @property
    def available(self) -> bool:
        """Whether it writes anything here (the graph calls work)."""
        return bool(self._resolve())

    def _resolve(self) -> GraphEntry:
        graph = self._graph
        if graph is None:
            calls = graph_calls()
            kernel = calls.scatter_rows_kernel() if calls.available else None
            graph = self._graph = (calls, kernel) if kernel else ()
        return graph

    def __call__(self, buffer: mx.array, slots: mx.array, rows: mx.array) -> bool:
        """Write ``rows`` at ``slots`` of ``buffer`` (the object itself); ``False``: not served."""
        graph = self._resolve()
        if (
            not graph
            or mx.default_device().type != mx.cpu
            or not isinstance(buffer, mx.array)
            or buffer.ndim != 3
            or rows.ndim != 3
            or slots.ndim != 1
            or slots.dtype != mx.int32
            or rows.dtype != buffer.dtype
            or tuple(rows.shape) != (slots.shape[0], buffer.shape[0], buffer.shape[2])
        ):
            return False
        calls, kernel = graph
        heads, size, dim = buffer.shape
        params = [heads, size, dim, slots.shape[0], buffer.itemsize]
        calls.update(kernel, "KvScatterRows", buffer, [slots, rows], params)
        return True
