"""Native (Metal / CUDA) backends built on MLX's JIT custom kernels."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from kv_protocol import (
    KernelUnavailableError,
    KVBuffer,
    QuantizedKV,
    RopeConfig,
    ShapeMismatchError,
    UnknownBackendError,
)

from ._memo import IdentityMemo
from ._scatter import ScatterPlan, memoized_plan_scatter, scatter_token_rows
from ._sources import (
    CUDA_PAGED_QUANTIZED_SOURCE,
    CUDA_PAGED_SOURCE,
    CUDA_ROPE_SOURCE,
    METAL_PAGED_QUANTIZED_SOURCE,
    METAL_PAGED_SOURCE,
    METAL_ROPE_SOURCE,
    PAGED_SIMD_GROUPS,
    paged_group_size,
)
from ._validate import (
    PagedIndexCheck,
    check_paged_attention_args,
    check_rope_scatter_args,
    check_rope_scatter_values,
)

__all__ = [
    "NATIVE_BACKENDS",
    "NativePagedAttention",
    "NativeRopeScatter",
    "backend_available",
    "merge_partials",
    "native_backend",
    "require_backend",
    "split_plan",
]

#: The native backends this package implements.
NATIVE_BACKENDS = ("metal", "cuda")

_Kernel = Callable[..., list[mx.array]]
_KERNELS: dict[tuple[str, str], _Kernel] = {}


def backend_available(backend: str) -> bool:
    """True if this MLX build can run the ``metal`` or ``cuda`` custom kernels here."""
    try:
        if backend == "metal":
            return bool(mx.metal.is_available())
        if backend == "cuda":
            return bool(mx.cuda.is_available())
    except (AttributeError, RuntimeError):
        return False
    return False


def native_backend() -> str | None:
    """The native backend of this machine (``metal`` or ``cuda``), or ``None``."""
    for backend in NATIVE_BACKENDS:
        if backend_available(backend):
            return backend
    return None


def require_backend(backend: str) -> None:
    """Raise :class:`kv_protocol.KernelUnavailableError` unless ``backend`` can run here.

    A name that is not a native backend at all is a :class:`kv_protocol.UnknownBackendError`
    (also a ``ValueError``).
    """
    if not isinstance(backend, str) or backend not in NATIVE_BACKENDS:
        raise UnknownBackendError(
            f"unknown native kernel backend {backend!r}; expected one of {NATIVE_BACKENDS}"
        )
    if backend_available(backend):
        return
    found = native_backend()
    here = f"this machine's native backend is {found!r}" if found else "no GPU back-end"
    if backend == "metal":
        need = "an MLX build with the Metal back-end (macOS on Apple silicon)"
    else:
        need = "an MLX build with the CUDA back-end (mlx[cuda12] or mlx[cuda13]) and an NVIDIA GPU"
    raise KernelUnavailableError(
        f"kernel backend {backend!r} is not available: it needs {need}, and this MLX "
        f"build has {here}"
    )


def _kernel(backend: str, kind: str) -> _Kernel:
    """Build (once per process) the JIT kernel ``rope``, ``paged`` or ``paged_quantized``."""
    key = (backend, kind)
    cached = _KERNELS.get(key)
    if cached is not None:
        return cached
    outputs = ["part_m", "part_l", "part_acc"]
    if kind == "rope":
        inputs = ["q", "k", "positions", "params", "meta"]
        outputs = ["q_rot", "k_rot"]
        source = METAL_ROPE_SOURCE if backend == "metal" else CUDA_ROPE_SOURCE
    elif kind == "paged":
        inputs = ["q", "k_pool", "v_pool", "page_table", "seq_lens", "params", "meta"]
        source = METAL_PAGED_SOURCE if backend == "metal" else CUDA_PAGED_SOURCE
    else:
        inputs = ["q", "k_data", "k_scales", "k_biases", "v_data", "v_scales", "v_biases"]
        inputs += ["page_table", "seq_lens", "params", "meta"]
        source = METAL_PAGED_QUANTIZED_SOURCE if backend == "metal" else CUDA_PAGED_QUANTIZED_SOURCE
    name = f"kv_{kind}"
    built: Any
    if backend == "metal":
        built = mx.fast.metal_kernel(
            name=name, input_names=inputs, output_names=outputs, source=source
        )
    else:
        built = mx.fast.cuda_kernel(
            name=name, input_names=inputs, output_names=outputs, source=source
        )
    kernel = cast(_Kernel, built)
    _KERNELS[key] = kernel
    return kernel


class NativeRopeScatter:
    """RoPE + pool scatter on the GPU: one JIT kernel rotates q and k, then the pool write.

    The rotation of all q and k heads is one kernel launch computing exactly
    ``mx.fast.rope``'s formula in float32. MLX custom kernels cannot write into an input
    buffer, so the pool write is MLX's scatter (see :func:`scatter_token_rows`), which MLX
    runs in place when the old pool buffer is no longer referenced; a negative slot writes
    nothing, and slots are checked (and their plan kept per array object) on the host as in
    :class:`ReferenceRopeScatter`. Supports every :class:`kv_protocol.RopeConfig`: both
    styles, partial rotary ``dims``, float ``base``, linear ``scale``; f16, bf16, f32.
    """

    def __init__(self, backend: str, *, validate: bool = False) -> None:
        require_backend(backend)
        self._backend = backend
        self._validate = validate
        self._plans: IdentityMemo[ScatterPlan] = IdentityMemo()

    @property
    def name(self) -> str:
        """Backend name: ``metal`` or ``cuda``."""
        return self._backend

    def supports(self, rope: RopeConfig) -> bool:
        """True for every :class:`kv_protocol.RopeConfig` (frequencies from ``base``)."""
        return isinstance(rope, RopeConfig)

    def __call__(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        positions: mx.array,
        slots: mx.array,
        k_pool: mx.array,
        v_pool: mx.array,
        *,
        rope: RopeConfig,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Return ``(q_rot, k_rot, k_pool_new, v_pool_new)``; see the class docstring."""
        check_rope_scatter_args(q, k, v, positions, slots, k_pool, v_pool, rope)
        plan = memoized_plan_scatter(self._plans, slots, k_pool.shape[1])
        if self._validate:
            check_rope_scatter_values(positions)
        t, hq, d = q.shape
        hkv = k.shape[1]
        if t == 0:
            return q, k, k_pool, v_pool
        params = mx.array([rope.scale, math.log2(rope.base)], dtype=mx.float32)
        meta = mx.array([rope.dims, hq, hkv, int(rope.traditional)], dtype=mx.int32)
        q_rot, k_rot = _kernel(self._backend, "rope")(
            inputs=[q, k, positions, params, meta],
            template=[("T", q.dtype), ("D", d)],
            grid=(d // 2, hq + hkv, t),
            threadgroup=(d // 2, 1, 1),
            output_shapes=[q.shape, k.shape],
            output_dtypes=[q.dtype, k.dtype],
            stream=mx.gpu,
        )
        k_new = scatter_token_rows(k_pool, plan, k_rot)
        v_new = scatter_token_rows(v_pool, plan, v)
        return q_rot, k_rot, k_new, v_new


class NativePagedAttention:
    """Paged decode attention reading K/V through the page table inside one JIT kernel.

    One threadgroup (Metal) / block (CUDA) of 8 x 32 threads per (group of query heads that
    share a kv head, request, key range), so each K/V row is read once per group and long
    contexts spread over many blocks (split-K); the ranges' partial softmax states are
    combined by :func:`merge_partials`. No gathered copy of K/V is made. Same contract as
    :class:`ReferencePagedAttention`, including its index-value checks (page ids within
    the pool, ``seq_lens`` in ``1 .. max_pages * page_size``, once per array object, on
    every call with ``validate=True``): the kernel reads the page table directly, so an
    unchecked id would read outside the pool.

    Quantized pools (:class:`kv_protocol.QuantizedKV`, both K and V with one quantization)
    are read by a second kernel of the same algorithm that unpacks each row's values and
    applies its groups' scales and biases as it loads them, so no dequantized copy is made.
    """

    def __init__(self, backend: str, *, validate: bool = False) -> None:
        require_backend(backend)
        self._backend = backend
        self._validate = validate
        self._index_check = PagedIndexCheck()

    @property
    def name(self) -> str:
        """Backend name: ``metal`` or ``cuda``."""
        return self._backend

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
        page_size, scale, window = check_paged_attention_args(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks
        )
        b, hq, _, d = q.shape
        if b == 0:
            return mx.zeros_like(q)
        self._index_check(
            page_table, seq_lens, page_size, k_pool.shape[1], every_call=self._validate
        )
        hkv = k_pool.shape[0]
        if isinstance(k_pool, mx.array) and isinstance(v_pool, mx.array):
            pools: list[mx.array] = [k_pool, v_pool]
            template: list[tuple[str, int]] = []
            kind = "paged"
        else:
            pools, template = _quantized_inputs(k_pool, v_pool)
            kind = "paged_quantized"
        group = paged_group_size(hq, hkv, d)
        capacity = page_table.shape[1] * page_size
        bound = capacity if window is None else min(window, capacity)
        splits, chunk = split_plan(b * (hq // group), bound)
        params = mx.array([float(scale)], dtype=mx.float32)
        meta = mx.array(
            [hq, hkv, page_size, 0 if window is None else window, splits, chunk],
            dtype=mx.int32,
        )
        threads = 32 * PAGED_SIMD_GROUPS
        part_m, part_l, part_acc = _kernel(self._backend, kind)(
            inputs=[q, *pools, page_table, seq_lens, params, meta],
            template=[("T", q.dtype), ("D", d), ("G", group), *template],
            grid=(threads, hq // group, b * splits),
            threadgroup=(threads, 1, 1),
            output_shapes=[(b, splits, hq), (b, splits, hq), (b, splits, hq, d)],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
            stream=mx.gpu,
        )
        return merge_partials(part_m, part_l, part_acc, sinks).astype(q.dtype)[:, :, None, :]


def _quantized_inputs(
    k_pool: KVBuffer, v_pool: KVBuffer
) -> tuple[list[mx.array], list[tuple[str, int]]]:
    """The quantized kernel's six pool inputs and its ``BITS`` / ``GS`` template values."""
    if not (isinstance(k_pool, QuantizedKV) and isinstance(v_pool, QuantizedKV)):
        raise ShapeMismatchError("k_pool and v_pool must both be quantized or both plain")
    quant = k_pool.quantization
    if v_pool.quantization != quant:
        raise ShapeMismatchError(
            f"k_pool and v_pool must share one quantization, got {quant} and {v_pool.quantization}"
        )
    return [*k_pool.arrays, *v_pool.arrays], [("BITS", quant.bits), ("GS", quant.group_size)]


#: Blocks to aim for per paged-attention launch before splitting contexts further.
_TARGET_BLOCKS = 512
#: Fewest keys one split should walk (8 warps x 32 keys).
_MIN_SPLIT_KEYS = 256


def split_plan(blocks: int, bound: int) -> tuple[int, int]:
    """``(splits, chunk)``: how many key ranges of ``chunk`` positions each request uses.

    ``blocks`` is the launch size without splitting, ``bound`` an upper bound of the keys one
    request sees (the page table's width, or the window). Splits are added until the launch
    reaches about ``_TARGET_BLOCKS`` blocks, keeping at least ``_MIN_SPLIT_KEYS`` keys each.
    """
    wanted = max(1, -(-_TARGET_BLOCKS // max(blocks, 1)))
    splits = max(1, min(wanted, bound // _MIN_SPLIT_KEYS, 64))
    return splits, -(-bound // splits)


def merge_partials(
    part_m: mx.array, part_l: mx.array, part_acc: mx.array, sinks: mx.array | None
) -> mx.array:
    """Combine per-split softmax states ``(B, S, Hq)``, ``(B, S, Hq)``, ``(B, S, Hq, D)``.

    Split ``s`` holds its running maximum ``m``, denominator ``l`` and unnormalised output
    ``acc``, both relative to ``exp(m)``; a split that saw no key has ``m = -inf``, ``l = 0``.
    The sink logit (one per head) joins the denominator only. Returns ``(B, Hq, D)`` float32;
    a row with no key and no sink is 0.
    """
    top = mx.max(part_m, axis=1)
    if sinks is not None:
        top = mx.maximum(top, sinks.astype(mx.float32)[None, :])
    finite_top = mx.where(mx.isinf(top), 0.0, top)
    weight = mx.where(mx.isinf(part_m), 0.0, mx.exp(part_m - finite_top[:, None, :]))
    denom = mx.sum(weight * part_l, axis=1)
    if sinks is not None:
        denom = denom + mx.exp(sinks.astype(mx.float32)[None, :] - finite_top)
    numer = mx.sum(weight[..., None] * part_acc, axis=1)
    safe = mx.where(denom > 0, denom, 1.0)
    return mx.where((denom > 0)[..., None], numer / safe[..., None], 0.0)
