"""RMS normalisation of float32 rows on the CPU as one node of MLX's graph.

MLX's CPU backend composes ``mx.fast.rms_norm`` from about ten operations (square, sum,
the mean's multiply, the epsilon's add, reciprocal square root, two multiplies and their
broadcasts), each a scheduled task of a few microseconds: a one-row decode step of Gemma 3
270M (109 norms) spent more in that scheduling than in the arithmetic. :class:`CpuRmsNorm`
computes the same operations in the same order in one C function
(:mod:`~kv_metal_kernels._cpu_norm_source`), as a graph call
(:mod:`~kv_metal_kernels._graph_call`): the same bits as ``mx.fast.rms_norm`` on the CPU.
"""

from __future__ import annotations

import mlx.core as mx

from ._cpu_library import CpuLibrary, build_cpu_library
from ._cpu_norm_source import CPU_NORM_SOURCE
from ._graph_call import GraphEntry, graph_calls, graph_entry

__all__ = ["CpuRmsNorm"]


class CpuRmsNorm:
    """``mx.fast.rms_norm(x, weight (+ 1), eps)`` of float32 ``x (..., dim)``, one graph node.

    Available (:attr:`available`) where the C kernel builds and the graph calls work; the
    caller keeps ``mx.fast.rms_norm`` elsewhere (another device or dtype included).
    """

    def __init__(self) -> None:
        self._graph: GraphEntry | None = None

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return build_cpu_library("kv_rms_norm", CPU_NORM_SOURCE)

    @property
    def available(self) -> bool:
        """Whether :meth:`__call__` computes here."""
        return bool(self._resolve())

    @property
    def reason(self) -> str:
        """Why it is not available (``""`` when it is)."""
        if self.available:
            return ""
        library = self.library
        return library.reason if library.handle is None else graph_calls().reason

    def _resolve(self) -> GraphEntry:
        graph = self._graph
        if graph is None:
            graph = self._graph = graph_entry(self.library.handle, "kv_rms_norm_call")
        return graph

    def __call__(
        self, x: mx.array, weight: mx.array, eps: float, *, add_one: bool = False
    ) -> mx.array:
        """The normalised rows (a lazy node); ``add_one``: scale by ``1 + weight``."""
        graph = self._resolve()
        if not graph:
            raise RuntimeError(f"the CPU RMS norm is not available: {self.reason}")
        dim = x.shape[-1] if x.ndim else 0
        if (
            x.dtype != mx.float32
            or weight.dtype != mx.float32
            or weight.shape != (dim,)
            or dim == 0
        ):
            raise ValueError(
                "the CPU RMS norm takes float32 rows and a float32 weight of their width, got "
                f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}"
            )
        calls, kernel = graph
        return calls.call(
            kernel, "KvRmsNorm", [x, weight], [x.size // dim, dim, eps, add_one], x.shape
        )
