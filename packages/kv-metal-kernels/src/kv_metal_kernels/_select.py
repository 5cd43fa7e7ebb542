"""Kernel selection: the ``KernelSet`` batched decode uses and the env-driven choice."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import mlx.core as mx

from kv_protocol import (
    GatedActivationKernel,
    KernelUnavailableError,
    NormRopeKernel,
    PagedDecodeAttention,
    PrefillAttention,
    QuantizedHeadKernel,
    RopeConfig,
    RopeScatterKernel,
    UnknownBackendError,
    rope_config_from_module,  # the one rule for a describable RoPE, re-exported here
)

from ._cpu_activation import CpuGatedActivation
from ._cpu_attention import CpuPagedAttention
from ._cpu_attention import _cpu_attention_library as cpu_attention_library
from ._cpu_norm import CpuNormRope
from ._native import NativePagedAttention, NativeRopeScatter, native_backend, require_backend
from ._paged_reference import ReferencePagedAttention
from ._prefill_attention import DensePrefillAttention
from ._quantized_head import CpuQuantizedHead
from ._rope_reference import ReferenceRopeScatter

__all__ = [
    "ATTENTION_ENV",
    "FUSED_ROPE_ENV",
    "KernelSet",
    "paged_decode_attention",
    "rope_config_from_module",
    "select_kernels",
]

#: Environment variable choosing the fused RoPE + scatter backend.
FUSED_ROPE_ENV = "KV_FUSED_ROPE"
#: Environment variable choosing the paged decode attention backend.
ATTENTION_ENV = "KV_PAGED_ATTENTION"

_FUSED_CHOICES = ("off", "auto", "reference", "metal", "cuda")
_ATTENTION_CHOICES = ("auto", "reference", "cpu", "metal", "cuda")

logger = logging.getLogger("kv_metal_kernels")
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


@dataclass(frozen=True, kw_only=True)
class KernelSet:
    """The kernels of batched decode (``kv_protocol.KernelSet``); ``rope is None`` = unfused.

    ``prefill_attention`` (``None``: each module's own attention) serves the prefill chunks
    of the layers the engine wraps; ``quantized_head`` (``None``: MLX's own product) projects
    a large quantized vocabulary head; ``norm_rope`` (``None``: MLX's operations) normalises
    and rotates the query and key rows of a decode step; ``gated_activation`` (``None``:
    MLX's operations) computes the engine's gated MLPs' activations.
    """

    attention: PagedDecodeAttention
    rope: RopeScatterKernel | None = None
    prefill_attention: PrefillAttention | None = None
    quantized_head: QuantizedHeadKernel | None = None
    norm_rope: NormRopeKernel | None = None
    gated_activation: GatedActivationKernel | None = None


def _choice(
    value: object, env: str, default: str, choices: tuple[str, ...], *, argument: str
) -> str:
    """The backend named by ``value`` (else by the environment variable ``env``).

    A name that is not one of ``choices`` (or not a string) is a
    :class:`kv_protocol.UnknownBackendError`, both a ``KernelUnavailableError`` and a
    ``ValueError``.
    """
    if value is None:
        name = os.environ.get(env, "").strip().lower() or default
        source = f"environment variable {env}"
    else:
        source = f"argument {argument}"
        if not isinstance(value, str):
            raise UnknownBackendError(
                f"unknown kernel backend {value!r} from {source}: expected one of {choices} "
                f"(a string), got {type(value).__name__}"
            )
        name = value.strip().lower()
    if name not in choices:
        raise UnknownBackendError(
            f"unknown kernel backend {name!r} from {source}; expected one of {choices}"
        )
    return name


def _cpu_attention_ready() -> bool:
    """Whether MLX computes on the CPU and the CPU paged attention kernel builds here."""
    return mx.default_device().type == mx.cpu and cpu_attention_library().handle is not None


def _attention_kernel(name: str, *, validate: bool) -> PagedDecodeAttention:
    """The paged decode attention named ``name`` (``auto`` resolved here)."""
    if name == "auto":
        name = native_backend() or ("cpu" if _cpu_attention_ready() else "reference")
    if name == "reference":
        return ReferencePagedAttention(validate=validate)
    if name == "cpu":
        kernel = CpuPagedAttention(validate=validate)
        library = kernel.library
        if library.handle is None:
            raise KernelUnavailableError(
                f"the cpu paged attention kernel is not available here: {library.reason}"
            )
        return kernel
    require_backend(name)
    return NativePagedAttention(name, validate=validate)


def select_kernels(
    rope: RopeConfig | None = None,
    *,
    fused_rope: str | None = None,
    attention: str | None = None,
    rope_unsupported_reason: str = "",
    validate: bool = False,
    prefill_attention: bool = True,
    quantized_head: bool = True,
    norm_rope: bool = True,
    gated_activation: bool = True,
) -> KernelSet:
    """Choose the kernels for this machine and configuration.

    ``fused_rope`` (default: env ``KV_FUSED_ROPE``, else ``off``): ``off`` leaves RoPE
    unfused (``rope=None``); ``auto`` takes the native backend of this machine (Metal or
    CUDA), else ``reference``; ``reference``, ``metal``, ``cuda`` name one. ``attention``
    (default: env ``KV_PAGED_ATTENTION``, else ``cpu`` where MLX computes on the CPU and the
    C kernel builds, else ``reference``) chooses the paged decode attention: ``reference``
    (gather + MLX operations), ``cpu`` (:class:`CpuPagedAttention`, a C kernel reading the
    pages in place; it hands what it does not serve to the reference), ``metal``, ``cuda``,
    or ``auto`` (the native GPU backend, else ``cpu`` on the CPU, else ``reference``). A
    name that is none of these (argument or environment variable) raises
    :class:`kv_protocol.UnknownBackendError` (a ``KernelUnavailableError`` and a
    ``ValueError``); naming a backend this machine lacks raises
    :class:`kv_protocol.KernelUnavailableError` saying what is missing. When fusion is
    asked for but ``rope`` is ``None`` (the model's RoPE cannot be described, e.g. YaRN;
    pass :func:`rope_config_from_module`'s reason as ``rope_unsupported_reason``) or the
    kernel does not support ``rope``, RoPE stays unfused
    and one log line says why. ``prefill_attention`` (default on) adds a
    :class:`DensePrefillAttention` for the prefill chunks of the layers the engine wraps
    (off: each module's own attention). ``quantized_head`` (default on) adds a
    :class:`CpuQuantizedHead` when MLX computes on the CPU, where its own quantized product
    is slow (the C kernel is built on first use; ``KV_CPU_KERNELS=off`` or no compiler
    leaves MLX's product). ``norm_rope`` (default on) adds a :class:`CpuNormRope` when MLX
    computes on the CPU: a decode step's per-head query and key norms and RoPE as one native
    node each (where the graph calls work; elsewhere it serves nothing);
    ``gated_activation`` (default on) a :class:`CpuGatedActivation` likewise.
    """
    fused = _choice(fused_rope, FUSED_ROPE_ENV, "off", _FUSED_CHOICES, argument="fused_rope")
    attn = _choice(
        attention,
        ATTENTION_ENV,
        "cpu" if _cpu_attention_ready() else "reference",
        _ATTENTION_CHOICES,
        argument="attention",
    )
    native = native_backend()
    on_cpu = mx.default_device().type == mx.cpu
    unfused = KernelSet(
        attention=_attention_kernel(attn, validate=validate),
        rope=None,
        prefill_attention=DensePrefillAttention() if prefill_attention else None,
        quantized_head=CpuQuantizedHead() if quantized_head and on_cpu else None,
        norm_rope=CpuNormRope() if norm_rope and on_cpu else None,
        gated_activation=CpuGatedActivation() if gated_activation and on_cpu else None,
    )
    if fused == "off":
        return unfused
    if fused == "auto":
        fused = native or "reference"
    rope_kernel: RopeScatterKernel
    if fused == "reference":
        rope_kernel = ReferenceRopeScatter(validate=validate)
    else:
        require_backend(fused)
        rope_kernel = NativeRopeScatter(fused, validate=validate)
    if rope is None:
        why = rope_unsupported_reason or "no RoPE configuration was given"
        _log_once(f"fused RoPE + pool scatter ({fused}) disabled, using unfused RoPE: {why}")
        return unfused
    if not rope_kernel.supports(rope):
        _log_once(
            f"fused RoPE + pool scatter ({fused}) disabled, using unfused RoPE: the kernel "
            f"does not support {rope}"
        )
        return unfused
    return replace(unfused, rope=rope_kernel)


def paged_decode_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    page_table: mx.array,
    seq_lens: mx.array,
    *,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    backend: str = "reference",
) -> mx.array:
    """Functional form of :class:`kv_protocol.PagedDecodeAttention` for one call.

    ``backend`` is ``reference`` (default), ``auto``, ``cpu``, ``metal`` or ``cuda``; see
    :class:`ReferencePagedAttention` for the semantics.
    """
    choice = _choice(backend, ATTENTION_ENV, "reference", _ATTENTION_CHOICES, argument="backend")
    kernel = _attention_kernel(choice, validate=False)
    return kernel(
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
