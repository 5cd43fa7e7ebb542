"""Decode attention softmax from vectorised arithmetic, for MLX's CPU backend.

MLX's CPU ``exp`` evaluates element by element (measured 11.5 ns an element on a 2-core
x86_64: 0.76 ms of a 2.4 ms decode attention over 16 x 8 heads x 512 keys), and its
``scaled_dot_product_attention`` falls back to unfused operations on the CPU anyway. Here
the weights come from :func:`kv_protocol.exp_nonpositive` (adds, multiplies and shifts, which
MLX vectorises: about 3x faster, with a relative error below ``2.5e-7 + 7.5e-8 * |x|`` on the
values softmax needs, ``x <= 0``: 4e-7 where a weight is at least 0.7% of the row's largest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx

from kv_protocol import MaskSpec, ShapeMismatchError, exp_nonpositive

from ._memo import IdentityMemo

__all__ = [
    "exp_nonpositive",
    "prefill_softmax_attention",
    "softmax_attention",
    "softmax_parts",
    "unfused_softmax_choice",
    "use_unfused_softmax",
]


def _weights(
    scores: mx.array, mask: mx.array | None, sink_logits: mx.array | None, additive: bool
) -> tuple[mx.array, mx.array]:
    """Float32 ``scores`` -> unnormalised softmax weights and their denominators.

    ``mask`` is a boolean keep-mask, or with ``additive`` a float mask added to the scores;
    ``sink_logits`` (one per head) join the denominator, as attention sinks do.
    """
    if mask is not None:
        scores = scores + mask if additive else mx.where(mask, scores, -mx.inf)
    peak = scores.max(axis=-1, keepdims=True)
    if sink_logits is not None:
        peak = mx.maximum(peak, sink_logits)
    weights = exp_nonpositive(scores - peak)
    denominator = weights.sum(axis=-1, keepdims=True)
    if sink_logits is not None:
        denominator = denominator + exp_nonpositive(sink_logits - peak)
    return weights, denominator


_Parts = Callable[..., tuple[mx.array, mx.array]]
# Compiled, the elementwise chain runs as one fused CPU kernel (measured 6x faster than
# MLX's exp at 16 x 8 x 512 scores); a traced shape is reused, a new one re-traced. Without
# a C++ compiler MLX runs the same operations one by one (checked with none on PATH).
_compiled: dict[tuple[bool, bool, bool], _Parts] = {}


def _variant(has_mask: bool, additive: bool, has_sinks: bool) -> _Parts:
    """:func:`_weights` for one combination of optional inputs, as a function of arrays only."""

    def parts(*arrays: mx.array) -> tuple[mx.array, mx.array]:
        it = iter(arrays)
        scores = next(it)
        mask = next(it) if has_mask else None
        sinks = next(it) if has_sinks else None
        return _weights(scores, mask, sinks, additive)

    return parts


def softmax_parts(
    scores: mx.array, mask: mx.array | None, sink_logits: mx.array | None, *, additive: bool
) -> tuple[mx.array, mx.array]:
    """:func:`_weights` through ``mx.compile``."""
    key = (mask is not None, additive, sink_logits is not None)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = mx.compile(_variant(*key))
    return fn(*[a for a in (scores, mask, sink_logits) if a is not None])


def unfused_softmax_choice(value: object) -> bool | None:
    """Check a kernel's ``unfused_softmax`` argument: ``True``, ``False`` or ``None``."""
    if value is not None and not isinstance(value, bool):
        raise ShapeMismatchError(f"unfused_softmax must be True, False or None, got {value!r}")
    return value


def use_unfused_softmax(choice: bool | None) -> bool:
    """Whether to compose attention with :func:`softmax_parts`: ``None`` means on the CPU.

    There MLX's fused attention falls back to unfused operations whose ``exp`` runs element
    by element; elsewhere its fused kernel is the faster one.
    """
    if choice is None:
        return mx.default_device().type == mx.DeviceType.cpu
    return choice


def _grouped_attention(
    q_rows: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: mx.array | None,
    sink_logits: mx.array | None,
    *,
    group: int,
    additive: bool,
) -> mx.array:
    """Float32 ``(P, Q, group, T, D)`` attention of scaled ``q_rows (P, Q, group * T, D)``.

    ``keys`` / ``values`` are ``(P, Q, S, D)`` (``P, Q`` = batch and KV head, in either
    order): the ``group`` query heads of a KV head are rows of one matmul. ``mask`` and
    ``sink_logits`` broadcast to the ``(P, Q, group, T, S)`` scores.
    """
    p, r, rows, head_dim = q_rows.shape
    t, s = rows // group, keys.shape[2]
    scores = (q_rows @ keys.swapaxes(-1, -2)).astype(mx.float32).reshape(p, r, group, t, s)
    weights, denominator = softmax_parts(scores, mask, sink_logits, additive=additive)
    out = weights.astype(values.dtype).reshape(p, r, rows, s) @ values
    return out.astype(mx.float32).reshape(p, r, group, t, head_dim) / denominator


def softmax_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    keep: mx.array,
    *,
    scale: float,
    sinks: mx.array | None,
) -> mx.array:
    """Decode attention over head-major keys, softmax in float32 via :func:`exp_nonpositive`.

    ``q`` is ``(B, Hq, T, D)`` (``T`` queries per row, usually one); ``keys`` / ``values``
    ``(Hkv, B, L, D)`` (the layout a head-major page gather produces, so no transpose of the
    keys is copied); ``keep`` ``(B, L)`` for one query or ``(B, T, L)`` marks the keys each
    query attends (at least one per query). ``sinks`` (``(Hq,)``) adds one logit per head to
    the softmax's denominator, as attention sinks do. Returns ``(B, Hq, T, D)`` in ``q``'s
    dtype.
    """
    b, n_heads, t, head_dim = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    # (Hkv, B, group * T, D): query head h reads kv head h // group.
    q_heads = (
        (q.reshape(b, n_kv, group, t, head_dim) * scale)
        .transpose(1, 0, 2, 3, 4)
        .reshape(n_kv, b, group * t, head_dim)
    )
    sink_logits = None
    if sinks is not None:
        sink_logits = sinks.astype(mx.float32).reshape(n_kv, 1, group, 1, 1)
    mask = keep[None, :, None, None, :] if keep.ndim == 2 else keep[None, :, None, :, :]
    out = _grouped_attention(
        q_heads,
        keys,
        values,
        mask,
        sink_logits,
        group=group,
        additive=False,
    )
    return out.astype(q.dtype).transpose(1, 0, 2, 3, 4).reshape(b, n_heads, t, head_dim)


def _query_mask(mask: MaskSpec, b: int, n_kv: int, group: int, t: int, s: int) -> mx.array | None:
    """``mask`` as an array broadcastable to the ``(B, Hkv, group, T, S)`` scores."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ShapeMismatchError(f"mask must be None, 'causal' or an array, got {mask!r}")
        # Query t is position s - t_len + t: it sees every key up to itself.
        return mx.arange(s)[None, :] <= mx.arange(s - t, s)[:, None]
    if mask.ndim < 2 or mask.shape[-2:] not in ((t, s), (1, s), (t, 1), (1, 1)):
        raise ShapeMismatchError(
            f"a prefill mask must end in (T, S) = ({t}, {s}), got shape {tuple(mask.shape)}"
        )
    if mask.ndim <= 2:
        return mask
    heads = mask.shape[-3]
    lead = mask.reshape(-1, heads, *mask.shape[-2:])
    if lead.shape[0] not in (1, b) or heads not in (1, n_kv * group):
        raise ShapeMismatchError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, T, S) = "
            f"({b}, {n_kv * group}, {t}, {s})"
        )
    if heads == 1:
        return lead[:, :, None]
    return lead.reshape(lead.shape[0], n_kv, group, *mask.shape[-2:])


#: Query rows per block of a prefill's attention: bounds the float32 scores held at once.
PREFILL_QUERY_BLOCK = 128


def prefill_softmax_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: MaskSpec,
    sinks: mx.array | None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``'s result, the softmax from :func:`softmax_parts`.

    ``q`` is ``(B, Hq, T, D)``, ``keys`` / ``values`` ``(B, Hkv, S, D)``; ``mask`` ``None``,
    ``"causal"`` (aligned to the last key), a boolean keep-mask or an additive float mask
    broadcastable to ``(B, Hq, T, S)``; ``sinks (Hq,)`` one extra logit per head.

    Queries are attended in blocks of :data:`PREFILL_QUERY_BLOCK` rows, so the scores held
    at once are ``(B, Hq, 128, S)``; under ``"causal"`` a block reads only the keys up to its
    last query, so the masked upper triangle is not computed either. Under a boolean mask
    with a row per query (a sliding window's band) a block reads only the span of keys its
    rows keep (:func:`block_key_spans`): a 512-token chunk of a 512-token window reads 639
    of its 1023 keys per block.
    """
    t, s = q.shape[2], keys.shape[2]
    if t <= PREFILL_QUERY_BLOCK:
        return _attend_queries(q, keys, values, scale=scale, mask=mask, sinks=sinks)
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] not in (1, t):
        _query_mask(mask, q.shape[0], keys.shape[1], 1, t, s)  # raises with the shapes
    spans: list[tuple[int, int]] | None = None
    if (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim >= 2
        and mask.shape[-2:] == (t, s)
    ):
        spans = block_key_spans(mask)
    outs: list[mx.array] = []
    for start in range(0, t, PREFILL_QUERY_BLOCK):
        stop = min(start + PREFILL_QUERY_BLOCK, t)
        rows = q[:, :, start:stop]
        if outs:
            # One block after the other: its scores are freed before the next block's exist.
            rows = cast(mx.array, mx.depends(rows, outs[-1]))
        if isinstance(mask, str) and mask == "causal":
            # Query `stop - 1` is position s - t + stop - 1: no block query sees further.
            visible = s - t + stop
            block_mask: MaskSpec = "causal"
            block_keys, block_values = keys[:, :, :visible], values[:, :, :visible]
        elif spans is not None:
            assert isinstance(mask, mx.array)
            low, high = spans[start // PREFILL_QUERY_BLOCK]
            block_keys, block_values = keys[:, :, low:high], values[:, :, low:high]
            block_mask = mask[..., start:stop, low:high]
        else:
            block_keys, block_values = keys, values
            block_mask = mask
            if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == t:
                block_mask = mask[..., start:stop, :]
        outs.append(
            _attend_queries(
                rows, block_keys, block_values, scale=scale, mask=block_mask, sinks=sinks
            )
        )
    return mx.concatenate(outs, axis=2)


_spans: IdentityMemo[list[tuple[int, int]]] = IdentityMemo(4)


def block_key_spans(mask: mx.array) -> list[tuple[int, int]]:
    """Per block of :data:`PREFILL_QUERY_BLOCK` query rows, the keys its rows keep.

    ``mask`` is a boolean keep-mask ending in ``(T, S)`` (leading dimensions are merged: a
    key kept for any batch row or head counts). Block ``i`` gets ``(low, high)``: every key
    its rows keep lies in ``low .. high - 1``, so the keys outside add nothing to its
    attention. A block that keeps no key at all gets ``(0, S)`` (its attention is what the
    whole mask gives). One reduction read back to the host, kept for the last few mask
    objects: a model's layers of one kind share one mask per forward.
    """
    held = _spans.get(mask, None)
    if held is not None:
        return held
    t, s = mask.shape[-2], mask.shape[-1]
    rows = mask.reshape(-1, t, s).any(axis=0)
    blocks = -(-t // PREFILL_QUERY_BLOCK)
    pad = blocks * PREFILL_QUERY_BLOCK - t
    if pad:
        rows = mx.concatenate([rows, mx.zeros((pad, s), dtype=mx.bool_)], axis=0)
    kept = rows.reshape(blocks, PREFILL_QUERY_BLOCK, s).any(axis=1)
    first = mx.argmax(kept, axis=1)
    last = s - mx.argmax(kept[:, ::-1], axis=1)
    any_kept = kept.any(axis=1)
    bounds = cast(list[list[int]], mx.stack([first, last, any_kept.astype(mx.int32)]).tolist())
    spans = [
        (low, high) if has else (0, s)
        for low, high, has in zip(bounds[0], bounds[1], bounds[2], strict=True)
    ]
    _spans.put(mask, None, spans)
    return spans


def _attend_queries(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: MaskSpec,
    sinks: mx.array | None,
) -> mx.array:
    """One block of :func:`prefill_softmax_attention`: every query row in one softmax."""
    b, n_heads, t, head_dim = q.shape
    n_kv, s = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv
    q_rows = (q * scale).reshape(b, n_kv, group * t, head_dim)
    query_mask = _query_mask(mask, b, n_kv, group, t, s)
    additive = query_mask is not None and query_mask.dtype != mx.bool_
    if additive:
        assert query_mask is not None
        query_mask = query_mask.astype(mx.float32)
    sink_logits = None
    if sinks is not None:
        sink_logits = sinks.astype(mx.float32).reshape(1, n_kv, group, 1, 1)
    out = _grouped_attention(
        q_rows, keys, values, query_mask, sink_logits, group=group, additive=additive
    )
    return out.astype(q.dtype).reshape(b, n_heads, t, head_dim)
