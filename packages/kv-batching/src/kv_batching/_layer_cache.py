"""The per-layer cache objects that carry one batched decode step into a model's layers.

Two decode paths, chosen per layer when the engine is built:

* the patched fast path: :class:`BatchedLayerCache` stores nothing; the layer's attention is
  wrapped by :class:`~kv_batching.BatchedAttention`, which recognises it and runs the fused
  RoPE + scatter and the paged attention kernels;
* the universal path: :class:`PoolDecodeCache` is handed to the *unmodified* attention
  module the way mlx-lm's batch caches are: ``offset`` is the int32 array of per-row
  positions, ``update_and_fetch`` writes the step's K/V into the pool and returns what each
  row attends to, gathered from the pool and right-padded to one width, and ``make_mask``
  the matching keep-mask. Any attention that calls ``cache.update_and_fetch`` and builds its
  mask from the cache works, whatever its projections, norms or scalings.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import CacheStateError, MaskSpec, ShapeMismatchError, gather_slots

from ._decode_step import DecodeStep, LayerStep

__all__ = [
    "BatchedLayerCache",
    "PoolDecodeCache",
    "batched_layer_caches",
    "decode_mask",
]


def decode_mask(
    layer: LayerStep, N: int, *, window_size: int | None, return_array: bool
) -> MaskSpec:
    """The keep-mask a single-query batched decode step needs for ``layer``'s keys.

    ``window_size`` (what a model container asks for) wins over the layer's own window, as
    mlx-lm's caches do. ``None`` when no row needs padding, unless ``return_array``.
    """
    return layer.make_mask(N, window_size=window_size, return_array=return_array)


class _LayerStepCache:
    """What both decode caches share: the layer's step view, no data of their own, a mask.

    The cache keeps its step alive (the step's layer views refer to it weakly).
    """

    __slots__ = ("_step", "layer")

    def __init__(self, layer: LayerStep) -> None:
        self.layer = layer
        self._step = layer.step

    @property
    def layer_id(self) -> int:
        """The model layer this cache serves."""
        return self.layer.layer_id

    @property
    def state(self) -> tuple[()]:
        """Nothing: the K/V live in the pool."""
        return ()

    def make_mask(
        self, N: int, *, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The keep-mask of this layer's keys for the one decode query (see :func:`decode_mask`)."""
        return self.layer.make_mask(N, window_size=window_size, return_array=return_array)

    def is_trimmable(self) -> bool:
        """False: the pool, not this per-step view, owns the tokens."""
        return False

    def trim(self, n: int) -> int:
        """Trims nothing and returns 0."""
        return 0

    @property
    def nbytes(self) -> int:
        """0: the view holds no arrays of its own."""
        return 0


class BatchedLayerCache(_LayerStepCache):
    """What the model container hands layer ``layer_id`` during one batched decode step.

    It stores nothing: ``state == ()``, ``offset = max(seq_lens)`` (so containers that read
    an offset see a sane scalar) and ``make_mask`` answers the same keep-mask as
    :class:`PoolDecodeCache` (the wrapper ignores it and applies each request's own length
    and window; a universal layer that shares the container's mask needs it). A patched
    attention module recognises it and takes the batched path with its :class:`LayerStep`.
    """

    __slots__ = ()

    @property
    def offset(self) -> int:
        """The largest number of cached tokens in the batch (a scalar, for containers)."""
        return self.layer.context.max_len - 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Always raises: a layer on the fast path runs through its attention wrapper."""
        raise CacheStateError(
            f"layer {self.layer_id} was planned for the patched fast path, but its attention "
            "module is not wrapped any more (was the model unpatched after the engine was "
            "built?); build the engine again, or with decode_path='universal'"
        )

    def empty(self) -> bool:
        """True: the shim never holds data."""
        return True

    def __repr__(self) -> str:
        return (
            f"BatchedLayerCache(layer_id={self.layer_id}, batch={self.layer.context.batch_size}, "
            f"offset={self.offset})"
        )


class PoolDecodeCache(_LayerStepCache):
    """The universal path's cache of layer ``layer_id`` for one batched decode step.

    Handed to the unmodified attention module: ``offset`` is the ``(B,)`` int32 array of
    per-row positions (mlx-lm's RoPE accepts it); ``update_and_fetch(keys, values)`` writes
    the ``(B, n_kv_heads, 1, head_dim)`` new K/V at the step's slots of the layer's sub-pool
    and returns ``(B, n_kv_heads, width, head_dim)`` K/V, each row its visible keys oldest
    first (:meth:`DecodeStep.visible_slots`), right-padded; ``make_mask`` returns
    the matching ``(B, 1, 1, width)`` keep-mask, ``None`` when no row is padded.
    """

    __slots__ = ()

    @property
    def offset(self) -> mx.array:
        """Per-row positions of the decoded tokens (int32 ``(B,)``)."""
        return self.layer.context.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's K/V into the pool; return each row's visible K/V, right-padded."""
        layer = self.layer
        layer_id = layer.layer_id
        batch = layer.context.batch_size
        if keys.ndim != 4 or keys.shape[0] != batch or keys.shape[2] != 1:
            raise ShapeMismatchError(
                f"layer {layer_id}: batched decode expects keys of shape ({batch}, n_kv_heads, "
                f"1, head_dim), got {tuple(keys.shape)}"
            )
        if values.shape[:3] != keys.shape[:3]:
            raise ShapeMismatchError(
                f"layer {layer_id}: values {tuple(values.shape)} do not match keys "
                f"{tuple(keys.shape)}"
            )
        pool = layer.pool
        pool_layer = layer.pool_layer
        pool.set_kv(pool_layer, layer.new_token_slots, keys[:, :, 0, :], values[:, :, 0, :])
        slots = layer.visible_slots()
        width = slots.shape[1]
        flat = slots.reshape(-1)
        gathered_k = gather_slots(pool.get_key_buffer(pool_layer), flat)
        gathered_v = gather_slots(pool.get_value_buffer(pool_layer), flat)
        heads = gathered_k.shape[0]
        k = gathered_k.reshape(heads, batch, width, -1).transpose(1, 0, 2, 3)
        v = gathered_v.reshape(heads, batch, width, -1).transpose(1, 0, 2, 3)
        return k, v

    def empty(self) -> bool:
        """False: the layer has cached tokens in the pool."""
        return False

    def __repr__(self) -> str:
        return f"PoolDecodeCache(layer_id={self.layer_id}, batch={self.layer.context.batch_size})"


def batched_layer_caches(step: DecodeStep) -> list[Any]:
    """One cache per model layer, ready to pass as ``cache=`` for one batched decode step.

    Attention layers on the ``universal`` route get a :class:`PoolDecodeCache`, every other
    attention layer a :class:`BatchedLayerCache` (its attention must be wrapped), each with
    its own :class:`LayerStep`. STATE layers get ``None``: their stacked recurrent states go
    there (:func:`~kv_batching._state_cache.install_stacked_states`).
    """
    caches: list[Any] = []
    for layer_id in range(step.context.layout.num_layers):
        view = step.layers.get(layer_id)
        if view is None:
            caches.append(None)
        elif view.route == "universal":
            caches.append(PoolDecodeCache(view))
        else:
            caches.append(BatchedLayerCache(view))
    return caches
