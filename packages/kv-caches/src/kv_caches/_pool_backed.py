"""A per-request, per-layer view onto a paged KV pool, speaking mlx-lm's cache protocol."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import (
    CacheStateError,
    KVPool,
    LayerKind,
    LayerKindError,
    MaskSpec,
    Reservation,
    ShapeMismatchError,
    UnknownRequestError,
    stored_arrays,
)

from ._checks import check_count, check_kv, check_trim
from ._masks import make_attention_mask, trailing_window_mask

__all__ = ["PoolBackedKVCache"]

_NAME = "PoolBackedKVCache"


class PoolBackedKVCache:
    """mlx-lm's cache protocol for one request and one layer, with the K/V in a ``KVPool``.

    ``update_and_fetch`` writes the new tokens into the pool's slots and reads back exactly
    what attention needs: every token for a full layer, the last ``min(offset, window - 1)``
    old tokens plus the chunk for a sliding one. The cache keeps no copy of the K/V;
    ``offset`` is absolute.

    Given the chunk's ``reservation`` (from the pool's ``try_reserve_batch``, one row for this
    request), the cache starts at the reservation's start length and writes the chunk into the
    reserved slots: it never reserves or asks the pool for the new slots. Without one,
    ``offset`` defaults to the request's ``seq_len`` and ``update_and_fetch`` reserves the
    room it is missing (so the first layer of a forward reserves for all).
    """

    def __init__(
        self,
        pool: KVPool,
        request_id: int,
        layer_id: int,
        *,
        offset: int | None = None,
        reservation: Reservation | None = None,
    ) -> None:
        if not isinstance(pool, KVPool):
            raise TypeError(
                f"{_NAME}: pool must implement kv_protocol.KVPool, got {type(pool).__name__}"
            )
        spec = pool.layout.spec(layer_id)
        if spec.kind is LayerKind.STATE:
            raise LayerKindError(
                f"{_NAME}: layer {layer_id} is a STATE layer and stores no K/V in the pool"
            )
        if not pool.has_request(request_id):
            raise UnknownRequestError(f"{_NAME}: request {request_id!r} is not in the pool")
        seq_len = pool.seq_len(request_id)
        self._reserved: tuple[int, int, mx.array] | None = None
        if reservation is not None:
            if not isinstance(reservation, Reservation) or reservation.request_ids != (request_id,):
                raise CacheStateError(
                    f"{_NAME}: the reservation must hold request {request_id!r} alone, got "
                    f"{reservation!r}"
                )
            start = reservation.start_lengths[0]
            if offset is None:
                offset = start
            slots = reservation.slots.get(pool.sub_pool_of(layer_id))
            if slots is not None:
                self._reserved = (start, reservation.n_tokens[0], slots)
        if offset is None:
            offset = seq_len
        offset = check_count("offset", offset)
        if offset > seq_len:
            raise CacheStateError(
                f"{_NAME}: offset {offset} is past the {seq_len} positions request "
                f"{request_id} has reserved"
            )
        self._pool = pool
        self._request_id = request_id
        self._layer_id = layer_id
        self._window = spec.window
        self._lifetime = spec.lifetime
        geometry = spec.geometry
        self._geometry = (1, geometry.n_kv_heads, geometry.head_dim, geometry.value_dim)
        self._dtype = geometry.dtype
        self._offset = offset

    def __repr__(self) -> str:
        kind = "full" if self._window is None else f"sliding window={self._window}"
        return (
            f"{_NAME}(request={self._request_id}, layer={self._layer_id}, {kind}, "
            f"offset={self._offset})"
        )

    @property
    def pool(self) -> KVPool:
        """The pool holding the K/V."""
        return self._pool

    @property
    def request_id(self) -> int:
        """The request this cache reads and writes."""
        return self._request_id

    @property
    def layer_id(self) -> int:
        """The model's global layer id."""
        return self._layer_id

    @property
    def window(self) -> int | None:
        """The layer's sliding window, or ``None`` for a full layer."""
        return self._window

    @property
    def offset(self) -> int:
        """Absolute number of tokens of the request this layer has processed."""
        return self._offset

    def _read_start(self, stop: int) -> int:
        """First position attention reads for queries ending at ``stop``: 0 for a full layer."""
        return self._lifetime.first_visible(stop)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(1, H, S, D)`` keys/values into the pool; return what attention needs.

        Returns ``(1, H, n, D)`` for positions ``0 .. offset + S - 1`` (full layer) or
        ``max(0, offset - window + 1) .. offset + S - 1`` (sliding layer).

        Everything is checked (shapes, the pool's dtype) before the pool is touched, and a
        reservation this call made is given back if the write or the read fails, so a failed
        call leaves the request and the cache as they were.
        """
        keys, values = check_kv(_NAME, keys, values, expect=self._geometry, dtype=self._dtype)
        pool, rid, layer = self._pool, self._request_id, self._layer_id
        n_new = keys.shape[2]
        stop = self._offset + n_new
        reserved, self._reserved = self._reserved, None
        missing = 0
        if reserved is not None and reserved[:2] == (self._offset, n_new):
            slots = reserved[2]
        else:
            missing = stop - pool.seq_len(rid)
            if missing > 0:
                pool.reserve(rid, missing)
            slots = None
        try:
            if slots is None:
                slots = pool.token_slots(rid, layer, self._offset, stop)
            pool.set_kv(layer, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))
            read = pool.token_slots(rid, layer, self._read_start(self._offset), stop)
            out_k, out_v = pool.get_kv(layer, read)
        except BaseException:
            if missing > 0:
                pool.trim_request(rid, missing)
            raise
        self._offset = stop
        return out_k.transpose(1, 0, 2)[None], out_v.transpose(1, 0, 2)[None]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> MaskSpec:
        """The mask for ``N`` new queries over the keys ``update_and_fetch`` will return."""
        if self._window is None:
            return make_attention_mask(N, self._offset, return_array, window_size)
        if isinstance(window_size, int) and window_size > self._window:
            # The pool keeps what the layout's window needs; a wider mask contradicts the
            # layout, even before any key is dropped.
            raise CacheStateError(
                f"{_NAME} of sliding layer {self._layer_id}: the model asks for an attention "
                f"mask over window_size={window_size} but the layer's window is {self._window} "
                "(from the model's make_cache()); its attention and its caches disagree, so "
                "the pool cannot keep what it reads"
            )
        return trailing_window_mask(
            N,
            self._offset,
            self._window,
            return_array,
            window_size,
            owner=f"{_NAME} of sliding layer {self._layer_id}",
        )

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The layer's pool buffers: evaluating them completes this cache's pending writes.

        K then V; a quantized layer's buffers give their data, scales and biases each.
        """
        return (
            *stored_arrays(self._pool.get_key_buffer(self._layer_id)),
            *stored_arrays(self._pool.get_value_buffer(self._layer_id)),
        )

    @state.setter
    def state(self, value: Any) -> None:
        raise CacheStateError(
            f"{_NAME} is a view onto a KV pool; its state cannot be replaced (write through "
            "update_and_fetch or the pool)"
        )

    def is_trimmable(self) -> bool:
        """True for a full layer; a sliding layer's pool may have released older pages."""
        return self._window is None

    def trim(self, n: int) -> int:
        """Move the offset of a full layer back by ``n``; the pool keeps the positions."""
        if self._window is not None:
            raise CacheStateError(
                f"{_NAME} of sliding layer {self._layer_id} cannot be trimmed: the pool may "
                "have released the pages the earlier window needs"
            )
        n = check_trim(_NAME, n, self._offset)
        self._offset -= n
        return n

    def size(self) -> int:
        """Tokens the request holds for this layer (its offset)."""
        return self._offset

    @property
    def nbytes(self) -> int:
        """0: the K/V live in the pool, which accounts for them."""
        return 0

    def empty(self) -> bool:
        """True while the request holds no token for this layer."""
        return self._offset == 0

    def to_arrays(self) -> tuple[mx.array, mx.array]:
        """Every token ``0 .. offset - 1`` as ``(1, H, offset, D)`` arrays.

        For a sliding layer this works only while the pool still holds every position; the
        pool raises for released ones.
        """
        if self._offset == 0:
            raise CacheStateError(f"{_NAME} holds no token yet")
        read = self._pool.token_slots(self._request_id, self._layer_id, 0, self._offset)
        keys, values = self._pool.get_kv(self._layer_id, read)
        if keys.ndim != 3:
            raise ShapeMismatchError(
                f"{_NAME}: pool.get_kv returned shape {tuple(keys.shape)}, expected (T, H, D)"
            )
        return keys.transpose(1, 0, 2)[None], values.transpose(1, 0, 2)[None]
