"""The wrapper module: batched paged decode for one probe-verified mlx-lm attention module."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    CacheStateError,
    NormRopeKernel,
    PrefillAttention,
    RmsNormForm,
    ShapeMismatchError,
)

from ._attention_spec import AttentionSpec, NormMode, project_qkv, project_qkv_tokens
from ._decode_step import LayerStep
from ._layer_cache import BatchedLayerCache
from ._rope_table import rope_chunk, rope_row_factors, rope_rows

__all__ = ["BatchedAttention"]


class _RowNorms:
    """A wrapper's q/k norm modules; usable where each is ``None`` or an ``RmsNormForm``."""

    __slots__ = ("key", "query", "usable")

    def __init__(self, query: Any, key: Any) -> None:
        self.query: RmsNormForm | None = query
        self.key: RmsNormForm | None = key
        self.usable = all(m is None or isinstance(m, RmsNormForm) for m in (query, key))


class BatchedAttention(nn.Module):
    """Wraps one attention module; batched paged decode when handed a BatchedLayerCache.

    With any other cache (or none) the original module runs unchanged, unless
    ``prefill_attention`` is set (the engine's ``AttentionWrappers`` change sets it while it
    builds a prompt chunk's forward): then a
    call of the module's usual form ``(x, mask, cache)`` whose cache has an integer
    ``offset`` runs the same projections, norms, RoPE and ``cache.update_and_fetch`` and
    attends through that kernel. Attribute reads the wrapper does not define fall through to
    the original module, so code that inspects the attention (layouts, head counts, sliding
    flags) sees it unchanged.
    """

    def __init__(self, inner: nn.Module, spec: AttentionSpec, child_name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner = inner
        self.spec = spec
        self.child_name = child_name
        self.prefill_attention: PrefillAttention | None = None
        self._row_norms: _RowNorms | None = None

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
        kernel = self.prefill_attention
        if kernel is not None:
            call = _mask_and_cache(args, kwargs)
            if call is not None:
                return self.prefill(x, call[0], call[1], kernel)
        result: mx.array = self.inner(x, *args, **kwargs)
        return result

    def prefill(self, x: mx.array, mask: Any, cache: Any, kernel: PrefillAttention) -> mx.array:
        """The module's forward for ``x (B, L, hidden)`` with ``kernel`` as its attention."""
        spec = self.spec
        inner: Any = self.inner
        batch, length = x.shape[0], x.shape[1]
        q, k, v = project_qkv_tokens(inner, spec, x)
        if spec.uses_rope:
            offset = cache.offset
            rope = spec.rope_config
            if rope is not None and mx.default_device().type == mx.cpu:
                # The chunk's angles are the same in every layer with this rope: one table
                # (bit-identical to the module's mx.fast.rope; see _rope_table).
                q, k = rope_chunk(q, offset, rope), rope_chunk(k, offset, rope)
            else:
                q = inner.rope(q, offset=offset)
                k = inner.rope(k, offset=offset)
        keys, values = cache.update_and_fetch(k, v)
        out = kernel(
            q,
            keys,
            values,
            scale=spec.scale,
            mask=mask,
            sinks=inner.sinks if spec.has_sinks else None,
        )
        flat = out.transpose(0, 2, 1, 3).reshape(batch, length, spec.n_heads * spec.head_dim)
        result: mx.array = inner.o_proj(flat)
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
        rows_kernel = getattr(kernels, "norm_rope", None)
        fast = None
        if rows_kernel is not None and layer.route != "fused":
            fast = self._norm_rope_qkv(x, layer, rows_kernel)
        if fast is not None:
            q4, k, v = fast
            pool.set_kv(pool_layer, layer.new_token_slots, k, v)
        else:
            q4 = self._project_rope_write(x, layer)

        queries = layer.queries
        request_table = layer.request_page_table
        # A kernel that is also a PagedQueryAttention (read with getattr: this runs per
        # layer and step, and a runtime protocol check is slow and caches per class).
        attend_queries = (
            None if queries is None else getattr(kernels.attention, "attend_queries", None)
        )
        heads, dim = spec.n_heads, spec.head_dim
        grouped = queries is not None and request_table is not None and attend_queries is not None
        if grouped:
            # Requests verifying proposals own several adjacent rows: their queries are
            # attended together, from one read of each request's pages.
            assert queries is not None and request_table is not None and attend_queries
            attend, table, lens = attend_queries, request_table, queries.seq_lens
            rows = q4[queries.rows].reshape(-1, queries.width, heads, dim).transpose(0, 2, 1, 3)
        else:
            attend, table, lens, rows = kernels.attention, layer.page_table, ctx.valid_lens, q4
        out = attend(
            rows,
            pool.get_key_buffer(pool_layer),
            pool.get_value_buffer(pool_layer),
            table,
            lens,
            page_size=layer.page_size,
            scale=spec.scale,
            window=layer.window,
            sinks=inner.sinks if spec.has_sinks else None,
        )
        if grouped:
            assert queries is not None
            out = out.transpose(0, 2, 1, 3).reshape(-1, heads, dim)[queries.cells]
        result: mx.array = inner.o_proj(out.reshape(batch, 1, heads * dim))
        return result

    def _project_rope_write(self, x: mx.array, layer: LayerStep) -> mx.array:
        """Project, rotate and write K/V with MLX's operations (or the fused kernel).

        Returns the rotated queries ``(B, H, 1, D)``.
        """
        spec = self.spec
        inner: Any = self.inner
        ctx = layer.context
        pool = layer.pool
        kernels = layer.kernels
        pool_layer = layer.pool_layer
        q, k, v = project_qkv(inner, spec, x)

        rope_kernel = kernels.rope
        if layer.route == "fused" and rope_kernel is not None and spec.rope_config is not None:
            # Decided when the engine was built: a FULL layer on plain pages whose RoPE the
            # kernel implements.
            q, _, k_pool, v_pool = rope_kernel(
                q,
                k,
                v,
                ctx.offsets,
                layer.new_token_slots,
                cast(mx.array, pool.get_key_buffer(pool_layer)),
                cast(mx.array, pool.get_value_buffer(pool_layer)),
                rope=spec.rope_config,
            )
            pool.replace_buffers(pool_layer, k_pool, v_pool)
            q4 = q[:, :, None, :]
        else:
            q4 = q[:, :, None, :]
            if spec.uses_rope:
                rope = spec.rope_config
                if rope is not None and mx.default_device().type == mx.cpu:
                    # One table of the step's angles for every layer with this rope
                    # (bit-identical to the module's mx.fast.rope; see _rope_table).
                    q4 = rope_rows(q4, ctx.offsets, rope)
                    k = rope_rows(k[:, :, None, :], ctx.offsets, rope)[:, :, 0, :]
                else:
                    q4 = inner.rope(q4, offset=ctx.offsets)
                    k = inner.rope(k[:, :, None, :], offset=ctx.offsets)[:, :, 0, :]
            pool.set_kv(pool_layer, layer.new_token_slots, k, v)
        return q4

    def _norm_rope_qkv(
        self, x: mx.array, layer: LayerStep, kernel: NormRopeKernel
    ) -> tuple[mx.array, mx.array, mx.array] | None:
        """Q ``(B, H, 1, D)``, K and V ``(B, Hkv, D)`` with norms and RoPE by ``kernel``.

        ``None`` where the kernel does not serve this layer: a RoPE that does not rotate
        whole heads in halves, q/k norms that are not per-head
        :class:`kv_protocol.RmsNormForm` modules, or rows the kernel declines.
        """
        spec = self.spec
        rope = spec.rope_config
        if rope is None or rope.dims != spec.head_dim or x.dtype != mx.float32:
            return None
        norms = self._norms()
        if norms is None:
            return None
        factors = rope_row_factors(layer.context.offsets, rope, x.dtype)
        if factors is None:
            return None
        inner: Any = self.inner
        batch = x.shape[0]
        cos_both, sin_signed = factors
        q = kernel(
            inner.q_proj(x),
            heads=spec.n_heads,
            cos_both=cos_both,
            sin_signed=sin_signed,
            norm=norms.query,
        )
        k = kernel(
            inner.k_proj(x),
            heads=spec.n_kv_heads,
            cos_both=cos_both,
            sin_signed=sin_signed,
            norm=norms.key,
        )
        if q is None or k is None:
            return None
        v = inner.v_proj(x).reshape(batch, spec.n_kv_heads, spec.head_dim)
        return q.reshape(batch, spec.n_heads, 1, spec.head_dim), k, v

    def _norms(self) -> _RowNorms | None:
        """The q/k norms as :class:`kv_protocol.RmsNormForm` modules (or absent), else ``None``.

        Kept for the modules it was found for: norm modules may be swapped after wrapping.
        """
        spec = self.spec
        inner: Any = self.inner
        found: list[Any] = []
        for mode, name in ((spec.q_norm, "q_norm"), (spec.k_norm, "k_norm")):
            if mode is NormMode.NONE:
                found.append(None)
            elif mode is NormMode.PER_HEAD:
                found.append(getattr(inner, name, None))
            else:
                return None
        held = self._row_norms
        if held is None or held.query is not found[0] or held.key is not found[1]:
            held = self._row_norms = _RowNorms(found[0], found[1])
        return held if held.usable else None


def _mask_and_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """``(mask, cache)`` of a call ``(x, mask, cache)`` (positional or keyword), else ``None``.

    Only a mask of ``mx.fast.scaled_dot_product_attention``'s kinds and a cache with an
    integer ``offset`` and ``update_and_fetch`` that returns plain arrays (not mlx-lm's
    quantized caches, which have ``bits``) qualify; anything else keeps the module's own
    forward.
    """
    if set(kwargs) - {"mask", "cache"} or len(args) > 2:
        return None
    names = ("mask", "cache")[: len(args)]
    if any(name in kwargs for name in names):
        return None
    bound = dict(zip(names, args, strict=False)) | kwargs
    mask, cache = bound.get("mask"), bound.get("cache")
    if not (
        mask is None or isinstance(mask, mx.array) or (isinstance(mask, str) and mask == "causal")
    ):
        return None
    offset = getattr(cache, "offset", None)
    if isinstance(offset, bool) or not isinstance(offset, int):
        return None
    if not callable(getattr(cache, "update_and_fetch", None)):
        return None
    if getattr(cache, "bits", None) is not None:
        return None  # mlx-lm's quantized caches return packed tuples only their module reads
    return mask, cache
