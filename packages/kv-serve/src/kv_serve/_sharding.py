"""Tensor-parallel sharding of a model over the ranks of an ``mx.distributed`` group.

A model whose mlx-lm class has ``shard()`` is sharded by it, after checking that its
attention heads split evenly (mlx-lm's rules divide the KV heads without looking). A model
without one is sharded here when every decoder layer is plain multi-head attention (``q_proj``
/ ``k_proj`` / ``v_proj`` / ``o_proj`` linears and head counts the module reads) beside a gated
MLP (``gate_proj`` / ``up_proj`` / ``down_proj``): Gemma 3, Cohere 2 and their kind. Query heads
and the MLP split across ranks; KV heads split where the ranks divide them and are replicated
where they divide the ranks (Gemma 3 270M has one KV head: every rank keeps it). Each rank's
attention then holds its own KV heads, so a pool built from the sharded model holds that
rank's share of the K/V bytes.

Either way the result is checked: every rank runs a short probe prompt through the model
before and after sharding, and unless the logits agree on every rank the model is refused
(on every rank alike) instead of serving wrong text.
"""

from __future__ import annotations

import os
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from kv_protocol import UnsupportedModelError, attention_module, find_layers

__all__ = ["PROBE_TOKENS", "shard_model"]

#: The probe prompt's length (token ids 1 .. PROBE_TOKENS).
PROBE_TOKENS = 8

#: The largest difference the probe accepts, relative to the logits' largest magnitude.
_TOLERANCE = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 5e-2}

_QUERY_NAMES = ("n_heads", "num_attention_heads", "num_heads")
_KV_NAMES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def shard_model(
    model: nn.Module, group: mx.distributed.Group, *, verify: bool | None = None
) -> bool:
    """Shard ``model`` in place over ``group`` (one share per rank); nothing at one rank.

    Raises ``UnsupportedModelError`` on every rank when the model has no sharding rule, its
    heads (or MLP width) cannot be split over ``group.size()`` ranks (refused before anything
    changes), or the sharded model's probe logits differ from the whole model's (the model is
    then left sharded and must not be used).

    The probe runs the whole model once before sharding, so every rank holds all its weights
    for a moment: ``verify=None`` (the default) probes only when the weights take at most half
    of this machine's memory (a model loaded lazily to be sharded because it does not fit
    one machine is sharded unprobed); ``True`` / ``False`` force it. Returns whether it
    probed.
    """
    ranks = group.size()
    if ranks == 1:
        return False
    if verify is None:
        verify = _weight_bytes(model) <= _memory_bytes() // 2
    model_type = _model_type(model)
    if callable(getattr(model, "shard", None)):
        _check_even_heads(model, model_type, ranks)
        apply = _mlx_lm_rule(model, model_type, group)
    else:
        apply = _heads_and_mlp_rule(model, model_type, group)
    before = _probe(model) if verify else None
    apply()
    # The shards are lazy slices of the full weights: evaluated here, on the thread that made
    # them, the full weights are freed and another thread (a server's engine thread) can use
    # them.
    mx.eval(model.parameters())
    if before is None:
        return False
    failure = ""
    try:
        after = _probe(model)
    except Exception as raised:  # the same on every rank: the rule broke the model's shapes
        after, failure = before, f"; the sharded model raised {raised!r}"
    if failure or after.shape != before.shape:
        error = float("inf")
    else:
        scale = max(1.0, _scalar(mx.max(mx.abs(before))))
        error = _scalar(mx.max(mx.abs(after - before))) / scale
    tolerance = _TOLERANCE.get(before.dtype, 5e-2)
    worst = mx.distributed.all_max(mx.array([error], dtype=mx.float32), group=group)
    worst_error = _scalar(worst)
    if not worst_error <= tolerance:
        raise UnsupportedModelError(
            f"sharding {model_type} over {ranks} ranks changed its logits on a probe prompt "
            f"(largest difference {worst_error:.2e} of the largest logit, tolerance "
            f"{tolerance:.0e}): its sharding rule does not fit this model{failure}"
        )
    return True


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (known from shapes, read or not)."""
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in flat)


def _memory_bytes() -> int:
    """The physical memory of the machine."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def _model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    name = getattr(args, "model_type", None)
    return str(name) if name else type(model).__module__.rsplit(".", 1)[-1]


def _probe(model: nn.Module) -> mx.array:
    """The model's logits (float32) for tokens 1 .. PROBE_TOKENS on fresh mlx-lm caches."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.arange(1, PROBE_TOKENS + 1, dtype=mx.int32)[None]
    logits = cast(mx.array, model(tokens, cache=make_prompt_cache(model))).astype(mx.float32)
    mx.eval(logits)
    return logits


def _scalar(value: mx.array) -> float:
    return float(cast(float, value.item()))


def _attribute(module: Any, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(module, n, None), int)), None)


def _check_even_heads(model: nn.Module, model_type: str, ranks: int) -> None:
    """mlx-lm's rules split every attention layer's heads ``ranks`` ways: they must divide."""
    for i, layer in enumerate(find_layers(model)):
        attention = attention_module(layer)
        if attention is None:
            continue  # a recurrent layer: mlx-lm's rule shards it
        for what, names in (("query", _QUERY_NAMES), ("KV", _KV_NAMES)):
            name = _attribute(attention, names)
            count = getattr(attention, name) if name else None
            if count is not None and count % ranks:
                raise UnsupportedModelError(
                    f"{model_type} layer {i} has {count} {what} heads, which {ranks} ranks "
                    f"cannot split evenly (mlx-lm's shard() divides them; use a world size "
                    f"that divides {count})"
                )


def _mlx_lm_rule(model: nn.Module, model_type: str, group: mx.distributed.Group) -> Any:
    def apply() -> None:
        try:
            model.shard(group)
        except (AssertionError, ValueError) as error:
            raise UnsupportedModelError(
                f"mlx-lm could not shard {model_type} over {group.size()} ranks: {error}"
            ) from error

    return apply


def _heads_and_mlp_rule(model: nn.Module, model_type: str, group: mx.distributed.Group) -> Any:
    """Check that every layer fits the rule (nothing changed otherwise); return its application."""
    ranks, rank = group.size(), group.rank()
    layers = find_layers(model)
    rule = (
        f"{model_type} has no tensor-parallel sharding rule: kv-serve shards models whose "
        "mlx-lm class has shard(), and models of plain attention (q/k/v/o projections) beside "
        "a gated MLP (gate/up/down projections)"
    )
    plans = []
    for i, layer in enumerate(layers):
        attention = attention_module(layer)
        mlp = getattr(layer, "mlp", None)
        if attention is None or mlp is None:
            raise UnsupportedModelError(f"{rule}; layer {i} is not")
        projections = [
            getattr(attention, "o_proj", None),
            *(getattr(mlp, n, None) for n in _MLP_NAMES),
        ]
        projections += [attention.q_proj, attention.k_proj, attention.v_proj]
        if not all(isinstance(p, nn.Linear | nn.QuantizedLinear) for p in projections):
            raise UnsupportedModelError(f"{rule}; layer {i} is not")
        query_name, kv_name = _attribute(attention, _QUERY_NAMES), _attribute(attention, _KV_NAMES)
        if query_name is None or kv_name is None:
            raise UnsupportedModelError(f"{rule}; layer {i}'s attention names no head counts")
        queries, kv = int(getattr(attention, query_name)), int(getattr(attention, kv_name))
        head_dim = _rows(attention.q_proj) // queries
        across = _norm_across_heads(attention, head_dim)
        if across is not None:
            raise UnsupportedModelError(
                f"{model_type} layer {i}'s {across} normalises across heads: splitting its "
                "heads would change it, so it has no tensor-parallel sharding rule"
            )
        if queries % ranks:
            raise UnsupportedModelError(
                f"{model_type} layer {i} has {queries} query heads, which {ranks} ranks cannot "
                "split evenly"
            )
        if kv % ranks and ranks % kv:
            raise UnsupportedModelError(
                f"{model_type} layer {i} has {kv} KV heads: {ranks} ranks can neither split "
                "them evenly nor replicate them (the world size must divide the KV heads or "
                "be a multiple of them)"
            )
        width = _rows(mlp.gate_proj)
        if width % ranks:
            raise UnsupportedModelError(
                f"{model_type} layer {i}'s MLP width {width} does not split over {ranks} ranks"
            )
        plans.append((attention, mlp, query_name, kv_name, queries, kv, head_dim))

    def apply() -> None:
        for attention, mlp, query_name, kv_name, queries, kv, head_dim in plans:
            attention.q_proj = shard_linear(attention.q_proj, "all-to-sharded", group=group)
            attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
            if _splits_kv(kv, ranks):
                attention.k_proj = shard_linear(attention.k_proj, "all-to-sharded", group=group)
                attention.v_proj = shard_linear(attention.v_proj, "all-to-sharded", group=group)
                kept = kv // ranks
            else:
                # Rank r's query heads r*q/N .. (r+1)*q/N - 1 all read KV head r*kv // N.
                head = rank * kv // ranks
                for projection in (attention.k_proj, attention.v_proj):
                    _keep_rows(projection, head * head_dim, head_dim)
                kept = 1
            setattr(attention, query_name, queries // ranks)
            setattr(attention, kv_name, kept)
            if isinstance(getattr(attention, "repeats", None), int):
                attention.repeats = (queries // ranks) // kept
            mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
            mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)

    return apply


def _splits_kv(kv: int, ranks: int) -> bool:
    """Whether ``ranks`` split ``kv`` KV heads (else each rank keeps one of them)."""
    return kv % ranks == 0


def _norm_across_heads(attention: Any, head_dim: int) -> str | None:
    """The name of a query/key norm wider than one head (it would see other ranks' heads)."""
    for name in ("q_norm", "k_norm"):
        weight = getattr(getattr(attention, name, None), "weight", None)
        if isinstance(weight, mx.array) and weight.shape[-1] != head_dim:
            return name
    return None


def _rows(projection: nn.Module) -> int:
    """Output features of a (possibly quantized) linear layer."""
    return int(cast(mx.array, projection.weight).shape[0])


def _keep_rows(projection: nn.Module, start: int, count: int) -> None:
    """Keep output rows ``start .. start + count`` of a (possibly quantized) linear layer."""
    for name in ("weight", "scales", "biases", "bias"):
        value = getattr(projection, name, None)
        if isinstance(value, mx.array):
            setattr(projection, name, mx.contiguous(value[start : start + count]))
