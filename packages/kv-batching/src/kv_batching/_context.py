"""The per-step batched decode context: lengths, RoPE offsets and the padding rule of a window."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    FusedRopeConfigError,
    KernelSet,
    KVLifetime,
    LayerKind,
    LayerKindError,
    RequestStateError,
    ShapeMismatchError,
    as_int,
    check_int,
)

__all__ = ["FUSED_ROPE_MAP_ERROR", "BatchedDecodeContext"]

#: The exact message raised when the fused kernel is active without the full-layer map.
FUSED_ROPE_MAP_ERROR = (
    "BatchedDecodeContext requires full_kv_pool_index_by_layer when the fused AOT RoPE + "
    "pool-scatter kernel is active"
)


def _checked_lengths(request_ids: Sequence[int], seq_lens: Sequence[int]) -> None:
    if len(request_ids) == 0:
        raise RequestStateError(
            "BatchedDecodeContext needs at least one request; got an empty batch"
        )
    if len(request_ids) != len(seq_lens):
        raise RequestStateError(
            f"BatchedDecodeContext got {len(request_ids)} request ids but "
            f"{len(seq_lens)} seq_lens; expected one length per request"
        )
    if len(set(request_ids)) != len(request_ids) and not _verification_rows(request_ids, seq_lens):
        duplicates = sorted({r for r in request_ids if list(request_ids).count(r) > 1})
        raise RequestStateError(f"request ids must be unique in a batch; duplicated: {duplicates}")
    for rid, length in zip(request_ids, seq_lens, strict=True):
        check_int(rid, "request id")
        check_int(length, f"seq_len of request {rid}", minimum=0)


def _verification_rows(request_ids: Sequence[int], seq_lens: Sequence[int]) -> bool:
    """Whether every repeated id is one request's run of adjacent rows at consecutive positions.

    A speculative verification gives a request one row per query position (its last token
    and each proposed token); anything else repeating an id is a mistake.
    """
    seen: set[int] = set()
    previous: int | None = None
    for index, rid in enumerate(request_ids):
        if rid == previous:
            if seq_lens[index] != seq_lens[index - 1] + 1:
                return False
            continue
        if rid in seen:
            return False
        seen.add(rid)
        previous = rid
    return True


def _checked_layer_map(value: object, what: str) -> Mapping[int, int]:
    """A read-only copy of a layer-id map whose keys and values are ints (not floats)."""
    if not isinstance(value, Mapping):
        raise LayerKindError(f"{what} must be a mapping of layer id -> index, got {value!r}")
    for key, index in value.items():
        if as_int(key) is None or as_int(index) is None:
            raise LayerKindError(
                f"{what} must map int layer ids to int indices, got {key!r}: {index!r}"
            )
    return MappingProxyType({int(k): int(v) for k, v in value.items()})


@dataclass(frozen=True, eq=False, kw_only=True)
class BatchedDecodeContext:
    """Everything one batched decode step shares across the model's attention layers.

    ``seq_lens[b]`` counts the tokens request ``b`` already has cached, i.e. it is the
    position of the token being decoded. A request verifying a speculative proposal takes
    several adjacent rows, one per query position (consecutive ``seq_lens``): each row sees
    the keys up to its own position, so the proposal is attended causally. Derived once at
    construction: ``offsets`` (int32 ``(B,)``, the RoPE positions), ``max_len =
    max(seq_lens) + 1``, ``valid_lens = offsets + 1`` (keys per request including the new
    one), ``needs_padding``,
    ``pad_sizes`` (right padding to ``max_len`` per request) and ``positions``
    (``arange(max_len)`` when padding is needed, else ``None``).

    ``attention_pool_index_by_layer`` maps a global layer id to the id under which the
    pool addresses that layer; it defaults to the identity over the layout's attention
    layers (kv-protocol pools translate global ids themselves). ``full_kv_pool_index_by_layer``
    maps each FULL layer to its dense index among full layers; the fused RoPE + scatter
    kernel is only ever addressed through it, and every entry is checked against the
    layout. The pool side of a step (slots, page tables, each layer's view) is a
    :class:`~kv_batching.DecodeStep` built around this context.
    """

    request_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    layout: CacheLayout
    aot: KernelSet
    attention_pool_index_by_layer: Mapping[int, int] | None = None
    full_kv_pool_index_by_layer: Mapping[int, int] = field(default_factory=dict)

    batch_size: int = field(init=False)
    offsets: mx.array = field(init=False, repr=False)
    max_len: int = field(init=False)
    valid_lens: mx.array = field(init=False, repr=False)
    needs_padding: bool = field(init=False)
    pad_sizes: tuple[int, ...] = field(init=False)
    positions: mx.array | None = field(init=False, repr=False)
    _padding_by_window: dict[int | None, tuple[list[int], mx.array | None]] = field(
        init=False, repr=False
    )

    def __post_init__(self) -> None:
        setter = object.__setattr__
        request_ids = tuple(self.request_ids)
        seq_lens = tuple(self.seq_lens)
        _checked_lengths(request_ids, seq_lens)
        setter(self, "request_ids", request_ids)
        setter(self, "seq_lens", seq_lens)
        layout = self.layout

        if self.attention_pool_index_by_layer is None:
            attention_map: Mapping[int, int] = MappingProxyType(
                {layer_id: layer_id for layer_id in layout.attention_layer_ids}
            )
        else:
            attention_map = _checked_layer_map(
                self.attention_pool_index_by_layer, "attention_pool_index_by_layer"
            )
            for layer_id in attention_map:
                if layer_id not in layout.attention_index_by_layer:
                    raise LayerKindError(
                        f"attention_pool_index_by_layer names layer {layer_id!r}, which is not "
                        f"an attention layer; attention layers: {layout.attention_layer_ids}"
                    )
        setter(self, "attention_pool_index_by_layer", attention_map)

        full_map = _checked_layer_map(
            self.full_kv_pool_index_by_layer, "full_kv_pool_index_by_layer"
        )
        for layer_id, index in full_map.items():
            if layer_id not in layout.full_attention_layer_id_mapping:
                kind = (
                    layout.kind(layer_id).value
                    if isinstance(layer_id, int) and 0 <= layer_id < layout.num_layers
                    else "unknown"
                )
                raise LayerKindError(
                    f"full_kv_pool_index_by_layer names layer {layer_id!r} ({kind}), which is "
                    f"not a full-attention layer; full layers: {layout.full_layer_ids}"
                )
            expected = layout.full_pool_index(layer_id)
            if index != expected:
                raise LayerKindError(
                    f"full_kv_pool_index_by_layer maps layer {layer_id} to {index!r}, but the "
                    f"layout's full-pool index of that layer is {expected}"
                )
        setter(self, "full_kv_pool_index_by_layer", full_map)
        if self.aot.rope is not None and not full_map:
            raise FusedRopeConfigError(FUSED_ROPE_MAP_ERROR)

        longest = max(seq_lens)
        setter(self, "batch_size", len(seq_lens))
        setter(self, "offsets", mx.array(seq_lens, dtype=mx.int32))
        setter(self, "max_len", longest + 1)
        setter(self, "valid_lens", mx.array([s + 1 for s in seq_lens], dtype=mx.int32))
        setter(self, "needs_padding", min(seq_lens) < longest)
        setter(self, "pad_sizes", tuple(longest - s for s in seq_lens))
        setter(self, "positions", mx.arange(longest + 1) if min(seq_lens) < longest else None)
        setter(self, "_padding_by_window", {})

    def visible_keys(self, window: int | None) -> list[int]:
        """Keys each request's decode query sees, itself included (:class:`KVLifetime`).

        ``seq_len + 1`` on a full layer (``window=None``), ``min(seq_len + 1, window)`` on a
        sliding one: the query at position ``p`` sees positions ``p - window + 1 .. p``.
        """
        if window is not None:
            window = check_int(window, "window", minimum=1, error=ShapeMismatchError)
        lifetime = KVLifetime(window)
        return [lifetime.visible_keys(s) for s in self.seq_lens]

    def decode_padding(self, window: int | None) -> tuple[list[int], mx.array | None]:
        """Right padding of each request's keys to one width, and the keep-mask.

        Full layers (``window=None``): width ``max(seq_len + 1)``. Sliding layers: each
        request sees ``min(seq_len + 1, window)`` keys (itself included) and the width is
        the largest of those. Returns ``(pad_sizes, mask)`` where ``mask`` is boolean ``(B,
        1, 1, width)``, True for kept keys (``[0, valid)`` of each row), or ``None`` when
        no row needs padding. Memoised per window for the life of the context.
        """
        cached = self._padding_by_window.get(window)
        if cached is not None:
            return list(cached[0]), cached[1]
        valid = self.visible_keys(window)
        width = max(valid)
        pads = [width - v for v in valid]
        mask: mx.array | None = None
        if any(pads):
            keep = mx.arange(width)[None, :] < mx.array(valid, dtype=mx.int32)[:, None]
            mask = keep.reshape(len(valid), 1, 1, width)
        self._padding_by_window[window] = (pads, mask)
        return list(pads), mask

    def pool_layer(self, layer_id: int) -> int:
        """The id under which the pool addresses attention layer ``layer_id``."""
        index_map = self.attention_pool_index_by_layer
        index = index_map.get(layer_id) if index_map is not None else None
        if index is None:
            raise LayerKindError(
                f"{layer_id=} not in attention_pool_index_by_layer: "
                f"{index_map.keys() if index_map is not None else '{}'}"
            )
        return index

    def window(self, layer_id: int) -> int | None:
        """The sliding window of ``layer_id`` per the layout, ``None`` for a full layer."""
        spec = self.layout.spec(layer_id)
        if spec.kind is LayerKind.STATE:
            raise LayerKindError(f"{layer_id=} is a STATE layer; batched decode has no KV there")
        return spec.window
