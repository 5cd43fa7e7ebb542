"""Prefill attention for the engine's wrapped layers: the CPU softmax, else MLX's fused SDPA."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import MaskSpec, ShapeMismatchError

from ._softmax_cpu import prefill_softmax_attention, unfused_softmax_choice, use_unfused_softmax

__all__ = ["DensePrefillAttention"]


class DensePrefillAttention:
    """A prefill chunk's attention with ``mx.fast.scaled_dot_product_attention``'s contract.

    On MLX's CPU backend (``unfused_softmax=None`` decides by the default device when
    called) it is composed with the softmax of :func:`softmax_parts`: MLX's CPU attention is
    unfused anyway and its ``exp``, element by element, is most of a prefill's attention
    (17 of 21 ms a layer at 384 tokens, 8 heads of 64, on a 2-core x86_64). Elsewhere it is
    MLX's fused kernel itself. Satisfies :class:`kv_protocol.PrefillAttention`.
    """

    def __init__(self, *, unfused_softmax: bool | None = None) -> None:
        self._unfused_softmax = unfused_softmax_choice(unfused_softmax)

    @property
    def name(self) -> str:
        """Backend name: ``dense``."""
        return "dense"

    def __call__(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: MaskSpec,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention ``(B, Hq, T, D)``; see :class:`kv_protocol.PrefillAttention`."""
        if q.ndim != 4 or keys.ndim != 4 or values.shape != keys.shape:
            raise ShapeMismatchError(
                f"prefill attention expects q (B, Hq, T, D) and keys/values (B, Hkv, S, D) of "
                f"one shape, got q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                f"{tuple(values.shape)}"
            )
        if q.shape[1] % keys.shape[1] or q.shape[3] != keys.shape[3]:
            raise ShapeMismatchError(
                f"{q.shape[1]} query heads of {q.shape[3]} do not group over "
                f"{keys.shape[1]} KV heads of {keys.shape[3]}"
            )
        if use_unfused_softmax(self._unfused_softmax):
            return prefill_softmax_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
        return mx.fast.scaled_dot_product_attention(
            q,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=None if sinks is None else sinks.astype(q.dtype),
        )
