"""The cache layout: every layer's spec and the checked global-id -> pool-index mappings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ._errors import LayerKindError, LayoutError
from ._layer_spec import KVGeometry, LayerKind, LayerSpec
from ._lifetime import KVLifetime
from ._validate import as_int

__all__ = ["CacheLayout"]


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _index(mapping: Mapping[int, int], layer_id: object) -> int | None:
    """``mapping[layer_id]`` for an int id (not a bool or float), else ``None``.

    A plain dict lookup would find key ``1`` for ``1.0`` (and ``True``) and raise a bare
    ``TypeError`` for ``[1]``; here both are simply not ids, so the caller raises its
    ``LayerKindError`` with the same text as for an unknown id.
    """
    key = as_int(layer_id)
    return None if key is None else mapping.get(key)


def _dense(ids: tuple[int, ...]) -> Mapping[int, int]:
    return MappingProxyType({layer_id: index for index, layer_id in enumerate(ids)})


@dataclass(frozen=True)
class CacheLayout:
    """All layers of a model with their KV lifetimes, and the two kinds of layer index.

    A *global* layer id is the model's own layer number. A *pool index* is the dense index of
    a layer among the layers of its kind (``full_pool_index``, ``sliding_pool_index``) or
    among all attention layers (``attention_index``). Mixing the two silently writes the wrong
    buffer, so every translation goes through a lookup that fails loudly for a layer of
    another kind.

    Build it from specs whose ids are unique and contiguous from 0 (in any order)::

        sliding = LayerSpec(
            layer_id=0, kind=LayerKind.SLIDING, window=128, n_kv_heads=8, head_dim=64
        )
        full = LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=8, head_dim=64)
        layout = CacheLayout([sliding, full])
        layout.full_pool_index(1)  # 0
    """

    specs: tuple[LayerSpec, ...]
    attention_layer_ids: tuple[int, ...] = field(init=False, compare=False)
    full_layer_ids: tuple[int, ...] = field(init=False, compare=False)
    sliding_layer_ids: tuple[int, ...] = field(init=False, compare=False)
    state_layer_ids: tuple[int, ...] = field(init=False, compare=False)
    attention_index_by_layer: Mapping[int, int] = field(init=False, repr=False, compare=False)
    full_attention_layer_id_mapping: Mapping[int, int] = field(
        init=False, repr=False, compare=False
    )
    sliding_layer_id_mapping: Mapping[int, int] = field(init=False, repr=False, compare=False)

    def __init__(self, specs: Iterable[LayerSpec]) -> None:
        if isinstance(specs, str | bytes | LayerSpec) or not isinstance(specs, Iterable):
            raise LayoutError(
                f"CacheLayout takes an iterable of LayerSpec objects, got {type(specs).__name__}"
            )
        given = list(specs)
        for spec in given:
            if not isinstance(spec, LayerSpec):
                raise LayoutError(f"CacheLayout takes LayerSpec objects, got {spec!r}")
        ordered = tuple(sorted(given, key=lambda s: s.layer_id))
        if not ordered:
            raise LayoutError("CacheLayout needs at least one layer spec")
        ids = [s.layer_id for s in ordered]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise LayoutError(f"layer ids must be unique; duplicated: {duplicates}")
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise LayoutError(
                f"layer ids must be contiguous from 0; missing: {missing} (got {ids})"
            )
        attention = tuple(s.layer_id for s in ordered if s.kind is not LayerKind.STATE)
        full = tuple(s.layer_id for s in ordered if s.kind is LayerKind.FULL)
        sliding = tuple(s.layer_id for s in ordered if s.kind is LayerKind.SLIDING)
        state = tuple(s.layer_id for s in ordered if s.kind is LayerKind.STATE)
        setter = object.__setattr__
        setter(self, "specs", ordered)
        setter(self, "attention_layer_ids", attention)
        setter(self, "full_layer_ids", full)
        setter(self, "sliding_layer_ids", sliding)
        setter(self, "state_layer_ids", state)
        setter(self, "attention_index_by_layer", _dense(attention))
        setter(self, "full_attention_layer_id_mapping", _dense(full))
        setter(self, "sliding_layer_id_mapping", _dense(sliding))

    @property
    def num_layers(self) -> int:
        """Number of layers of every kind."""
        return len(self.specs)

    @property
    def has_sliding_layers(self) -> bool:
        """True when at least one layer is a sliding-window layer."""
        return bool(self.sliding_layer_ids)

    def spec(self, layer_id: int) -> LayerSpec:
        """The spec of ``layer_id``; a ``LayerKindError`` for an id that is not a layer."""
        number = as_int(layer_id)
        if number is None:
            raise LayerKindError(f"{layer_id=} is not a layer id of this layout")
        if not 0 <= number < len(self.specs):
            raise LayerKindError(
                f"{layer_id=} not in layers: valid ids are 0..{len(self.specs) - 1}"
            )
        return self.specs[number]

    def kind(self, layer_id: int) -> LayerKind:
        """The lifetime kind of ``layer_id``."""
        return self.spec(layer_id).kind

    def window(self, layer_id: int) -> int | None:
        """The sliding window of ``layer_id``, or ``None`` for a full or state layer."""
        return self.spec(layer_id).window

    def lifetime(self, layer_id: int) -> KVLifetime:
        """Which cached positions ``layer_id``'s queries see (see :class:`KVLifetime`)."""
        return self.spec(layer_id).lifetime

    def geometry(self, layer_id: int) -> KVGeometry:
        """The KV geometry of attention layer ``layer_id``."""
        return self.spec(layer_id).geometry

    def full_pool_index(self, layer_id: int) -> int:
        """Dense index of ``layer_id`` among FULL layers; raises for any other id."""
        mapping = self.full_attention_layer_id_mapping
        index = _index(mapping, layer_id)
        if index is None:
            raise LayerKindError(f"{layer_id=} not in full attention layers: {mapping.keys()}")
        return index

    def sliding_pool_index(self, layer_id: int) -> int:
        """Dense index of ``layer_id`` among SLIDING layers; raises for any other id."""
        mapping = self.sliding_layer_id_mapping
        index = _index(mapping, layer_id)
        if index is None:
            raise LayerKindError(f"{layer_id=} not in sliding window layers: {mapping.keys()}")
        return index

    def attention_index(self, layer_id: int) -> int:
        """Dense index of ``layer_id`` among all attention layers; raises for any other id."""
        mapping = self.attention_index_by_layer
        index = _index(mapping, layer_id)
        if index is None:
            raise LayerKindError(f"{layer_id=} not in attention layers: {mapping.keys()}")
        return index

    def full_kv_bytes_per_token(self) -> int:
        """K+V bytes per token if every attention layer kept its whole context."""
        return sum(self.geometry(i).bytes_per_token for i in self.attention_layer_ids)

    def describe(self) -> str:
        """A human-readable multi-line summary of the layout."""
        lines = [
            f"{self.num_layers} layers: {len(self.full_layer_ids)} full, "
            f"{len(self.sliding_layer_ids)} sliding, {len(self.state_layer_ids)} state"
        ]
        for spec in self.specs:
            if spec.kind is LayerKind.STATE:
                lines.append(f"  layer {spec.layer_id:3d}  state")
                continue
            index = (
                self.full_pool_index(spec.layer_id)
                if spec.kind is LayerKind.FULL
                else self.sliding_pool_index(spec.layer_id)
            )
            window = f" window={spec.window}" if spec.window is not None else ""
            v_dim = f" (V {spec.v_head_dim})" if spec.v_head_dim is not None else ""
            lines.append(
                f"  layer {spec.layer_id:3d}  {spec.kind.value:<7s} pool index {index:3d}  "
                f"{spec.n_kv_heads} kv heads x {spec.head_dim}{v_dim} "
                f"{_dtype_name(spec.dtype)}{window}"
            )
        return "\n".join(lines)
