"""Read a :class:`CacheLayout` off an mlx-lm model instance without running it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ._errors import KVCacheError, UnsupportedModelError
from ._layer_spec import LayerKind, LayerSpec
from ._layout import CacheLayout
from ._validate import as_int, check_int

__all__ = [
    "ATTENTION_CHILD_NAMES",
    "HEAD_COUNT_NAMES",
    "KV_HEAD_NAMES",
    "AttentionHeads",
    "attention_heads",
    "attention_module",
    "find_layers",
    "first_attr",
    "flatten_caches",
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
#: Attribute names of an attention module's query head count, in lookup order.
HEAD_COUNT_NAMES = ("n_heads", "num_attention_heads", "num_heads", "n_head")
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


@dataclass(frozen=True, kw_only=True)
class AttentionHeads:
    """An attention module's head counts and K head width, as :func:`attention_heads` reads them.

    ``n_heads`` (query heads) is ``None`` where the module does not say and ``q_proj`` cannot
    tell; ``q_features`` and ``k_features`` are the projections' output widths, if known.
    """

    n_heads: int | None
    n_kv_heads: int
    head_dim: int
    q_features: int | None
    k_features: int | None


def _out_features(linear: object) -> int | None:
    weight = getattr(linear, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, mx.array) else None


def attention_heads(
    attn: Any, where: str, args: object | None = None, *, require_query_heads: bool = False
) -> AttentionHeads:
    """The one rule for an attention module's head counts, used by the layout and the wrapper.

    KV heads: the module's ``n_kv_heads`` / ``num_key_value_heads`` / ``num_kv_heads`` /
    ``n_kv``, else (with ``args``, the model's ``ModelArgs``) the model's
    ``num_key_value_heads`` / ``num_kv_heads`` / ``num_attention_heads``, else ``k_proj``'s
    width over ``head_dim``. Query heads: ``n_heads`` / ``num_attention_heads`` /
    ``num_heads`` / ``n_head``, else ``q_proj``'s width over ``head_dim``. ``head_dim``: the
    module's own, else ``k_proj``'s width over the KV heads, else ``q_proj``'s over the query
    heads. ``k_proj`` must produce exactly ``n_kv_heads * head_dim`` features. Raises
    ``UnsupportedModelError`` (naming ``where``) when the counts cannot be read or are not
    ints >= 1, or (with ``require_query_heads``) when the query heads cannot.
    """
    q_out = _out_features(getattr(attn, "q_proj", None))
    k_out = _out_features(getattr(attn, "k_proj", None))
    kv_name, raw_kv = _named_attr(attn, KV_HEAD_NAMES)
    if raw_kv is None and args is not None:
        kv_name, raw_kv = _named_attr(
            args, ("num_key_value_heads", "num_kv_heads", "num_attention_heads")
        )
    q_name, raw_heads = _named_attr(attn, HEAD_COUNT_NAMES)
    n_kv = (
        check_int(raw_kv, f"{where}: {kv_name}", minimum=1, error=UnsupportedModelError)
        if raw_kv is not None
        else None
    )
    n_heads = (
        check_int(raw_heads, f"{where}: {q_name}", minimum=1, error=UnsupportedModelError)
        if raw_heads is not None
        else None
    )
    head_dim: int | None = None
    raw_head_dim = getattr(attn, "head_dim", None)
    if raw_head_dim is not None:
        head_dim = check_int(
            raw_head_dim, f"{where}: head_dim", minimum=1, error=UnsupportedModelError
        )
    elif n_kv is not None and k_out:
        head_dim = k_out // n_kv
    elif n_heads is not None and q_out:
        head_dim = q_out // n_heads
    if head_dim:
        if n_kv is None and k_out:
            n_kv = k_out // head_dim
        if n_heads is None and q_out:
            n_heads = q_out // head_dim
    if not n_kv or not head_dim or (require_query_heads and not n_heads):
        raise UnsupportedModelError(
            f"{where}: cannot determine the attention head counts (n_heads={n_heads}, "
            f"n_kv_heads={n_kv}, head_dim={head_dim}); expected attributes such as n_heads / "
            "num_attention_heads, n_kv_heads / num_key_value_heads, head_dim"
        )
    if k_out is not None and k_out != n_kv * head_dim:
        raise UnsupportedModelError(
            f"{where}: k_proj produces {k_out} features, expected n_kv_heads * head_dim = "
            f"{n_kv} * {head_dim}"
        )
    return AttentionHeads(
        n_heads=n_heads or None,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        q_features=q_out,
        k_features=k_out,
    )


#: mlx-lm cache classes (matched by exact class name: kv-protocol does not import mlx-lm)
#: that hold a recurrent / linear-attention state, not K/V.
STATE_CACHE_NAMES = frozenset({"ArraysCache", "MambaCache"})
#: What the layout can serve, for the refusal messages.
SERVED_CACHES = "KVCache, RotatingKVCache(max_size=W, keep=0), ArraysCache or MambaCache"


def flatten_caches(caches: Sequence[object]) -> list[object]:
    """A ``make_cache()`` list with each ``CacheList`` replaced by the caches it holds, in order.

    mlx-lm gives a decoder layer that keeps several caches (a convolution state beside its
    K/V, two attention sublayers) one ``CacheList``; the layout gives each of them its own
    layer id, their position in this flat list.
    """
    flat: list[object] = []
    for cache in caches:
        if type(cache).__name__ == "CacheList":
            flat.extend(flatten_caches(list(getattr(cache, "caches", ()))))
        else:
            flat.append(cache)
    return flat


def _cache_kind(cache: object, layer_id: int) -> tuple[LayerKind, int | None]:
    """``(kind, window)`` of one entry of a model's ``make_cache()`` list.

    The class is recognised by its exact name (a subclass such as ``ChunkedKVCache`` or a
    quantized cache has other semantics and is refused, not read as its parent).
    """
    name = type(cache).__name__
    if name == "KVCache":
        return LayerKind.FULL, None
    if name == "RotatingKVCache":
        keep = getattr(cache, "keep", 0)
        if keep is None:
            keep = 0
        keep_int = as_int(keep)
        if keep_int != 0:
            raise UnsupportedModelError(
                f"layer {layer_id}: make_cache() gives RotatingKVCache(keep={keep!r}), which "
                "keeps a prefix of tokens beside its sliding window; only plain windows "
                f"(keep=0) are served (served caches: {SERVED_CACHES})"
            )
        window = check_int(
            getattr(cache, "max_size", None),
            f"layer {layer_id}: RotatingKVCache.max_size",
            minimum=1,
            error=UnsupportedModelError,
        )
        return LayerKind.SLIDING, window
    if name in STATE_CACHE_NAMES:
        return LayerKind.STATE, None
    raise UnsupportedModelError(
        f"layer {layer_id}: make_cache() gives a {name}, a cache type this toolkit does not "
        f"serve (served caches: {SERVED_CACHES})"
    )


def _model_caches(model: object) -> list[object] | None:
    """The list ``model.make_cache()`` returns, ``None`` if the model has no ``make_cache``.

    Raises ``UnsupportedModelError`` when ``make_cache`` is not callable or does not return
    a list or tuple; lets any exception raised *inside* ``make_cache`` propagate (the caller
    decides what a broken ``make_cache`` means).
    """
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return None
    if not callable(make_cache):
        raise _refuse("make_cache", make_cache, "a method returning one cache per layer")
    caches = make_cache()
    if not isinstance(caches, list | tuple):
        raise UnsupportedModelError(
            f"{type(model).__name__}.make_cache() returned {type(caches).__name__}, expected "
            "a list with one cache per decoder layer"
        )
    return list(caches)


class _Config:
    """The model-level configuration the attribute reading needs, read once."""

    def __init__(self, model: object) -> None:
        self.container = language_model_container(model)
        self.layers = list(getattr(self.container, "layers"))  # noqa: B009
        self.args = model_args(model)
        self.layer_types = _layer_types(model, self.container, self.args)
        args = self.args
        pattern = first_attr(args, ("sliding_window_pattern",)) if args is not None else None
        self.global_by_pattern = _global_layers(pattern, len(self.layers))
        self.window_name: str = ""
        self.model_window: Any = None
        for owner in (args, self.container, model):
            if owner is not None and self.model_window is None:
                self.window_name, self.model_window = _named_attr(
                    owner, ("sliding_window", "window_size")
                )
        if self.layer_types is not None and len(self.layer_types) != len(self.layers):
            raise UnsupportedModelError(
                f"layer_types lists {len(self.layer_types)} entries for {len(self.layers)} layers"
            )


def _attribute_kind(config: _Config, layer_id: int) -> tuple[LayerKind, bool]:
    """The kind the attributes give layer ``layer_id``, and whether they *say* so.

    The second item is False when nothing declares the kind: FULL by default, STATE for a
    layer with no q/k/v attention child (which may also be an attention this reader does not
    recognise, such as fused QKV or latent attention, so it is not a declaration).
    """
    layer = config.layers[layer_id]
    attn = attention_module(layer)
    if attn is None:
        return LayerKind.STATE, False
    flag = _sliding_flag(layer, attn, layer_id)
    if flag is not None:
        return (LayerKind.SLIDING if flag else LayerKind.FULL), True
    if config.layer_types is not None:
        kind_name = config.layer_types[layer_id]
        if kind_name in STATE_LAYER_TYPES:
            return LayerKind.STATE, True
        if kind_name not in SLIDING_LAYER_TYPES | FULL_LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer {layer_id} has attention projections but layer type {kind_name!r}, "
                "which is neither full, sliding nor a known recurrent type; refusing to "
                "guess its KV lifetime"
            )
        sliding = kind_name in SLIDING_LAYER_TYPES
        return (LayerKind.SLIDING if sliding else LayerKind.FULL), True
    if config.global_by_pattern is not None:
        sliding = not config.global_by_pattern[layer_id]
        return (LayerKind.SLIDING if sliding else LayerKind.FULL), True
    return LayerKind.FULL, False


def _declared_window(config: _Config, attn: object, layer_id: int) -> int | None:
    """The window the attributes declare for sliding layer ``layer_id``, None if none."""
    name, raw_window = _named_attr(attn, WINDOW_NAMES)
    if raw_window is None:
        name, raw_window = config.window_name, config.model_window
    if raw_window is None:
        return None
    return check_int(
        raw_window, f"layer {layer_id}: {name}", minimum=1, error=UnsupportedModelError
    )


def _attribute_window(config: _Config, attn: object, layer_id: int) -> int:
    """The window the attributes give sliding layer ``layer_id``."""
    window = _declared_window(config, attn, layer_id)
    if window is None:
        raise UnsupportedModelError(
            f"layer {layer_id} is a sliding-window layer but the model declares no "
            "window size (sliding_window / window_size)"
        )
    return window


#: Further names under which hybrid models (PLaMo, RecurrentGemma) hold a layer's mixer.
MIXER_CHILD_NAMES = ("mixer", "temporal_block")


def _kv_module(layer: object) -> tuple[Any | None, str]:
    """The module whose K/V a cache of this layer holds, and a description if none is found.

    First the q/k/v attention child (:func:`attention_module`, also looked up under the mixer
    names); else a child that declares its KV heads and ``head_dim`` (fused QKV projections).
    """
    attn = attention_module(layer)
    if attn is not None:
        return attn, ""
    found: list[str] = []
    for name in ATTENTION_CHILD_NAMES + MIXER_CHILD_NAMES:
        child = getattr(layer, name, None)
        if child is None:
            continue
        if all(hasattr(child, p) for p in ("q_proj", "k_proj", "v_proj")):
            return child, ""
        _, heads = _named_attr(child, KV_HEAD_NAMES)
        if heads is not None and getattr(child, "head_dim", None) is not None:
            return child, ""
        found.append(f"{name} ({type(child).__name__})")
    where = (
        ", ".join(found)
        if found
        else "no child named " + " / ".join(ATTENTION_CHILD_NAMES + MIXER_CHILD_NAMES)
    )
    return None, where


def _value_head_dim(attn: Any, n_kv: int, layer_id: int) -> int | None:
    """The width of one V head as ``v_proj`` gives it (None where it has no weight)."""
    v_weight = getattr(getattr(attn, "v_proj", None), "weight", None)
    if not isinstance(v_weight, mx.array):
        return None
    v_out = int(v_weight.shape[0])
    if v_out % n_kv:
        raise UnsupportedModelError(
            f"layer {layer_id}: v_proj produces {v_out} features, not a multiple of its "
            f"{n_kv} KV heads"
        )
    return v_out // n_kv


class _ObservedGeometry:
    """K/V geometry observed from what one forward step writes into ``make_cache()``'s caches.

    The fallback for attention the attributes cannot describe (latent attention that caches a
    compressed KV and a RoPE key, mixers with their own attribute names): the model runs one
    token on a fresh cache list and each attention cache's ``keys`` / ``values`` arrays give
    ``(batch, kv_heads, tokens, dim)`` and the dtype. Run at most once, on first use.
    """

    def __init__(self, model: object) -> None:
        self._model = model
        self._caches: list[object] | None = None
        self._error = ""

    def _run(self) -> list[object] | None:
        if self._caches is None and not self._error:
            try:
                caches = _model_caches(self._model)
                if caches is None:
                    raise UnsupportedModelError("the model has no make_cache()")
                forward: Any = self._model
                mx.eval(forward(mx.array([[0]], dtype=mx.int32), cache=caches))
                self._caches = flatten_caches(caches)
            except Exception as exc:  # any failure: the caller refuses with the reason
                self._error = f"{type(exc).__name__}: {exc}"
        return self._caches

    def geometry(self, cache_index: int) -> tuple[int, int, int, mx.Dtype] | str:
        """``(kv_heads, k_dim, v_dim, dtype)`` of flat cache ``cache_index``, or why not."""
        caches = self._run()
        if caches is None:
            return f"a one-token probe forward failed ({self._error})"
        if cache_index >= len(caches):
            return f"the probe's cache list has no entry {cache_index}"
        keys = getattr(caches[cache_index], "keys", None)
        values = getattr(caches[cache_index], "values", None)
        if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
            return "a one-token probe forward wrote no keys / values into its cache"
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[1] != values.shape[1]:
            return (
                f"the probe's cached keys {tuple(keys.shape)} and values "
                f"{tuple(values.shape)} are not (batch, kv_heads, tokens, dim) with one head count"
            )
        if keys.dtype != values.dtype:
            return f"the probe's cached keys are {keys.dtype} and values {values.dtype}"
        return int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), keys.dtype


def _observed_spec(
    layer_id: int,
    kind: LayerKind,
    window: int | None,
    dtype: mx.Dtype | None,
    seen: tuple[int, int, int, mx.Dtype],
) -> LayerSpec:
    """The spec of an attention layer whose geometry a probe forward observed."""
    n_kv, head_dim, v_dim, seen_dtype = seen
    return LayerSpec(
        layer_id=layer_id,
        kind=kind,
        window=window,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        v_head_dim=v_dim,
        dtype=dtype if dtype is not None else seen_dtype,
    )


def _attention_spec(
    config: _Config,
    layer_id: int,
    kind: LayerKind,
    window: int | None,
    dtype: mx.Dtype | None,
    *,
    source: str,
    observed: _ObservedGeometry | None = None,
) -> LayerSpec:
    """The spec of an attention layer of ``kind``: geometry and dtype from its module.

    Where the module's geometry cannot be read and ``observed`` is given (the layout comes
    from ``make_cache()``), the geometry the model writes into its own cache decides.
    """
    attn, found = _kv_module(config.layers[layer_id])
    if attn is None:
        seen = observed.geometry(layer_id) if observed is not None else ""
        if isinstance(seen, tuple):
            return _observed_spec(layer_id, kind, window, dtype, seen)
        probe = f"; {seen}" if seen else ""
        raise UnsupportedModelError(
            f"layer {layer_id}: {source} makes it a {kind.name} attention layer, but it has no "
            "attention module with q_proj / k_proj / v_proj or declared KV heads and head_dim "
            f"(found: {found}), so its KV geometry cannot be read{probe}"
        )
    heads = attention_heads(attn, f"layer {layer_id}", config.args)
    n_kv, head_dim = heads.n_kv_heads, heads.head_dim
    return LayerSpec(
        layer_id=layer_id,
        kind=kind,
        window=window,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        v_head_dim=_value_head_dim(attn, n_kv, layer_id),
        dtype=dtype if dtype is not None else _kv_dtype(attn),
    )


def _describe_kind(kind: LayerKind, window: int | None) -> str:
    return f"SLIDING(window={window})" if kind is LayerKind.SLIDING else kind.name


def _layout_from_attributes(model: object, dtype: mx.Dtype | None) -> CacheLayout:
    """The layout read from configuration attributes alone (models without ``make_cache``)."""
    config = _Config(model)
    specs: list[LayerSpec] = []
    mapped_by_any = config.layer_types is not None or config.global_by_pattern is not None
    for layer_id in range(len(config.layers)):
        kind, declared = _attribute_kind(config, layer_id)
        if kind is LayerKind.STATE:
            specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
            continue
        if declared:
            mapped_by_any = True
        window = None
        if kind is LayerKind.SLIDING:
            attn = attention_module(config.layers[layer_id])
            window = _attribute_window(config, attn, layer_id)
        specs.append(
            _attention_spec(config, layer_id, kind, window, dtype, source="its configuration")
        )
    if config.model_window is not None and not mapped_by_any:
        raise UnsupportedModelError(
            f"{type(model).__name__} declares sliding_window={config.model_window} but maps "
            "it to no layer (no layer_types, sliding_window_pattern or per-layer sliding "
            "flag); refusing to guess which layers are windowed"
        )
    return CacheLayout(specs)


def _layout_from_caches(model: object, caches: list[object], dtype: mx.Dtype | None) -> CacheLayout:
    """The layout ``make_cache()`` says, cross-checked with what the attributes declare."""
    config = _Config(model)
    flat = flatten_caches(caches)
    observed = _ObservedGeometry(model)
    if not (len(flat) == len(caches) == len(config.layers)):
        return _layout_from_cache_slots(model, flat, dtype, observed)
    specs: list[LayerSpec] = []
    for layer_id, cache in enumerate(caches):
        kind, window = _cache_kind(cache, layer_id)
        said = _describe_kind(kind, window)
        attr_kind, declared = _attribute_kind(config, layer_id)
        attr_window = None
        if attr_kind is LayerKind.SLIDING:
            attn = attention_module(config.layers[layer_id])
            attr_window = _declared_window(config, attn, layer_id)
            if attr_window is None:  # a sliding layer that names no window: kinds only
                attr_window = window
        if declared and (attr_kind, attr_window) != (kind, window):
            raise UnsupportedModelError(
                f"layer {layer_id}: make_cache() gives {type(cache).__name__}, i.e. {said}, "
                f"but the model's attributes say {_describe_kind(attr_kind, attr_window)}; "
                "refusing to guess which one the model computes"
            )
        if kind is LayerKind.STATE:
            specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
            continue
        source = f"make_cache()'s {type(cache).__name__}"
        specs.append(
            _attention_spec(config, layer_id, kind, window, dtype, source=source, observed=observed)
        )
    return CacheLayout(specs)


def _layout_from_cache_slots(
    model: object, flat: list[object], dtype: mx.Dtype | None, observed: _ObservedGeometry
) -> CacheLayout:
    """The layout of a model whose caches are not one per decoder layer.

    A ``CacheList``, a layer without a cache (an MLP-only block) or a model that runs its
    layers twice on separate caches: layer id ``i`` is then flat cache ``i``, which no
    decoder layer's attributes describe, so the kinds come from the caches alone and the
    geometry from a one-token probe forward.
    """
    specs: list[LayerSpec] = []
    for layer_id, cache in enumerate(flat):
        kind, window = _cache_kind(cache, layer_id)
        if kind is LayerKind.STATE:
            specs.append(LayerSpec(layer_id=layer_id, kind=LayerKind.STATE))
            continue
        seen = observed.geometry(layer_id)
        if isinstance(seen, str):
            raise UnsupportedModelError(
                f"cache {layer_id} of {type(model).__name__}.make_cache() (flattened: "
                f"{len(flat)} caches) is a {type(cache).__name__}, but its KV geometry cannot "
                f"be observed: {seen}"
            )
        specs.append(_observed_spec(layer_id, kind, window, dtype, seen))
    return CacheLayout(specs)


def _unforeseen(model: object, exc: Exception) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"cannot read the layer layout of {type(model).__name__}: its configuration has a "
        f"form this reader does not know ({type(exc).__name__}: {exc})"
    )


def layout_from_model(model: object, *, dtype: mx.Dtype | None = None) -> CacheLayout:
    """Build the :class:`CacheLayout` of an mlx-lm model without running it.

    **Where the model defines** ``make_cache()``, its cache list is the authority, one cache
    per decoder layer: ``KVCache`` is a FULL layer, ``RotatingKVCache(max_size=W)`` (with
    ``keep=0``) a SLIDING layer of window ``W``, ``ArraysCache`` / ``MambaCache`` a STATE
    layer. Any other cache (``ChunkedKVCache``, a ``RotatingKVCache`` with ``keep > 0``,
    ``QuantizedKVCache`` ...) is refused with an ``UnsupportedModelError`` naming the layer
    and the cache type. Where the list holds one plain cache per decoder layer, each layer is
    cross-checked with what the attributes below *declare* (a flag, a ``layer_types`` entry,
    a pattern, a window); a disagreement is an ``UnsupportedModelError`` naming both
    answers. Otherwise (a ``CacheList``, layers without a cache, layers run twice) the layer
    ids are the positions in :func:`flatten_caches` of the list and the geometry is observed
    from a one-token forward on the model's own caches; so is the geometry of a layer whose
    attention module the attributes cannot describe (latent attention). Should
    ``make_cache()`` itself raise, the attributes alone decide (as for a model without one).

    **From the attributes**, a layer's kind comes from, in order: a sliding flag on the
    layer or its attention module (``is_sliding``, ``is_local``, ``use_sliding``,
    ``use_sliding_window`` ...), the ``layer_types`` list, or ``sliding_window_pattern``: an
    int ``N`` makes every ``N``-th layer global (layer ``i`` is global iff
    ``(i + 1) % N == 0``, as in mlx-lm's Gemma 3 and Cohere2), a string of ``L`` / ``G``
    letters such as ``"LLLG"`` names each layer local or global, repeating over the layers (as
    in mlx-lm's EXAONE 4). A layer with no q/k/v attention child is a ``STATE`` layer.
    Windows come from the attention module or the model's ``sliding_window``.

    Geometry (KV heads, head dim) always comes from each attention module, the dtype from its
    ``k_proj`` unless ``dtype`` overrides it.

    Raises ``UnsupportedModelError`` naming the field and its value for any configuration it
    cannot read exactly: a pattern of 0, a negative or float pattern, other letters, a window
    or head count that is not an int >= 1 (``8.0``, ``True``), a ``layer_types`` that is not
    a list of names, a sliding window that no layer map assigns to layers, or a sliding layer
    with no window. A configuration of a form it does not know at all is an
    ``UnsupportedModelError`` too, never an ``AttributeError`` or ``TypeError``.
    """
    try:
        try:
            caches = _model_caches(model)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # a broken make_cache: the attributes alone decide
            try:
                return _layout_from_attributes(model, dtype)
            except UnsupportedModelError as attr_exc:
                raise UnsupportedModelError(
                    f"{attr_exc} (and {type(model).__name__}.make_cache() failed: "
                    f"{type(exc).__name__}: {exc})"
                ) from exc
        if caches is None:
            return _layout_from_attributes(model, dtype)
        return _layout_from_caches(model, caches, dtype)
    except KVCacheError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
        raise _unforeseen(model, exc) from exc
