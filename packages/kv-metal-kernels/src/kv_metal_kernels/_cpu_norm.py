"""RMS normalisation of float32 rows on the CPU as one node of MLX's graph.

MLX's CPU backend composes ``mx.fast.rms_norm`` from about ten operations (square, sum,
the mean's multiply, the epsilon's add, reciprocal square root, two multiplies and their
broadcasts), each a scheduled task of a few microseconds: a one-row decode step of Gemma 3
270M (109 norms) spent more in that scheduling than in the arithmetic. :class:`CpuRmsNorm`
computes the same operations in the same order in one C function
(:mod:`~kv_metal_kernels._cpu_norm_source`), as a graph call
(:mod:`~kv_metal_kernels._graph_call`): the same bits as ``mx.fast.rms_norm`` on the CPU.

:class:`CpuNormRope` does the same for a decode step's query and key rows together with
their rotation (``kv_protocol.NormRopeKernel``): a layer's per-head norms, RoPE and the
views between them (about thirty operations of a one-row step) become two nodes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import RmsNormForm

from ._cpu_library import CpuLibrary, build_cpu_library
from ._cpu_norm_source import CPU_NORM_SOURCE
from ._graph_call import GraphNodeKernel

__all__ = ["CpuNormRope", "CpuRmsNorm"]


def _norm_library() -> CpuLibrary:
    """The library of both norm kernels (built once per process and source)."""
    return build_cpu_library("kv_rms_norm", CPU_NORM_SOURCE)


class CpuRmsNorm(GraphNodeKernel):
    """``mx.fast.rms_norm(x, weight (+ 1), eps)`` of float32 ``x (..., dim)``, one graph node.

    Available (:attr:`available`) where the C kernel builds and the graph calls work; the
    caller keeps ``mx.fast.rms_norm`` elsewhere (another device or dtype included).
    """

    SYMBOL = "kv_rms_norm_call"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return _norm_library()

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


class CpuNormRope(GraphNodeKernel):
    """``kv_protocol.NormRopeKernel`` on MLX's CPU device: one graph node per call.

    Serves float32 rows, factors and norm weight on the CPU with an even ``head_dim``;
    anything else returns ``None`` (the caller composes MLX's operations). The results are
    the bits of ``mx.fast.rms_norm`` per head followed by kv-batching's ``rope_rows``.
    """

    SYMBOL = "kv_norm_rope_call"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library, :class:`CpuRmsNorm`'s."""
        return _norm_library()

    def __call__(
        self,
        rows: mx.array,
        *,
        heads: int,
        cos_both: mx.array,
        sin_signed: mx.array,
        norm: RmsNormForm | None,
    ) -> mx.array | None:
        """``rows (B, ..., heads * D)`` normalised per head and rotated: ``(B, heads, D)``."""
        graph = self._resolve()
        if not graph or mx.default_device().type != mx.cpu or heads <= 0:
            return None
        batch = rows.shape[0] if rows.ndim >= 2 else 0
        width = rows.shape[-1] if rows.ndim else 0
        dim = width // heads
        if (
            batch == 0
            or rows.size != batch * width
            or dim * heads != width
            or dim % 2
            or any(a.dtype != mx.float32 for a in (rows, cos_both, sin_signed))
            or tuple(cos_both.shape) != (batch, dim)
            or tuple(sin_signed.shape) != (batch, dim)
        ):
            return None
        inputs = [rows, cos_both, sin_signed]
        params: list[float] = [batch, heads, dim, 0.0, 0.0, 0.0]
        if norm is not None:
            weight: Any = norm.weight
            if (
                not isinstance(weight, mx.array)
                or weight.dtype != mx.float32
                or tuple(weight.shape) != (dim,)
            ):
                return None
            inputs.append(weight)
            params[3:] = [1.0, float(norm.eps), 1.0 if norm.add_one else 0.0]
        calls, kernel = graph
        return calls.call(kernel, "KvNormRope", inputs, params, (batch, heads, dim))
