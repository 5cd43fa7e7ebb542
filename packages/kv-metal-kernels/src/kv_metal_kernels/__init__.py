"""Fused RoPE + pool scatter and paged decode attention for MLX (reference, Metal, CUDA).

On the CPU, :class:`CpuQuantizedHead` projects a large quantized vocabulary head,
:class:`CpuQuantizedLinear` a model's quantized linear layers for a few rows,
:class:`CpuPagedAttention` attends the pages in place, :class:`CpuRmsNorm` normalises
rows, :class:`CpuNormRope` normalises and rotates a decode step's query and key rows and
:class:`CpuGatedActivation` computes a gated MLP's activation, each through a C kernel
built on first use and run as a node of MLX's lazy graph where the graph calls build
(``KV_CPU_GRAPH``).

Pools are slot-addressed and head-major, ``(n_kv_heads, num_slots, head_dim)`` with
``slot = page * page_size + offset_in_page`` (page 0 is the null page). ``select_kernels``
returns the :class:`KernelSet` batched decode uses.
"""

from ._cpu_activation import CpuGatedActivation
from ._cpu_attention import CpuPagedAttention
from ._cpu_library import CPU_KERNELS_ENV
from ._cpu_norm import CpuNormRope, CpuRmsNorm
from ._cpu_scatter import CpuSlotWriter
from ._native import (
    NATIVE_BACKENDS,
    NativePagedAttention,
    NativeRopeScatter,
    backend_available,
    native_backend,
)
from ._paged_reference import ReferencePagedAttention
from ._prefill_attention import DensePrefillAttention
from ._quantized_head import CpuQuantizedHead
from ._quantized_linear import CpuQuantizedLinear
from ._rope_reference import ReferenceRopeScatter
from ._select import (
    ATTENTION_ENV,
    FUSED_ROPE_ENV,
    KernelSet,
    paged_decode_attention,
    rope_config_from_module,
    select_kernels,
)

__all__ = [
    "ATTENTION_ENV",
    "CPU_KERNELS_ENV",
    "CpuGatedActivation",
    "CpuNormRope",
    "CpuPagedAttention",
    "CpuQuantizedHead",
    "CpuQuantizedLinear",
    "CpuRmsNorm",
    "CpuSlotWriter",
    "DensePrefillAttention",
    "FUSED_ROPE_ENV",
    "KernelSet",
    "NATIVE_BACKENDS",
    "NativePagedAttention",
    "NativeRopeScatter",
    "ReferencePagedAttention",
    "ReferenceRopeScatter",
    "backend_available",
    "native_backend",
    "paged_decode_attention",
    "rope_config_from_module",
    "select_kernels",
]
