"""The wrapper module: batched paged decode for one probe-verified mlx-lm attention module."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    CacheStateError,
    ShapeMismatchError,
)

from ._attention_spec import AttentionSpec, project_qkv
from ._decode_step import LayerStep
from ._layer_cache import BatchedLayerCache

__all__ = ["BatchedAttention"]


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
                return self.batched_decode(x, candidate.layer)
        result: mx.array = self.inner(x, *args, **kwargs)
        return result

    def batched_decode(self, x: mx.array, layer: LayerStep) -> mx.array:
        """One decode token per request: project, RoPE, write K/V to the pool, paged attention.

        ``x`` is ``(B, 1, hidden)`` with row ``b`` the token of the step's ``b``-th request.
        """
        spec = self.spec
        if layer.layer_id != spec.layer_id:
            raise CacheStateError(
                f"the wrapper of layer {spec.layer_id} was handed the decode view of layer "
                f"{layer.layer_id}; each layer must get its own cache"
            )
        ctx = layer.context
        batch = x.shape[0]
        if x.ndim != 3 or x.shape[1] != 1 or batch != ctx.batch_size:
            raise ShapeMismatchError(
                f"batched decode of layer {spec.layer_id} expects x of shape ({ctx.batch_size}, "
                f"1, hidden), got {tuple(x.shape)}"
            )
        pool = layer.pool
        kernels = layer.kernels
        inner: Any = self.inner
        pool_layer = layer.pool_layer
        q, k, v = project_qkv(inner, spec, x)

        rope_kernel = kernels.rope
        config = spec.rope_config
        k_buffer = pool.get_key_buffer(pool_layer) if layer.fused_rope else None
        v_buffer = pool.get_value_buffer(pool_layer) if layer.fused_rope else None
        if (
            isinstance(k_buffer, mx.array)  # a quantized layer's pages: only set_kv writes
            and isinstance(v_buffer, mx.array)
            and rope_kernel is not None
            and config is not None
            and rope_kernel.supports(config)
        ):
            q, _, k_pool, v_pool = rope_kernel(
                q,
                k,
                v,
                ctx.offsets,
                layer.new_token_slots,
                k_buffer,
                v_buffer,
                rope=config,
            )
            pool.replace_buffers(pool_layer, k_pool, v_pool)
            q4 = q[:, :, None, :]
        else:
            q4 = q[:, :, None, :]
            if spec.uses_rope:
                q4 = inner.rope(q4, offset=ctx.offsets)
                k = inner.rope(k[:, :, None, :], offset=ctx.offsets)[:, :, 0, :]
            pool.set_kv(pool_layer, layer.new_token_slots, k, v)

        out = kernels.attention(
            q4,
            pool.get_key_buffer(pool_layer),
            pool.get_value_buffer(pool_layer),
            layer.page_table,
            ctx.valid_lens,
            page_size=layer.page_size,
            scale=spec.scale,
            window=layer.window,
            sinks=inner.sinks if spec.has_sinks else None,
        )
        result: mx.array = inner.o_proj(out.reshape(batch, 1, spec.n_heads * spec.head_dim))
        return result
