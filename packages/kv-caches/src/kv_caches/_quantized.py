"""A per-request KV cache storing keys and values 4- or 8-bit affine quantized."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, ShapeMismatchError

from ._checks import check_choice, check_positive
from ._storage import StorageCache

__all__ = ["QuantizedAttentionKVCache"]

_NAME = "QuantizedAttentionKVCache"
_BITS = (4, 8)
_GROUP_SIZES = (32, 64, 128)
#: The dtypes ``mx.quantize`` takes (float64 fails only when the graph is evaluated).
_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

#: ``(packed uint32, scales, biases)`` as ``mx.quantize`` returns them.
QuantizedTriple = tuple[mx.array, mx.array, mx.array]


class QuantizedAttentionKVCache(StorageCache[tuple[QuantizedTriple, QuantizedTriple]]):
    """Every token of one request and layer, quantized with ``mx.quantize`` (affine).

    Keys and values are stored as ``(packed, scales, biases)`` triples of shape
    ``(B, H, capacity, D * bits / 32)`` and ``(B, H, capacity, D / group_size)``. The cache
    exposes ``bits`` and ``group_size``, which is what routes mlx-lm's attention to its
    quantized path; ``update_and_fetch`` returns the triples of every token held. Storage
    starts at ``max_seq_len`` tokens and at least doubles when full (fresh buffers, copied).
    ``reset`` releases the buffers.
    """

    _NAME = _NAME

    def __init__(self, bits: int = 8, group_size: int = 64, max_seq_len: int = 256) -> None:
        self._bits = check_choice(f"{_NAME}: bits", bits, _BITS)
        self._group_size = check_choice(f"{_NAME}: group_size", group_size, _GROUP_SIZES)
        super().__init__(initial_capacity=check_positive("max_seq_len", max_seq_len))

    def __repr__(self) -> str:
        return (
            f"{_NAME}(bits={self._bits}, group_size={self._group_size}, "
            f"offset={self._offset}, capacity={self.capacity})"
        )

    @property
    def bits(self) -> int:
        """Bits per quantized element (mlx-lm dispatches quantized attention on this)."""
        return self._bits

    @property
    def group_size(self) -> int:
        """Elements sharing one scale and bias."""
        return self._group_size

    # -- storage ---------------------------------------------------------------------------

    def _buffer_layout(self) -> tuple[tuple[int, mx.Dtype], ...]:
        """Packed uint32, scales and biases for the keys, then for the values."""
        assert self._geometry is not None and self._dtype is not None
        _, _, k_dim, v_dim = self._geometry
        layout: list[tuple[int, mx.Dtype]] = []
        for dim in (k_dim, v_dim):
            groups = dim // self._group_size
            layout += [
                (dim * self._bits // 32, mx.uint32),
                (groups, self._dtype),
                (groups, self._dtype),
            ]
        return tuple(layout)

    def _check_head_dim(self, dim: int, what: str) -> None:
        if dim < 1 or dim % self._group_size:
            raise ShapeMismatchError(
                f"{_NAME}: {what} head dimension {dim} must be divisible by group_size "
                f"{self._group_size} to be quantized"
            )

    def _check_new(self, keys: mx.array, values: mx.array) -> None:
        if keys.dtype not in _FLOAT_DTYPES:
            raise ShapeMismatchError(
                f"{_NAME}: keys must be floating point (float16, bfloat16 or float32) to be "
                f"quantized, got {keys.dtype}"
            )
        self._check_head_dim(keys.shape[3], "key")
        self._check_head_dim(values.shape[3], "value")

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        q_keys = mx.quantize(keys, group_size=self._group_size, bits=self._bits)
        q_values = mx.quantize(values, group_size=self._group_size, bits=self._bits)
        return (*q_keys, *q_values)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[QuantizedTriple, QuantizedTriple]:
        """Quantize and append ``(B, H, S, D)`` keys/values; return the triples of all tokens."""
        self._append(keys, values)
        return self._state()

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The tokens held as ``(B, H, offset, D)`` arrays in the original dtype."""
        keys, values = self._state()
        return (
            mx.dequantize(*keys, group_size=self._group_size, bits=self._bits),
            mx.dequantize(*values, group_size=self._group_size, bits=self._bits),
        )

    # -- mlx-lm cache protocol -------------------------------------------------------------

    def _state(self) -> tuple[QuantizedTriple, QuantizedTriple]:
        """``(key triple, value triple)`` of the tokens held."""
        k0, k1, k2, v0, v1, v2 = self._held()
        return (k0, k1, k2), (v0, v1, v2)

    def _load_state(self, value: Any) -> None:
        try:
            (k0, k1, k2), (v0, v1, v2) = value
        except (TypeError, ValueError):
            raise CacheStateError(
                f"{_NAME}: state must be ((packed, scales, biases), (packed, scales, biases))"
            ) from None
        parts = (k0, k1, k2, v0, v1, v2)
        if not all(isinstance(p, mx.array) and p.ndim == 4 for p in parts):
            raise ShapeMismatchError(f"{_NAME}: every state array must be a 4-D mlx array")
        if len({p.shape[:3] for p in parts}) != 1 or k0.dtype != mx.uint32 or v0.dtype != mx.uint32:
            raise ShapeMismatchError(
                f"{_NAME}: state arrays must share (B, H, S) and the packed arrays be uint32"
            )
        if (
            k1.dtype not in _FLOAT_DTYPES
            or len({k1.dtype, k2.dtype, v1.dtype, v2.dtype}) != 1
            or k1.shape != k2.shape
            or v1.shape != v2.shape
        ):
            raise ShapeMismatchError(
                f"{_NAME}: the scales and biases must share one float dtype (float16, bfloat16 "
                "or float32) and the shape of each triple"
            )
        batch, heads, n_tokens, _ = k0.shape
        k_dim = k1.shape[3] * self._group_size
        v_dim = v1.shape[3] * self._group_size
        if (
            min(batch, heads, n_tokens, k_dim, v_dim) < 1
            or k0.shape[3] * 32 != k_dim * self._bits
            or v0.shape[3] * 32 != v_dim * self._bits
        ):
            raise ShapeMismatchError(
                f"{_NAME}: state does not match bits={self._bits}, group_size={self._group_size} "
                "(or holds no token)"
            )
        self._release()
        self._geometry = (batch, heads, k_dim, v_dim)
        self._dtype = k1.dtype
        self._store(parts, n_tokens)
