"""The data-free per-layer cache object that carries the batched context into a layer."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, MaskSpec

from ._context import BatchedDecodeContext

__all__ = ["BatchedLayerCache", "batched_layer_caches"]


class BatchedLayerCache:
    """What the model container hands layer ``layer_id`` during one batched decode step.

    It stores nothing: ``state == ()``, ``offset = max(seq_lens)`` (so containers that read
    an offset see a sane scalar) and ``make_mask`` answers ``None`` for the single decode
    query (the attention wrapper applies each request's own length and window). A patched
    attention module recognises it and takes the batched path with ``context``; an
    unpatched module that tries to store into it fails loudly.
    """

    __slots__ = ("context", "layer_id")

    def __init__(self, context: BatchedDecodeContext, layer_id: int) -> None:
        self.context = context
        self.layer_id = layer_id

    @property
    def offset(self) -> int:
        """The largest number of cached tokens in the batch (a scalar, for containers)."""
        return self.context.max_len - 1

    @property
    def state(self) -> tuple[()]:
        """Nothing: the K/V live in the pool."""
        return ()

    def make_mask(
        self, N: int, *, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """``None`` for the one decode query; batched decode has no multi-token mask."""
        if N != 1:
            raise CacheStateError(
                f"BatchedLayerCache serves single-token batched decode only; asked for a mask "
                f"of {N} queries (prefill and extend go through per-request caches)"
            )
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Always raises: only a patched attention module may run on this cache."""
        raise CacheStateError(
            f"BatchedLayerCache of layer {self.layer_id} should not store data: the layer's "
            "attention module is not patched (call patch_model_attention(model) first)"
        )

    def is_trimmable(self) -> bool:
        """False: there is nothing to trim."""
        return False

    def trim(self, n: int) -> int:
        """Trims nothing and returns 0."""
        return 0

    @property
    def nbytes(self) -> int:
        """0: the shim holds no arrays."""
        return 0

    def empty(self) -> bool:
        """True: the shim never holds data."""
        return True

    def __repr__(self) -> str:
        return (
            f"BatchedLayerCache(layer_id={self.layer_id}, batch={self.context.batch_size}, "
            f"offset={self.offset})"
        )


def batched_layer_caches(context: BatchedDecodeContext) -> list[Any]:
    """One :class:`BatchedLayerCache` per model layer, ready to pass as ``cache=``."""
    return [BatchedLayerCache(context, layer_id) for layer_id in range(context.layout.num_layers)]
