"""The probe: run one attention module once and check the fused path reproduces it exactly."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kv_protocol import (
    UnsupportedModelError,
)

from ._attention_spec import AttentionSpec, project_qkv

__all__ = ["probe_attention"]


PROBE_PREFIX = 5


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


def _in_features(linear: Any) -> int | None:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, mx.array):
        return None
    bits = getattr(linear, "bits", None)
    if isinstance(bits, int) and not mx.issubdtype(weight.dtype, mx.floating):
        return int(weight.shape[1]) * 32 // bits
    return int(weight.shape[1])


def _max_rel_err(a: mx.array, b: mx.array) -> float:
    a32 = a.astype(mx.float32)
    b32 = b.astype(mx.float32)
    scale = float(mx.max(mx.abs(b32))) + 1e-6
    return float(mx.max(mx.abs(a32 - b32))) / scale


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 3e-2


def probe_attention(inner: Any, spec: AttentionSpec) -> AttentionSpec:
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
    q, k, v = project_qkv(inner, spec, x)
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
