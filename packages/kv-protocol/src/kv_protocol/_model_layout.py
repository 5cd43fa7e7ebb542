"""Read a :class:`CacheLayout` off an mlx-lm model instance without running it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import UnsupportedModelError
from ._layer_spec import LayerKind, LayerSpec
from ._layout import CacheLayout
from ._validate import as_int, check_int

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
    "is_local",
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


def _refuse(field: str, value: object, expected: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{field}={value!r} is not supported: expected {expected}")


def _layer_types(model: object, container: object, args: object | None) -> list[str] | None:
    """The ``layer_types`` list (one layer-type name per layer), or ``None`` if not declared."""
    for owner in (container, model, args):
        types = getattr(owner, "layer_types", None) if owner is not None else None
        if types is None:
            continue
        if isinstance(types, str | bytes) or not isinstance(types, list | tuple):
            raise _refuse("layer_types", types, "a list of layer-type names, one per layer")
        for index, name in enumerate(types):
            if not isinstance(name, str):
                raise _refuse(
                    f"layer_types[{index}]", name, "a layer-type name such as 'full_attention'"
                )
        return list(types)
    return None


def _global_layers(pattern: object, num_layers: int) -> list[bool] | None:
    """Which layers ``sliding_window_pattern`` makes global (full attention), or ``None``.

    Two forms occur in real configurations, read as mlx-lm reads them:

    - an int ``N >= 1`` (Gemma 3, Cohere2, PLaMo 3): every ``N``-th layer is global, i.e.
      layer ``i`` is global iff ``(i + 1) % N == 0`` (``N = 1``: every layer is global);
    - a string of ``L`` (local, sliding window) and ``G`` (global) letters, one per layer,
      repeated over the layers (EXAONE 4, e.g. ``"LLLG"``): layer ``i`` is global iff
      ``pattern[i % len(pattern)] == "G"``.

    Anything else (0, a negative number, a float such as ``6.0``, a bool, other letters, an
    empty string) is refused with an ``UnsupportedModelError`` naming the value.
    """
    if pattern is None:
        return None
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise _refuse(
                "sliding_window_pattern",
                pattern,
                "an int >= 1 or a non-empty string of 'L' (local) and 'G' (global) letters "
                "such as 'LLLG'",
            )
        return [pattern[i % len(pattern)] == "G" for i in range(num_layers)]
    every = as_int(pattern)
    if every is None or every < 1:
        raise _refuse(
            "sliding_window_pattern",
            pattern,
            "an int >= 1 (every N-th layer is global) or a string of 'L' (local) and 'G' "
            "(global) letters such as 'LLLG'",
        )
    return [(i + 1) % every == 0 for i in range(num_layers)]


def _named_attr(obj: object, names: Sequence[str]) -> tuple[str, Any]:
    """``(name, value)`` of the first of ``names`` that ``obj`` has and is not ``None``."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return name, value
    return "", None


def _sliding_flag(layer: object, attn: object, layer_id: int) -> bool | None:
    """The layer's own sliding flag (on its attention module, else on the layer), if any."""
    name, flag = _named_attr(attn, SLIDING_FLAG_NAMES)
    if flag is None:
        name, flag = _named_attr(layer, SLIDING_FLAG_NAMES)
    if flag is None:
        return None
    if isinstance(flag, bool):
        return flag
    if as_int(flag) in (0, 1):
        return bool(as_int(flag))
    raise _refuse(f"layer {layer_id}: {name}", flag, "a bool")


def _kv_dtype(attn: Any) -> mx.Dtype:
    weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    if isinstance(weight, mx.array) and mx.issubdtype(weight.dtype, mx.floating):
        return weight.dtype
    scales = getattr(getattr(attn, "k_proj", None), "scales", None)
    if isinstance(scales, mx.array):
        return scales.dtype
    return mx.float32


def _geometry(attn: Any, args: object | None, layer_id: int) -> tuple[int, int]:
    where = f"layer {layer_id}: "
    name, n_kv = _named_attr(attn, KV_HEAD_NAMES)
    if n_kv is None and args is not None:
        name, n_kv = _named_attr(
            args, ("num_key_value_heads", "num_kv_heads", "num_attention_heads")
        )
    heads = None
    if n_kv is not None:
        heads = check_int(n_kv, where + name, minimum=1, error=UnsupportedModelError)
    k_weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    k_out = int(k_weight.shape[0]) if isinstance(k_weight, mx.array) else None
    head_dim = None
    raw_head_dim = getattr(attn, "head_dim", None)
    if raw_head_dim is not None:
        head_dim = check_int(
            raw_head_dim, where + "head_dim", minimum=1, error=UnsupportedModelError
        )
    elif heads is not None and k_out:
        head_dim = k_out // heads
    if not heads or not head_dim:
        raise UnsupportedModelError(
            f"cannot determine the KV geometry (n_kv_heads, head_dim) of layer {layer_id}"
        )
    if k_out is not None and k_out != heads * head_dim:
        raise UnsupportedModelError(
            f"layer {layer_id}: k_proj produces {k_out} features, expected "
            f"n_kv_heads * head_dim = {heads} * {head_dim}"
        )
    return heads, head_dim


def layout_from_model(model: object, *, dtype: mx.Dtype | None = None) -> CacheLayout:
    """Build the :class:`CacheLayout` of an mlx-lm model from its configuration.

    A layer's kind comes from, in order: a sliding flag on the layer or its attention module
    (``is_sliding``, ``is_local``, ``use_sliding``, ``use_sliding_window`` ...), the
    ``layer_types`` list, or ``sliding_window_pattern``: an int ``N`` makes every ``N``-th
    layer global (layer ``i`` is global iff ``(i + 1) % N == 0``, as in mlx-lm's Gemma 3 and
    Cohere2), a string of ``L`` / ``G`` letters such as ``"LLLG"`` names each layer local or
    global, repeating over the layers (as in mlx-lm's EXAONE 4). A layer with no q/k/v
    attention child is a ``STATE`` layer. Windows come from the attention module or the
    model's ``sliding_window``; geometry from each attention module. ``dtype`` overrides the
    KV dtype (default: the dtype of each layer's ``k_proj``).

    Raises ``UnsupportedModelError`` naming the field and its value for any configuration it
    cannot read exactly: a pattern of 0, a negative or float pattern, other letters, a window
    or head count that is not an int >= 1 (``8.0``, ``True``), a ``layer_types`` that is not
    a list of names, a sliding window that no layer map assigns to layers, or a sliding layer
    with no window.
    """
    container = language_model_container(model)
    layers = list(getattr(container, "layers"))  # noqa: B009
    args = model_args(model)
    layer_types = _layer_types(model, container, args)
    pattern = first_attr(args, ("sliding_window_pattern",)) if args is not None else None
    global_by_pattern = _global_layers(pattern, len(layers))
    window_name, model_window = "", None
    for owner in (args, container, model):
        if owner is not None and model_window is None:
            window_name, model_window = _named_attr(owner, ("sliding_window", "window_size"))
    if layer_types is not None and len(layer_types) != len(layers):
        raise UnsupportedModelError(
            f"layer_types lists {len(layer_types)} entries for {len(layers)} layers"
        )

    specs: list[LayerSpec] = []
    mapped_by_any = layer_types is not None or global_by_pattern is not None
    for layer_id, layer in enumerate(layers):
        attn = attention_module(layer)
        if attn is None:
            specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
            continue
        flag = _sliding_flag(layer, attn, layer_id)
        if flag is not None:
            mapped_by_any = True
            sliding = flag
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
        elif global_by_pattern is not None:
            sliding = not global_by_pattern[layer_id]
        else:
            sliding = False
        n_kv, head_dim = _geometry(attn, args, layer_id)
        window = None
        if sliding:
            name, raw_window = _named_attr(attn, WINDOW_NAMES)
            if raw_window is None:
                name, raw_window = window_name, model_window
            if raw_window is None:
                raise UnsupportedModelError(
                    f"layer {layer_id} is a sliding-window layer but the model declares no "
                    "window size (sliding_window / window_size)"
                )
            window = check_int(
                raw_window, f"layer {layer_id}: {name}", minimum=1, error=UnsupportedModelError
            )
        specs.append(
            LayerSpec(
                layer_id=layer_id,
                kind=LayerKind.SLIDING if sliding else LayerKind.FULL,
                window=window,
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
