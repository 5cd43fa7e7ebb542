"""The attention wrapper: batched paged decode for any duck-typed mlx-lm attention module."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    ATTENTION_CHILD_NAMES,
    KV_HEAD_NAMES,
    CacheLayout,
    CacheStateError,
    LayerKind,
    RopeConfig,
    ShapeMismatchError,
    UnsupportedModelError,
    attention_module,
    find_layers,
    first_attr,
    layout_from_model,
)

from ._context import BatchedDecodeContext
from ._layer_cache import BatchedLayerCache

__all__ = [
    "AttentionSpec",
    "BatchedAttention",
    "NormMode",
    "is_patched",
    "patch_model_attention",
    "unpatch_model_attention",
    "wrap_attention_layer",
]

HEAD_COUNT_NAMES = ("n_heads", "num_attention_heads", "num_heads", "n_head")
SCALE_NAMES = ("scale", "sm_scale")
PROBE_PREFIX = 5


class NormMode(enum.Enum):
    """Where an optional q/k norm applies: per head (``(D,)`` weight) or on the flat projection."""

    NONE = "none"
    PER_HEAD = "per_head"
    FLAT = "flat"


@dataclass(frozen=True)
class AttentionSpec:
    """What the wrapper learned about one attention module at patch time (probe-verified)."""

    layer_id: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    q_norm: NormMode
    k_norm: NormMode
    uses_rope: bool
    rope_config: RopeConfig | None
    has_sinks: bool
    sliding: bool


class _ProbeCache:
    """A private cache that records the K/V a module stores and serves a random prefix."""

    def __init__(self, prefix_keys: mx.array, prefix_values: mx.array) -> None:
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> int:
        return int(self.prefix_keys.shape[2])

    @property
    def state(self) -> tuple[()]:
        return ()

    def make_mask(
        self, N: int, *, return_array: bool = False, window_size: int | None = None
    ) -> None:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return (
            mx.concatenate([self.prefix_keys, keys], axis=2),
            mx.concatenate([self.prefix_values, values], axis=2),
        )


def _out_features(linear: Any) -> int | None:
    weight = getattr(linear, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, mx.array) else None


def _in_features(linear: Any) -> int | None:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, mx.array):
        return None
    bits = getattr(linear, "bits", None)
    if isinstance(bits, int) and not mx.issubdtype(weight.dtype, mx.floating):
        return int(weight.shape[1]) * 32 // bits
    return int(weight.shape[1])


def _norm_mode(norm: Any, head_dim: int, width: int, what: str, where: str) -> NormMode:
    if norm is None:
        return NormMode.NONE
    weight = getattr(norm, "weight", None)
    size = int(weight.shape[-1]) if isinstance(weight, mx.array) else None
    if size == head_dim:
        return NormMode.PER_HEAD
    if size == width:
        return NormMode.FLAT
    raise UnsupportedModelError(
        f"{where}: cannot tell how {what} applies: its weight has {size} features, expected "
        f"head_dim={head_dim} (per head) or {width} (the whole projection)"
    )


def _rope_config(rope: Any) -> RopeConfig | None:
    if type(rope) is not nn.RoPE:
        return None
    try:
        return RopeConfig(
            dims=int(rope.dims),
            traditional=bool(rope.traditional),
            base=float(rope.base),
            scale=float(rope.scale),
        )
    except (TypeError, ValueError):
        return None


def _max_rel_err(a: mx.array, b: mx.array) -> float:
    a32 = a.astype(mx.float32)
    b32 = b.astype(mx.float32)
    scale = float(mx.max(mx.abs(b32))) + 1e-6
    return float(mx.max(mx.abs(a32 - b32))) / scale


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 3e-2


def _project(
    inner: Any, spec_like: AttentionSpec, x: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """Q ``(B, H, D)``, k and v ``(B, Hkv, D)`` for one token per row, norms applied."""
    batch = x.shape[0]
    q = inner.q_proj(x)
    k = inner.k_proj(x)
    v = inner.v_proj(x)
    if spec_like.q_norm is NormMode.FLAT:
        q = inner.q_norm(q)
    if spec_like.k_norm is NormMode.FLAT:
        k = inner.k_norm(k)
    q = q.reshape(batch, spec_like.n_heads, spec_like.head_dim)
    k = k.reshape(batch, spec_like.n_kv_heads, spec_like.head_dim)
    v = v.reshape(batch, spec_like.n_kv_heads, spec_like.head_dim)
    if spec_like.q_norm is NormMode.PER_HEAD:
        q = inner.q_norm(q)
    if spec_like.k_norm is NormMode.PER_HEAD:
        k = inner.k_norm(k)
    return q, k, v


def _inspect(inner: Any, layer_id: int, sliding: bool) -> AttentionSpec:
    where = f"layer {layer_id} ({type(inner).__name__})"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"):
        if getattr(inner, name, None) is None:
            raise UnsupportedModelError(
                f"{where}: attention module has no `{name}`; batched decode needs q_proj, "
                "k_proj, v_proj, o_proj and rope"
            )
    scale = first_attr(inner, SCALE_NAMES)
    if scale is None:
        raise UnsupportedModelError(
            f"{where}: cannot determine the attention scale (no `scale` or `sm_scale`)"
        )
    q_out = _out_features(inner.q_proj)
    k_out = _out_features(inner.k_proj)
    n_heads = first_attr(inner, HEAD_COUNT_NAMES)
    n_kv = first_attr(inner, KV_HEAD_NAMES)
    head_dim = getattr(inner, "head_dim", None)
    if head_dim is None and n_heads and q_out:
        head_dim = q_out // int(n_heads)
    if head_dim is None and n_kv and k_out:
        head_dim = k_out // int(n_kv)
    if head_dim and n_heads is None and q_out:
        n_heads = q_out // int(head_dim)
    if head_dim and n_kv is None and k_out:
        n_kv = k_out // int(head_dim)
    if not (n_heads and n_kv and head_dim):
        raise UnsupportedModelError(
            f"{where}: cannot determine the attention head counts (n_heads={n_heads}, "
            f"n_kv_heads={n_kv}, head_dim={head_dim}); expected attributes such as n_heads / "
            "num_attention_heads, n_kv_heads / num_key_value_heads, head_dim"
        )
    n_heads, n_kv, head_dim = int(n_heads), int(n_kv), int(head_dim)
    if q_out is not None and q_out != n_heads * head_dim:
        raise UnsupportedModelError(
            f"{where}: q_proj produces {q_out} features, expected n_heads * head_dim = "
            f"{n_heads} * {head_dim} (gated or fused queries are not supported)"
        )
    if k_out is not None and k_out != n_kv * head_dim:
        raise UnsupportedModelError(
            f"{where}: k_proj produces {k_out} features, expected n_kv_heads * head_dim = "
            f"{n_kv} * {head_dim}"
        )
    if n_heads % n_kv:
        raise UnsupportedModelError(
            f"{where}: {n_heads} query heads are not a multiple of {n_kv} KV heads"
        )
    sinks = getattr(inner, "sinks", None)
    return AttentionSpec(
        layer_id=layer_id,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        scale=float(scale),
        q_norm=_norm_mode(getattr(inner, "q_norm", None), head_dim, q_out or -1, "q_norm", where),
        k_norm=_norm_mode(getattr(inner, "k_norm", None), head_dim, k_out or -1, "k_norm", where),
        uses_rope=True,
        rope_config=_rope_config(inner.rope),
        has_sinks=isinstance(sinks, mx.array),
        sliding=sliding,
    )


def _probe(inner: Any, spec: AttentionSpec) -> AttentionSpec:
    """Run the original module once and check the wrapper reproduces its keys and output.

    Decides whether the module rotates its keys (cohere2's full layers do not) and refuses
    the module if the wrapper's own q/k/v, norms, RoPE, scale, sinks and o_proj do not match.
    """
    where = f"layer {spec.layer_id} ({type(inner).__name__})"
    hidden = _in_features(inner.q_proj)
    if hidden is None:
        raise UnsupportedModelError(f"{where}: cannot read the input width of q_proj")
    dtype = (
        inner.q_proj.weight.dtype
        if mx.issubdtype(inner.q_proj.weight.dtype, mx.floating)
        else mx.float32
    )
    tol = _tolerance(dtype)
    key = mx.random.key(1234 + spec.layer_id)
    kx, kk, kv, ka = mx.random.split(key, 4)
    x = mx.random.normal((1, 1, hidden), key=kx).astype(dtype)
    shape = (1, spec.n_kv_heads, PROBE_PREFIX, spec.head_dim)
    prefix_k = mx.random.normal(shape, key=kk).astype(dtype)
    prefix_v = mx.random.normal(shape, key=kv).astype(dtype)

    capture = _ProbeCache(prefix_k, prefix_v)
    try:
        reference = inner(x, mask=None, cache=capture)
    except Exception as error:  # the module is refused whatever went wrong
        raise UnsupportedModelError(
            f"{where}: probing the attention module with a recording cache failed: {error!r}"
        ) from error
    if capture.keys is None or capture.values is None:
        raise UnsupportedModelError(
            f"{where}: the attention module never called cache.update_and_fetch"
        )
    q, k, v = _project(inner, spec, x)
    k4 = k[:, :, None, :]
    rotated = inner.rope(k4, offset=PROBE_PREFIX)
    if _max_rel_err(capture.keys, rotated) <= tol:
        uses_rope = True
    elif _max_rel_err(capture.keys, k4) <= tol:
        uses_rope = False
    else:
        raise UnsupportedModelError(
            f"{where}: the wrapper cannot reproduce the keys this module caches (projection, "
            "norm and RoPE differ from the duck-typed contract)"
        )
    if _max_rel_err(capture.values, v[:, :, None, :]) > tol:
        raise UnsupportedModelError(
            f"{where}: the wrapper cannot reproduce the values this module caches"
        )
    q4 = q[:, :, None, :]
    if uses_rope:
        q4 = inner.rope(q4, offset=PROBE_PREFIX)
        k4 = rotated
    keys = mx.concatenate([prefix_k, k4], axis=2)
    values = mx.concatenate([prefix_v, v[:, :, None, :]], axis=2)
    sinks = inner.sinks if spec.has_sinks else None
    out = mx.fast.scaled_dot_product_attention(
        q4, keys, values, scale=spec.scale, mask=None, sinks=sinks
    )
    mine = inner.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 1, -1))
    if _max_rel_err(mine, reference) > tol:
        raise UnsupportedModelError(
            f"{where}: the wrapper's attention output differs from the module's (queries, "
            "scale, sinks or o_proj do not follow the duck-typed contract)"
        )
    if uses_rope:
        rows = mx.random.normal((2, spec.n_kv_heads, 1, spec.head_dim), key=ka).astype(dtype)
        both = inner.rope(rows, offset=mx.array([3, 7], dtype=mx.int32))
        one = inner.rope(rows[:1], offset=3)
        two = inner.rope(rows[1:], offset=7)
        if _max_rel_err(both, mx.concatenate([one, two], axis=0)) > tol:
            raise UnsupportedModelError(
                f"{where}: the module's rope does not accept per-row offsets"
            )
    return AttentionSpec(
        layer_id=spec.layer_id,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        scale=spec.scale,
        q_norm=spec.q_norm,
        k_norm=spec.k_norm,
        uses_rope=uses_rope,
        rope_config=spec.rope_config if uses_rope else None,
        has_sinks=spec.has_sinks,
        sliding=spec.sliding,
    )


class BatchedAttention(nn.Module):
    """Wraps one attention module; batched paged decode when handed a BatchedLayerCache.

    With any other cache (or none) the original module runs unchanged. Attribute reads the
    wrapper does not define fall through to the original module, so code that inspects the
    attention (layouts, head counts, sliding flags) sees it unchanged.
    """

    def __init__(self, inner: nn.Module, spec: AttentionSpec, child_name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner = inner
        self.spec = spec
        self.child_name = child_name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = dict.get(self, "inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        """Batched decode for a :class:`BatchedLayerCache`, else the original module.

        The cache is found wherever the container passes it (``cache=`` or any positional
        argument), so an attention that takes extra arguments is still recognised.
        """
        for candidate in (kwargs.get("cache"), *args):
            if isinstance(candidate, BatchedLayerCache):
                return self.batched_decode(x, candidate.context)
        result: mx.array = self.inner(x, *args, **kwargs)
        return result

    def batched_decode(self, x: mx.array, ctx: BatchedDecodeContext) -> mx.array:
        """One decode token per request: project, RoPE, write K/V to the pool, paged attention.

        ``x`` is ``(B, 1, hidden)`` with row ``b`` the token of ``ctx.request_ids[b]``.
        """
        spec = self.spec
        layer_id = spec.layer_id
        batch = x.shape[0]
        if x.ndim != 3 or x.shape[1] != 1 or batch != ctx.batch_size:
            raise ShapeMismatchError(
                f"batched decode of layer {layer_id} expects x of shape ({ctx.batch_size}, 1, "
                f"hidden), got {tuple(x.shape)}"
            )
        pool = ctx.pool
        if pool is None:
            raise CacheStateError(
                "the BatchedDecodeContext has no pool; build it with BatchedDecodeContext.from_pool"
            )
        inner: Any = self.inner
        sub_pool = ctx.sub_pool(layer_id)
        pool_layer = ctx.pool_layer(layer_id)
        slots = ctx.new_token_slots[sub_pool]
        q, k, v = _project(inner, spec, x)

        rope_kernel = ctx.aot.rope
        config = spec.rope_config
        if (
            rope_kernel is not None
            and config is not None
            and layer_id in ctx.full_kv_pool_index_by_layer
            and rope_kernel.supports(config)
        ):
            q, _, k_pool, v_pool = rope_kernel(
                q,
                k,
                v,
                ctx.offsets,
                slots,
                pool.get_key_buffer(pool_layer),
                pool.get_value_buffer(pool_layer),
                rope=config,
            )
            pool.replace_buffers(pool_layer, k_pool, v_pool)
            q4 = q[:, :, None, :]
        else:
            q4 = q[:, :, None, :]
            if spec.uses_rope:
                q4 = inner.rope(q4, offset=ctx.offsets)
                k = inner.rope(k[:, :, None, :], offset=ctx.offsets)[:, :, 0, :]
            pool.set_kv(pool_layer, slots, k, v)

        assert ctx.addressing is not None  # sub_pool() checked it
        out = ctx.aot.attention(
            q4,
            pool.get_key_buffer(pool_layer),
            pool.get_value_buffer(pool_layer),
            ctx.page_tables[sub_pool],
            ctx.valid_lens,
            page_size=ctx.addressing.page_size_by_layer[layer_id],
            scale=spec.scale,
            window=ctx.window(layer_id),
            sinks=inner.sinks if spec.has_sinks else None,
        )
        result: mx.array = inner.o_proj(out.reshape(batch, 1, spec.n_heads * spec.head_dim))
        return result


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
    spec = _probe(child, _inspect(child, layer_id, kind is LayerKind.SLIDING))
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


def unpatch_model_attention(model: nn.Module) -> int:
    """Put the original attention modules back; returns how many were restored."""
    restored = 0
    for layer in find_layers(model):
        for name in ATTENTION_CHILD_NAMES:
            child = getattr(layer, name, None)
            if isinstance(child, BatchedAttention):
                setattr(layer, name, child.inner)
                restored += 1
    return restored
