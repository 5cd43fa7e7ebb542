"""A gated MLP's activation of float32 rows on the CPU as one node of MLX's graph.

kv-batching's gated MLPs compile ``kv_protocol.gated_activation`` (``act(gate) * up`` from
adds, multiplies and shifts, which MLX vectorises), but MLX's compiler cuts it at the
exponent's bit casts: seven scheduled kernels a layer, about 47 us for one row of Gemma 3
270M's 2048 features where the arithmetic takes a few. :class:`CpuGatedActivation` does
the same operations in the same order in one C loop
(:mod:`~kv_metal_kernels._cpu_activation_source`) as a graph call
(:mod:`~kv_metal_kernels._graph_call`): the same bits.
"""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import ACTIVATION_CONSTANTS, GATED_ACTIVATIONS

from ._cpu_activation_source import CPU_ACTIVATION_SOURCE
from ._cpu_library import CpuLibrary, build_cpu_library
from ._graph_call import GraphNodeKernel

__all__ = ["CpuGatedActivation"]


class CpuGatedActivation(GraphNodeKernel):
    """``kv_protocol.GatedActivationKernel`` on MLX's CPU device: one graph node per call.

    Serves float32 ``gate`` and ``up`` of one shape on the CPU; anything else returns
    ``None`` (the caller composes MLX's operations).
    """

    SYMBOL = "kv_gated_call"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return build_cpu_library("kv_gated", CPU_ACTIVATION_SOURCE)

    def __call__(self, gate: mx.array, up: mx.array, *, activation: str) -> mx.array | None:
        """``act(gate) * up`` (a lazy node of ``gate``'s shape), or ``None``: not served."""
        if activation not in GATED_ACTIVATIONS:
            return None
        graph = self._resolve()
        if (
            not graph
            or mx.default_device().type != mx.cpu
            or gate.dtype != mx.float32
            or up.dtype != mx.float32
            or gate.shape != up.shape
            or gate.size == 0
        ):
            return None
        calls, kernel = graph
        params = [float(gate.size), float(GATED_ACTIVATIONS.index(activation))]
        return calls.call(
            kernel, "KvGatedActivation", [gate, up], [*params, *ACTIVATION_CONSTANTS], gate.shape
        )
