"""What the fused decode path reads off one attention module: heads, scale, norms, RoPE."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from kv_protocol import (
    RopeConfig,
    UnsupportedModelError,
    attention_heads,
    first_attr,
    rope_config_from_module,
)

__all__ = ["AttentionSpec", "NormMode", "inspect_attention", "project_qkv", "project_qkv_tokens"]


SCALE_NAMES = ("scale", "sm_scale")


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


def project_qkv(
    inner: Any, spec_like: AttentionSpec, x: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The module's Q ``(B, H, D)``, K and V ``(B, Hkv, D)`` for one token per row, normed."""
    q, k, v = project_qkv_tokens(inner, spec_like, x)
    return q[:, :, 0, :], k[:, :, 0, :], v[:, :, 0, :]


def project_qkv_tokens(
    inner: Any, spec_like: AttentionSpec, x: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The module's Q ``(B, H, L, D)``, K and V ``(B, Hkv, L, D)`` for ``x (B, L, hidden)``."""
    batch, length = x.shape[0], x.shape[1]
    q = inner.q_proj(x)
    k = inner.k_proj(x)
    v = inner.v_proj(x)
    if spec_like.q_norm is NormMode.FLAT:
        q = inner.q_norm(q)
    if spec_like.k_norm is NormMode.FLAT:
        k = inner.k_norm(k)
    q = q.reshape(batch, length, spec_like.n_heads, spec_like.head_dim)
    k = k.reshape(batch, length, spec_like.n_kv_heads, spec_like.head_dim)
    v = v.reshape(batch, length, spec_like.n_kv_heads, spec_like.head_dim)
    if spec_like.q_norm is NormMode.PER_HEAD:
        q = inner.q_norm(q)
    if spec_like.k_norm is NormMode.PER_HEAD:
        k = inner.k_norm(k)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def inspect_attention(inner: Any, layer_id: int, sliding: bool) -> AttentionSpec:
    """Read ``inner``'s spec (not yet probe-verified), or ``UnsupportedModelError`` with why.

    Head counts follow :func:`kv_protocol.attention_heads` and the RoPE description
    :func:`kv_protocol.rope_config_from_module`, the rules the layout and kernels use.
    """
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
    heads = attention_heads(inner, where, require_query_heads=True)
    n_kv, head_dim, q_out, k_out = (
        heads.n_kv_heads,
        heads.head_dim,
        heads.q_features,
        heads.k_features,
    )
    n_heads = cast(int, heads.n_heads)  # required above
    if q_out is not None and q_out != n_heads * head_dim:
        raise UnsupportedModelError(
            f"{where}: q_proj produces {q_out} features, expected n_heads * head_dim = "
            f"{n_heads} * {head_dim} (gated or fused queries are not supported)"
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
        rope_config=rope_config_from_module(inner.rope)[0],
        has_sinks=isinstance(sinks, mx.array),
        sliding=sliding,
    )
