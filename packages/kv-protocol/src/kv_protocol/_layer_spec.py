"""Per-layer KV specifications: the lifetime kind and the KV geometry of one layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx

from ._errors import LayerKindError, LayoutError
from ._lifetime import KVLifetime
from ._validate import check_int

__all__ = ["KVGeometry", "LayerKind", "LayerSpec"]


class LayerKind(enum.Enum):
    """How long a layer's KV must live.

    ``FULL`` keeps every token, ``SLIDING`` only the trailing ``window`` tokens, ``STATE``
    (recurrent or linear attention) keeps a fixed-size state and stores nothing in a KV pool.
    """

    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


@dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """The shape of one token's K and V in one layer, of ``dtype``.

    K is ``n_kv_heads x head_dim``; V is ``n_kv_heads x v_head_dim``, where ``v_head_dim``
    ``None`` means V is as wide as K (the common case; latent attention caches and models
    such as MiMo-V2 store narrower V).
    """

    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    v_head_dim: int | None = None

    @property
    def value_dim(self) -> int:
        """The width of one V head: ``v_head_dim``, or ``head_dim`` when V is as wide as K."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K *and* V for one token of one layer."""
        return self.n_kv_heads * (self.head_dim + self.value_dim) * self.dtype.size


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """What the KV cache must know about one model layer.

    ``window`` is required for (and only for) ``SLIDING`` layers and counts the keys a query
    sees, itself included: the query at position ``p`` attends to positions
    ``p - window + 1 .. p``. ``n_kv_heads`` and ``head_dim`` are required for attention
    layers and may be ``None`` for ``STATE`` layers. ``v_head_dim`` is the width of a V head
    where it differs from ``head_dim``; ``None`` (the default, and what a value equal to
    ``head_dim`` is stored as, so equal geometries compare equal) means V is as wide as K.
    """

    layer_id: int
    kind: LayerKind
    window: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: mx.Dtype = mx.float32
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        # Ids, windows and head counts are ints (not bools, not floats such as 8.0, which
        # would name a sub-pool "sliding-w8.0"); integer types such as numpy's are stored as
        # plain ints.
        setter = object.__setattr__
        layer_id = check_int(self.layer_id, "layer_id", minimum=0, error=LayoutError)
        setter(self, "layer_id", layer_id)
        if not isinstance(self.kind, LayerKind):
            raise LayoutError(f"kind must be a LayerKind, got {self.kind!r}")
        if self.kind is LayerKind.SLIDING:
            if self.window is None:
                raise LayoutError(
                    f"window must be an int >= 1 for SLIDING layer {layer_id}, got None"
                )
            window = check_int(
                self.window, f"window of SLIDING layer {layer_id}", minimum=1, error=LayoutError
            )
            setter(self, "window", window)
        elif self.window is not None:
            raise LayoutError(
                f"window must be None for {self.kind.name} layer {layer_id}, got {self.window!r}"
            )
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is None:
                if self.kind is not LayerKind.STATE:
                    raise LayoutError(f"{name} is required for {self.kind.name} layer {layer_id}")
                continue
            number = check_int(value, f"{name} of layer {layer_id}", minimum=1, error=LayoutError)
            setter(self, name, number)
        if self.v_head_dim is not None:
            if self.kind is LayerKind.STATE:
                raise LayoutError(
                    f"v_head_dim must be None for STATE layer {layer_id}, got {self.v_head_dim!r}"
                )
            v_dim = check_int(
                self.v_head_dim, f"v_head_dim of layer {layer_id}", minimum=1, error=LayoutError
            )
            setter(self, "v_head_dim", None if v_dim == self.head_dim else v_dim)
        if not isinstance(self.dtype, mx.Dtype):
            raise LayoutError(f"dtype must be an mlx dtype, got {self.dtype!r}")

    @property
    def is_attention(self) -> bool:
        """True for layers that store K/V (``FULL`` and ``SLIDING``)."""
        return self.kind is not LayerKind.STATE

    @property
    def lifetime(self) -> KVLifetime:
        """Which cached positions this layer's queries see (the trailing window, or all)."""
        return KVLifetime(self.window)

    @property
    def geometry(self) -> KVGeometry:
        """The KV geometry of an attention layer; a ``LayerKindError`` for a ``STATE`` layer."""
        if self.n_kv_heads is None or self.head_dim is None:
            raise LayerKindError(f"layer {self.layer_id} is a STATE layer and stores no K/V")
        return KVGeometry(
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            v_head_dim=self.v_head_dim,
        )
