"""A per-request KV cache storing keys and values 4- or 8-bit affine quantized."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, LayoutError, MaskSpec, ShapeMismatchError

from ._checks import check_kv, check_positive, check_trim
from ._masks import make_attention_mask

__all__ = ["QuantizedAttentionKVCache"]

_NAME = "QuantizedAttentionKVCache"
_BITS = (4, 8)
_GROUP_SIZES = (32, 64, 128)

#: ``(packed uint32, scales, biases)`` as ``mx.quantize`` returns them.
QuantizedTriple = tuple[mx.array, mx.array, mx.array]


class QuantizedAttentionKVCache:
    """Every token of one request and layer, quantized with ``mx.quantize`` (affine).

    Keys and values are stored as ``(packed, scales, biases)`` triples of shape
    ``(B, H, capacity, D * bits / 32)`` and ``(B, H, capacity, D / group_size)``. The cache
    exposes ``bits`` and ``group_size``, which is what routes mlx-lm's attention to its
    quantized path; ``update_and_fetch`` returns the triples of every token held. Storage
    starts at ``max_seq_len`` tokens and at least doubles when full (fresh buffers, copied).
    """

    def __init__(self, bits: int = 8, group_size: int = 64, max_seq_len: int = 256) -> None:
        if isinstance(bits, bool) or bits not in _BITS:
            raise LayoutError(f"{_NAME}: bits must be one of {_BITS}, got {bits!r}")
        if isinstance(group_size, bool) or group_size not in _GROUP_SIZES:
            raise LayoutError(
                f"{_NAME}: group_size must be one of {_GROUP_SIZES}, got {group_size!r}"
            )
        self._bits = bits
        self._group_size = group_size
        self._max_seq_len = check_positive("max_seq_len", max_seq_len)
        self._keys: QuantizedTriple | None = None
        self._values: QuantizedTriple | None = None
        self._geometry: tuple[int, int, int, int] | None = None
        self._dtype: mx.Dtype | None = None
        self._offset = 0
        self._allocations = 0

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

    @property
    def offset(self) -> int:
        """Tokens held (the absolute position of the next token)."""
        return self._offset

    @property
    def capacity(self) -> int:
        """Tokens the current buffers can hold before they grow (0 before allocation)."""
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    @property
    def allocations(self) -> int:
        """How many times buffers were allocated (the first allocation included)."""
        return self._allocations

    # -- storage ---------------------------------------------------------------------------

    def _check_head_dim(self, dim: int, what: str) -> None:
        if dim % self._group_size:
            raise ShapeMismatchError(
                f"{_NAME}: {what} head dimension {dim} must be divisible by group_size "
                f"{self._group_size} to be quantized"
            )

    def _empty_triple(self, batch: int, heads: int, capacity: int, dim: int) -> QuantizedTriple:
        assert self._dtype is not None
        shape = (batch, heads, capacity)
        return (
            mx.zeros((*shape, dim * self._bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // self._group_size), dtype=self._dtype),
            mx.zeros((*shape, dim // self._group_size), dtype=self._dtype),
        )

    def _allocate(self, capacity: int) -> None:
        """Bind fresh zero buffers of ``capacity`` tokens holding a copy of ``[:offset]``."""
        assert self._geometry is not None
        batch, heads, k_dim, v_dim = self._geometry
        new_k = self._empty_triple(batch, heads, capacity, k_dim)
        new_v = self._empty_triple(batch, heads, capacity, v_dim)
        if self._keys is not None and self._values is not None and self._offset:
            for new, old in zip(new_k + new_v, self._keys + self._values, strict=True):
                # A new graph node: arrays built from the old buffers keep reading them.
                new[:, :, : self._offset, :] = old[:, :, : self._offset, :]
        self._keys, self._values = new_k, new_v
        self._allocations += 1

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[QuantizedTriple, QuantizedTriple]:
        """Quantize and append ``(B, H, S, D)`` keys/values; return the triples of all tokens."""
        keys, values = check_kv(_NAME, keys, values, expect=self._geometry, dtype=self._dtype)
        if not mx.issubdtype(keys.dtype, mx.floating):
            raise ShapeMismatchError(f"{_NAME}: keys must be floating point, got {keys.dtype}")
        self._check_head_dim(keys.shape[3], "key")
        self._check_head_dim(values.shape[3], "value")
        n_new = keys.shape[2]
        if self._keys is None:
            self._geometry = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            self._dtype = keys.dtype
            self._allocate(max(self._max_seq_len, self._offset + n_new))
        elif self._offset + n_new > self.capacity:
            self._allocate(max(2 * self.capacity, self._offset + n_new))
        assert self._keys is not None and self._values is not None
        stop = self._offset + n_new
        q_keys = mx.quantize(keys, group_size=self._group_size, bits=self._bits)
        q_values = mx.quantize(values, group_size=self._group_size, bits=self._bits)
        for buffer, part in zip(self._keys + self._values, [*q_keys, *q_values], strict=True):
            buffer[:, :, self._offset : stop, :] = part
        self._offset = stop
        return self._held()

    def _held(self) -> tuple[QuantizedTriple, QuantizedTriple]:
        if self._keys is None or self._values is None:
            raise CacheStateError(f"{_NAME} holds no data yet: nothing has been written")
        if self._offset == self.capacity:
            return self._keys, self._values
        stop = self._offset
        k0, k1, k2 = (x[:, :, :stop, :] for x in self._keys)
        v0, v1, v2 = (x[:, :, :stop, :] for x in self._values)
        return (k0, k1, k2), (v0, v1, v2)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The tokens held as ``(B, H, offset, D)`` arrays in the original dtype."""
        keys, values = self._held()
        return (
            mx.dequantize(*keys, group_size=self._group_size, bits=self._bits),
            mx.dequantize(*values, group_size=self._group_size, bits=self._bits),
        )

    # -- mlx-lm cache protocol -------------------------------------------------------------

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask for ``N`` new queries over all tokens held (as mlx-lm's caches)."""
        return make_attention_mask(N, self._offset, return_array, window_size)

    @property
    def state(self) -> tuple[QuantizedTriple, QuantizedTriple] | tuple[()]:
        """``(key triple, value triple)`` of the tokens held; ``()`` before the first write."""
        if self._keys is None:
            return ()
        return self._held()

    @state.setter
    def state(self, value: Any) -> None:
        if not value:
            self.reset()
            return
        try:
            (k0, k1, k2), (v0, v1, v2) = value
        except (TypeError, ValueError):
            raise CacheStateError(
                f"{_NAME}: state must be ((packed, scales, biases), (packed, scales, biases))"
            ) from None
        parts = (k0, k1, k2, v0, v1, v2)
        if not all(isinstance(p, mx.array) and p.ndim == 4 for p in parts):
            raise ShapeMismatchError(f"{_NAME}: every state array must be a 4-D mlx array")
        if len({p.shape[:3] for p in parts}) != 1 or k0.dtype != mx.uint32:
            raise ShapeMismatchError(
                f"{_NAME}: state arrays must share (B, H, S) and the packed arrays be uint32"
            )
        batch, heads, n_tokens, _ = k0.shape
        k_dim = k1.shape[3] * self._group_size
        v_dim = v1.shape[3] * self._group_size
        if k0.shape[3] * 32 != k_dim * self._bits or v0.shape[3] * 32 != v_dim * self._bits:
            raise ShapeMismatchError(
                f"{_NAME}: state does not match bits={self._bits}, group_size={self._group_size}"
            )
        self.reset()
        self._geometry = (batch, heads, k_dim, v_dim)
        self._dtype = k1.dtype
        self._keys = self._values = None
        self._allocate(max(self._max_seq_len, n_tokens))
        assert self._keys is not None and self._values is not None
        for buffer, part in zip(self._keys + self._values, parts, strict=True):
            buffer[:, :, :n_tokens, :] = part
        self._offset = n_tokens

    def is_trimmable(self) -> bool:
        """True: ``trim`` moves the offset back."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (``0 <= n <= offset``); returns ``n``."""
        n = check_trim(_NAME, n, self._offset)
        self._offset -= n
        return n

    def reset(self) -> None:
        """Forget every token and release the buffers."""
        self._keys = self._values = None
        self._geometry = None
        self._dtype = None
        self._offset = 0

    def size(self) -> int:
        """Tokens held."""
        return self._offset

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated packed arrays, scales and biases."""
        if self._keys is None or self._values is None:
            return 0
        return int(sum(x.nbytes for x in self._keys + self._values))

    def empty(self) -> bool:
        """True while the cache holds no token."""
        return self._offset == 0
