"""Quantized KV storage: the affine 4/8-bit form of ``mx.quantize`` and reads through it.

A quantized K or V buffer is three arrays that share their leading axes: ``data`` (packed
``uint32``, ``head_dim * bits / 32`` words per row), ``scales`` and ``biases`` (one per group of
``group_size`` values along ``head_dim``, in the model's dtype). A row dequantizes to
``scale * q + bias`` per group, exactly what ``mx.dequantize`` computes, so a read of the
stored form is bit-for-bit the same whoever makes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

import mlx.core as mx

from ._errors import LayoutError, ShapeMismatchError
from ._layer_spec import KVGeometry, LayerKind
from ._validate import is_int

__all__ = [
    "KV_QUANT_BITS",
    "KV_QUANT_GROUP_SIZES",
    "KV_QUANT_LAYERS",
    "KVBuffer",
    "KVQuantization",
    "QuantizedKV",
    "check_quantization_keys",
    "check_quantized_shape",
    "gather_slots",
    "kv_quantization_choice",
    "kv_quantization_for",
    "stored_arrays",
]

#: Bit widths a quantized KV page may use.
KV_QUANT_BITS = (4, 8)
#: Group sizes along ``head_dim`` (what ``mx.quantize`` accepts).
KV_QUANT_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, kw_only=True)
class KVQuantization:
    """How a sub-pool stores its K/V: ``bits`` (4 or 8) per value, in groups of ``group_size``.

    Each group of ``group_size`` consecutive values of one head's row keeps a scale and a bias
    in the model's dtype (``mx.quantize``'s affine mode).
    """

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if not is_int(self.bits) or self.bits not in KV_QUANT_BITS:
            raise LayoutError(f"kv_bits must be one of {KV_QUANT_BITS}, got {self.bits!r}")
        if not is_int(self.group_size) or self.group_size not in KV_QUANT_GROUP_SIZES:
            raise LayoutError(
                f"kv_group_size must be one of {KV_QUANT_GROUP_SIZES}, got {self.group_size!r}"
            )

    def check_dim(self, dim: int, what: str) -> None:
        """Refuse a head width the groups do not tile (``LayoutError`` naming ``what``)."""
        if dim % self.group_size:
            fits = [g for g in KV_QUANT_GROUP_SIZES if dim % g == 0]
            hint = f"use kv_group_size {fits[-1]}" if fits else "leave this layer unquantized"
            raise LayoutError(
                f"{what}: head_dim {dim} is not a multiple of kv_group_size {self.group_size}, "
                f"so its rows cannot be quantized in groups ({hint})"
            )

    def row_bytes(self, dim: int, dtype: mx.Dtype) -> int:
        """Stored bytes of one head's row of ``dim`` values: packed data + scales + biases."""
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * dtype.size

    def bytes_per_token(self, geometry: KVGeometry) -> int:
        """Stored bytes of K *and* V for one token of one layer of ``geometry``."""
        return geometry.n_kv_heads * (
            self.row_bytes(geometry.head_dim, geometry.dtype)
            + self.row_bytes(geometry.value_dim, geometry.dtype)
        )

    def quantize(self, x: mx.array) -> QuantizedKV:
        """``x (..., dim)`` in its affine quantized form (groups along the last axis)."""
        data, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return QuantizedKV(data=data, scales=scales, biases=biases, quantization=self)

    def zeros(self, shape: tuple[int, ...], dtype: mx.Dtype) -> QuantizedKV:
        """A quantized buffer of logical ``shape`` (last axis ``dim``) holding zeros (lazy)."""
        *lead, dim = shape
        self.check_dim(dim, f"a buffer of shape {shape}")
        groups = dim // self.group_size
        return QuantizedKV(
            data=mx.zeros((*lead, dim * self.bits // 32), dtype=mx.uint32),
            scales=mx.zeros((*lead, groups), dtype=dtype),
            biases=mx.zeros((*lead, groups), dtype=dtype),
            quantization=self,
        )


@dataclass(frozen=True, kw_only=True)
class QuantizedKV:
    """A K or V buffer (or a gathered part of one) in ``mx.quantize``'s affine form.

    ``shape``, ``ndim`` and ``dtype`` describe the logical (dequantized) array, so shape
    checks read the same as for a plain buffer; ``arrays`` are the three stored arrays.
    """

    data: mx.array
    scales: mx.array
    biases: mx.array
    quantization: KVQuantization

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: the stored leading axes and ``head_dim``."""
        *lead, words = self.data.shape
        return (*lead, words * 32 // self.quantization.bits)

    @property
    def ndim(self) -> int:
        """Rank of the logical array."""
        return self.data.ndim

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype a read returns (the scales' dtype, the model's)."""
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Stored bytes of the three arrays."""
        return self.data.nbytes + self.scales.nbytes + self.biases.nbytes

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        """``(data, scales, biases)``: what evaluating the buffer means."""
        return (self.data, self.scales, self.biases)

    def map(self, fn: Callable[[mx.array], mx.array]) -> QuantizedKV:
        """The same buffer with ``fn`` applied to each stored array (a gather, a slice)."""
        return QuantizedKV(
            data=fn(self.data),
            scales=fn(self.scales),
            biases=fn(self.biases),
            quantization=self.quantization,
        )

    def dequantize(self) -> mx.array:
        """The logical array: ``scale * q + bias`` per group, in :attr:`dtype`."""
        q = self.quantization
        return mx.dequantize(
            self.data, self.scales, self.biases, group_size=q.group_size, bits=q.bits
        )


#: What a pool's layer buffer is: a plain array, or its quantized form.
KVBuffer: TypeAlias = mx.array | QuantizedKV


def stored_arrays(buffer: KVBuffer) -> tuple[mx.array, ...]:
    """The arrays a layer buffer stores: itself, or a quantized one's data, scales, biases."""
    return buffer.arrays if isinstance(buffer, QuantizedKV) else (buffer,)


def gather_slots(buffer: KVBuffer, slots: mx.array) -> mx.array:
    """Rows ``slots`` of a head-major ``(H, num_slots, D)`` buffer as ``(H, T, D)`` values.

    A quantized buffer is gathered in its stored form and dequantized after, so the read
    moves the stored bytes only.
    """
    if isinstance(buffer, QuantizedKV):
        return buffer.map(lambda a: a[:, slots]).dequantize()
    return buffer[:, slots]


def kv_quantization_for(
    quantization: KVQuantization | Mapping[str, KVQuantization | None] | None,
    *,
    sub_pool: str,
    kind: LayerKind,
) -> KVQuantization | None:
    """The quantization of one sub-pool from a pool's ``kv_quantization`` argument.

    ``None`` quantizes nothing; one :class:`KVQuantization` quantizes every sub-pool; a
    mapping names sub-pools (``"full"``, ``"sliding-w128"``) or layer kinds (``"full"``,
    ``"sliding"``), a sub-pool's own name winning over its kind.
    """
    if quantization is None or isinstance(quantization, KVQuantization):
        return quantization
    if not isinstance(quantization, Mapping):
        raise LayoutError(
            "kv_quantization must be a KVQuantization, a mapping from sub-pool name or layer "
            f"kind ('full', 'sliding') to KVQuantization or None, or None; got {quantization!r}"
        )
    for key in (sub_pool, kind.value):
        if key in quantization:
            value = quantization[key]
            if value is not None and not isinstance(value, KVQuantization):
                raise LayoutError(
                    f"kv_quantization[{key!r}] must be a KVQuantization or None, got {value!r}"
                )
            return value
    return None


#: Which layer kinds ``kv_quantization_choice`` quantizes.
KV_QUANT_LAYERS = ("all", "full", "sliding")


def kv_quantization_choice(
    bits: int | None, group_size: int = 64, layers: str = "all"
) -> KVQuantization | dict[str, KVQuantization | None] | None:
    """A pool's ``kv_quantization`` from the flat choice a command line or server offers.

    ``bits`` ``None`` quantizes nothing; else ``layers`` says which kinds: ``"all"``,
    ``"full"`` (sliding layers keep the model's dtype) or ``"sliding"``.
    """
    if layers not in KV_QUANT_LAYERS:
        raise LayoutError(f"kv quantized layers must be one of {KV_QUANT_LAYERS}, got {layers!r}")
    if bits is None:
        return None
    quantization = KVQuantization(bits=bits, group_size=group_size)
    if layers == "all":
        return quantization
    other = "sliding" if layers == "full" else "full"
    return {layers: quantization, other: None}


def check_quantization_keys(
    quantization: KVQuantization | Mapping[str, KVQuantization | None] | None,
    names: list[str],
) -> None:
    """Refuse mapping keys that name neither a sub-pool of ``names`` nor a layer kind."""
    if not isinstance(quantization, Mapping):
        return
    kinds = {LayerKind.FULL.value, LayerKind.SLIDING.value}
    unknown = sorted(str(k) for k in quantization if k not in names and k not in kinds)
    if unknown:
        raise LayoutError(
            f"kv_quantization names {unknown}, which are neither sub-pools {names} nor the "
            f"layer kinds {sorted(kinds)}"
        )


def check_quantized_shape(buffer: QuantizedKV, what: str) -> None:
    """Refuse a quantized buffer whose arrays do not fit together or its quantization.

    The three arrays share their leading axes, the data is ``uint32`` and there is one scale
    and bias per ``group_size`` values of a row.
    """
    lead = buffer.data.shape[:-1]
    if buffer.scales.shape != buffer.biases.shape or buffer.scales.shape[:-1] != lead:
        raise ShapeMismatchError(
            f"{what}: quantized data {tuple(buffer.data.shape)}, scales "
            f"{tuple(buffer.scales.shape)} and biases {tuple(buffer.biases.shape)} must share "
            "their leading axes"
        )
    quant = buffer.quantization
    width = buffer.shape[-1]
    if buffer.data.dtype != mx.uint32 or buffer.scales.shape[-1] * quant.group_size != width:
        raise ShapeMismatchError(
            f"{what}: {quant.bits}-bit data of {width} values per row in groups of "
            f"{quant.group_size} needs uint32 data and {width // quant.group_size} scales per "
            f"row, got {buffer.data.dtype} data and {buffer.scales.shape[-1]} scales"
        )
