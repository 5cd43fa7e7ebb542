"""Installing and removing the attention wrappers in a model's decoder layers."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import mlx.nn as nn

from kv_protocol import (
    ATTENTION_CHILD_NAMES,
    CacheLayout,
    LayerKind,
    PrefillAttention,
    UnsupportedModelError,
    attention_module,
    find_layers,
    layout_from_model,
)

from ._attention_probe import probe_attention
from ._attention_spec import inspect_attention
from ._batched_attention import BatchedAttention
from ._model_surgery import ChangeReport

__all__ = [
    "AttentionWrappers",
    "is_patched",
    "patch_model_attention",
    "unpatch_model_attention",
    "unwrap_layer_children",
    "wrap_attention_layer",
]


def _attention_child(layer: Any) -> tuple[str, Any] | None:
    """``(attribute name, module)`` of the layer's attention, found by kv_protocol's rule.

    A :class:`BatchedAttention` passes that rule too: its q/k/v projections fall through to
    the module it wraps.
    """
    child = attention_module(layer)
    if child is None:
        return None
    for name in ATTENTION_CHILD_NAMES:
        if getattr(layer, name, None) is child:
            return name, child
    return None


def is_patched(model: nn.Module) -> bool:
    """True when every attention module of ``model`` is wrapped."""
    found = [_attention_child(layer) for layer in find_layers(model)]
    children = [c for c in found if c is not None]
    return bool(children) and all(isinstance(c[1], BatchedAttention) for c in children)


def wrap_attention_layer(layer: Any, layer_id: int, layout: CacheLayout) -> BatchedAttention:
    """The probe-verified wrapper of ``layer``'s attention, or ``UnsupportedModelError``.

    Nothing is changed on the layer: :func:`patch_model_attention` installs the wrapper.
    """
    found = _attention_child(layer)
    kind = layout.kind(layer_id)
    if found is None:
        raise UnsupportedModelError(
            f"layer {layer_id} is a {kind.value} attention layer in the layout but has "
            f"no attention child named one of {ATTENTION_CHILD_NAMES}"
        )
    name, child = found
    if isinstance(child, BatchedAttention):
        return child
    geometry = layout.geometry(layer_id)
    if geometry.v_head_dim is not None:
        raise UnsupportedModelError(
            f"layer {layer_id}: its V heads are {geometry.v_head_dim} wide and its K heads "
            f"{geometry.head_dim}; the fused path needs V as wide as K"
        )
    spec = probe_attention(child, inspect_attention(child, layer_id, kind is LayerKind.SLIDING))
    if (geometry.n_kv_heads, geometry.head_dim) != (spec.n_kv_heads, spec.head_dim):
        raise UnsupportedModelError(
            f"layer {layer_id}: the module has {spec.n_kv_heads} KV heads x {spec.head_dim} "
            f"but the layout says {geometry.n_kv_heads} x {geometry.head_dim}"
        )
    return BatchedAttention(child, spec, name)


def patch_model_attention(
    model: nn.Module, layout: CacheLayout | None = None, *, layers: Collection[int] | None = None
) -> int:
    """Wrap the attention modules of an mlx-lm model; returns how many are wrapped.

    ``layers`` limits the wrapping to those attention layer ids (default: every one).
    Idempotent: already wrapped modules are kept. Each module is probed once (see
    :class:`BatchedAttention`); a module the wrapper cannot serve exactly raises
    ``UnsupportedModelError`` and leaves the model as it was. ``layout`` defaults to
    :func:`kv_protocol.layout_from_model`.
    """
    if layers is not None and not layers:
        return 0
    model_layers = find_layers(model)
    if layout is None:
        layout = layout_from_model(model)
    if layout.num_layers != len(model_layers):
        raise UnsupportedModelError(
            f"the layout describes {layout.num_layers} layers but the model has {len(model_layers)}"
        )
    chosen = None if layers is None else frozenset(layers)
    planned: list[tuple[Any, str, BatchedAttention]] = []
    wrapped = 0
    for layer_id, layer in enumerate(model_layers):
        kind = layout.kind(layer_id)
        if kind is LayerKind.STATE:
            continue  # a recurrent mixer (some have q/k/v projections too) is never wrapped
        if chosen is not None and layer_id not in chosen:
            continue
        wrapper = wrap_attention_layer(layer, layer_id, layout)
        if getattr(layer, wrapper.child_name, None) is wrapper:
            wrapped += 1
            continue
        planned.append((layer, wrapper.child_name, wrapper))
    for layer, name, wrapper in planned:
        setattr(layer, name, wrapper)
    return wrapped + len(planned)


def wrapped_attention(model: nn.Module) -> list[BatchedAttention]:
    """The :class:`BatchedAttention` wrappers installed in ``model``, in layer order."""
    found = []
    for layer in find_layers(model):
        for name in ATTENTION_CHILD_NAMES:
            child = getattr(layer, name, None)
            if isinstance(child, BatchedAttention):
                found.append(child)
    return found


def unwrap_layer_children(
    model: nn.Module, names: Collection[str], wrapper: type[nn.Module]
) -> int:
    """Put back the ``inner`` module of every ``wrapper`` child (under ``names``) of each layer.

    Returns how many were restored.
    """
    restored = 0
    for layer in find_layers(model):
        for name in names:
            child = getattr(layer, name, None)
            if isinstance(child, wrapper):
                setattr(layer, name, child.inner)
                restored += 1
    return restored


def unpatch_model_attention(model: nn.Module) -> int:
    """Put the original attention modules back; returns how many were restored."""
    return unwrap_layer_children(model, ATTENTION_CHILD_NAMES, BatchedAttention)


class AttentionWrappers:
    """The change that wraps a model's attention modules for the paged fast path.

    A :class:`~kv_batching._model_surgery.ModelChange` the engine cannot run without:
    :meth:`install` is :func:`patch_model_attention` (``UnsupportedModelError`` for a module
    the wrapper's probe refuses, nothing changed). Engaged for a prompt chunk, the wrappers
    attend through ``prefill_attention`` (a kernel set's, when it carries one).
    """

    name = "attention"

    def __init__(
        self,
        layout: CacheLayout | None = None,
        *,
        layers: Collection[int] | None = None,
        prefill_attention: PrefillAttention | None = None,
    ) -> None:
        self.layout = layout
        self.layers = layers
        self.prefill_attention = prefill_attention
        self._wrappers: list[BatchedAttention] = []

    def install(self, model: nn.Module) -> ChangeReport:
        """Wrap the chosen attention layers (every one by default)."""
        installed = patch_model_attention(model, self.layout, layers=self.layers)
        self._wrappers = wrapped_attention(model)
        reason = None if installed else "no attention layer was chosen for the fast path"
        return ChangeReport(name=self.name, installed=installed, reason=reason)

    def uninstall(self, model: nn.Module) -> int:
        """Put the original attention modules back; returns how many were restored."""
        self._wrappers = []
        return unpatch_model_attention(model)

    def engage(self, *, prefill: bool) -> None:
        """A prompt chunk's forward attends through the prefill kernel, if there is one."""
        if prefill and self.prefill_attention is not None:
            for wrapper in self._wrappers:
                wrapper.prefill_attention = self.prefill_attention

    def disengage(self) -> None:
        """The wrappers attend their own way again."""
        for wrapper in self._wrappers:
            wrapper.prefill_attention = None
