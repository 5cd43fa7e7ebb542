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
from ._context import BatchedDecodeContext
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
        q, k, v = project_qkv(inner, spec, x)

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
