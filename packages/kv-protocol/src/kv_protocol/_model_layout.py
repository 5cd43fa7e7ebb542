"""Read a :class:`CacheLayout` off an mlx-lm model instance without running it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import UnsupportedModelError
from ._layer_spec import LayerKind, LayerSpec
from ._layout import CacheLayout

__all__ = [
    "ATTENTION_CHILD_NAMES",
    "KV_HEAD_NAMES",
    "attention_module",
    "find_layers",
    "first_attr",
    "language_model_container",
    "layout_from_model",
    "model_args",
]

#: Attribute names under which a decoder layer holds its attention module, in lookup order.
ATTENTION_CHILD_NAMES = ("self_attn", "attention", "attn", "self_attention")
SLIDING_FLAG_NAMES = (
    "is_sliding",
    "use_sliding",
    "is_sliding_window",
    "use_sliding_window",
    "is_swa",
)
WINDOW_NAMES = ("window_size", "sliding_window")
#: Attribute names of an attention module's KV head count, in lookup order.
KV_HEAD_NAMES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv")
SLIDING_LAYER_TYPES = frozenset({"sliding_attention", "sliding_window_attention", "local"})
FULL_LAYER_TYPES = frozenset({"full_attention", "attention", "global"})
STATE_LAYER_TYPES = frozenset(
    {"linear_attention", "mamba", "mamba2", "recurrent", "ssm", "conv", "gated_delta"}
)


def first_attr(obj: object, names: Sequence[str]) -> Any:
    """The value of the first of ``names`` that ``obj`` has and is not ``None``, else None."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def model_args(model: object) -> object | None:
    """The model's ``args`` (its ``ModelArgs``), looked up on the model and its children."""
    for candidate in (model, getattr(model, "language_model", None)):
        args: object | None = getattr(candidate, "args", None)
        if args is not None:
            return args
    return None


def language_model_container(model: object) -> object:
    """The module that owns the decoder ``layers`` list (``model.model`` in most mlx-lm models)."""
    candidates: list[object] = [model]
    for name in ("model", "language_model", "text_model"):
        child = getattr(model, name, None)
        if child is not None:
            candidates.append(child)
            grandchild = getattr(child, "model", None)
            if grandchild is not None:
                candidates.append(grandchild)
    for candidate in candidates[1:] + candidates[:1]:
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, list | tuple) and layers:
            return candidate
    raise UnsupportedModelError(
        f"cannot find the decoder layers of {type(model).__name__}: expected a non-empty "
        "`layers` list on the model or on model.model / model.language_model"
    )


def find_layers(model: object) -> list[Any]:
    """The decoder layers of an mlx-lm model, in order."""
    return list(getattr(language_model_container(model), "layers"))  # noqa: B009


def attention_module(layer: object) -> Any | None:
    """The attention child of a decoder layer (duck-typed: has q/k/v projections), or None."""
    for name in ATTENTION_CHILD_NAMES:
        child = getattr(layer, name, None)
        if child is not None and all(hasattr(child, p) for p in ("q_proj", "k_proj", "v_proj")):
            return child
    return None


def _layer_types(model: object, container: object, args: object | None) -> list[str] | None:
    for owner in (container, model, args):
        types = getattr(owner, "layer_types", None) if owner is not None else None
        if isinstance(types, list | tuple):
            return [str(t) for t in types]
    return None


def _kv_dtype(attn: Any) -> mx.Dtype:
    weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    if isinstance(weight, mx.array) and mx.issubdtype(weight.dtype, mx.floating):
        return weight.dtype
    scales = getattr(getattr(attn, "k_proj", None), "scales", None)
    if isinstance(scales, mx.array):
        return scales.dtype
    return mx.float32


def _geometry(attn: Any, args: object | None, layer_id: int) -> tuple[int, int]:
    n_kv = first_attr(attn, KV_HEAD_NAMES)
    if n_kv is None and args is not None:
        n_kv = first_attr(args, ("num_key_value_heads", "num_kv_heads")) or getattr(
            args, "num_attention_heads", None
        )
    k_weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    k_out = int(k_weight.shape[0]) if isinstance(k_weight, mx.array) else None
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None and n_kv and k_out:
        head_dim = k_out // int(n_kv)
    if not n_kv or not head_dim:
        raise UnsupportedModelError(
            f"cannot determine the KV geometry (n_kv_heads, head_dim) of layer {layer_id}"
        )
    if k_out is not None and k_out != int(n_kv) * int(head_dim):
        raise UnsupportedModelError(
            f"layer {layer_id}: k_proj produces {k_out} features, expected "
            f"n_kv_heads * head_dim = {n_kv} * {head_dim}"
        )
    return int(n_kv), int(head_dim)


def layout_from_model(model: object, *, dtype: mx.Dtype | None = None) -> CacheLayout:
    """Build the :class:`CacheLayout` of an mlx-lm model from its configuration.

    A layer's kind comes from, in order: a sliding flag on the layer or its attention module
    (``is_sliding``, ``use_sliding``, ``use_sliding_window`` ...), the ``layer_types`` list,
    or ``sliding_window_pattern`` (layer ``i`` is global iff ``i % pattern == pattern - 1``).
    A layer with no q/k/v attention child is a ``STATE`` layer. Windows come from the
    attention module or the model's ``sliding_window``; geometry from each attention module.
    ``dtype`` overrides the KV dtype (default: the dtype of each layer's ``k_proj``).

    Raises ``UnsupportedModelError`` when the model declares a sliding window that no layer
    map assigns to layers, or when a sliding layer has no window.
    """
    container = language_model_container(model)
    layers = list(getattr(container, "layers"))  # noqa: B009
    args = model_args(model)
    layer_types = _layer_types(model, container, args)
    pattern = first_attr(args, ("sliding_window_pattern",)) if args is not None else None
    model_window = None
    for owner in (args, container, model):
        if owner is not None and model_window is None:
            model_window = first_attr(owner, ("sliding_window", "window_size"))
    if layer_types is not None and len(layer_types) != len(layers):
        raise UnsupportedModelError(
            f"layer_types lists {len(layer_types)} entries for {len(layers)} layers"
        )

    specs: list[LayerSpec] = []
    mapped_by_any = layer_types is not None or pattern is not None
    for layer_id, layer in enumerate(layers):
        attn = attention_module(layer)
        if attn is None:
            specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
            continue
        flag = first_attr(attn, SLIDING_FLAG_NAMES)
        if flag is None:
            flag = first_attr(layer, SLIDING_FLAG_NAMES)
        if flag is not None:
            mapped_by_any = True
            sliding = bool(flag)
        elif layer_types is not None:
            kind_name = layer_types[layer_id]
            if kind_name in STATE_LAYER_TYPES:
                specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
                continue
            if kind_name not in SLIDING_LAYER_TYPES | FULL_LAYER_TYPES:
                raise UnsupportedModelError(
                    f"layer {layer_id} has attention projections but layer type {kind_name!r}, "
                    "which is neither full, sliding nor a known recurrent type; refusing to "
                    "guess its KV lifetime"
                )
            sliding = kind_name in SLIDING_LAYER_TYPES
        elif pattern is not None:
            sliding = layer_id % int(pattern) != int(pattern) - 1
        else:
            sliding = False
        n_kv, head_dim = _geometry(attn, args, layer_id)
        window = None
        if sliding:
            window = first_attr(attn, WINDOW_NAMES) or model_window
            if window is None:
                raise UnsupportedModelError(
                    f"layer {layer_id} is a sliding-window layer but the model declares no "
                    "window size (sliding_window / window_size)"
                )
        specs.append(
            LayerSpec(
                layer_id=layer_id,
                kind=LayerKind.SLIDING if sliding else LayerKind.FULL,
                window=int(window) if window is not None else None,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                dtype=dtype if dtype is not None else _kv_dtype(attn),
            )
        )
    if model_window is not None and not mapped_by_any:
        raise UnsupportedModelError(
            f"{type(model).__name__} declares sliding_window={model_window} but maps it to no "
            "layer (no layer_types, sliding_window_pattern or per-layer sliding flag); "
            "refusing to guess which layers are windowed"
        )
    return CacheLayout(specs)
