"""Tensor-parallel sharding of a model over the ranks of an ``mx.distributed`` group.

A model whose mlx-lm class has ``shard()`` is sharded by it, after checking that its heads
split evenly (mlx-lm's rules divide the KV heads without looking). Gemma 3 (text), which has
no rule in mlx-lm, is sharded here: query heads and the MLP split across ranks, and KV heads
split where the ranks divide them or replicated where they divide the ranks (Gemma 3 270M has
one KV head: every rank keeps it). Each rank's attention then holds its own KV heads, so a
pool built from the sharded model holds that rank's share of the K/V bytes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from kv_protocol import (
    LayerKind,
    UnsupportedModelError,
    attention_module,
    find_layers,
    layout_from_model,
)

__all__ = ["SHARDED_BY_KV_SERVE", "shard_model"]

#: ``model_type`` values this module shards itself (mlx-lm has no ``shard()`` for them).
SHARDED_BY_KV_SERVE = ("gemma3_text",)


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Shard ``model`` in place over ``group`` (one share per rank); nothing at one rank.

    Raises ``UnsupportedModelError`` before changing anything when the model has no sharding
    rule or its heads (or MLP width) cannot be split over ``group.size()`` ranks.
    """
    ranks = group.size()
    if ranks == 1:
        return
    _shard(model, group)
    # The shards are lazy slices of the full weights: evaluated here, on the thread that
    # made them, the full weights are freed and another thread (a server's engine thread)
    # can use them.
    mx.eval(model.parameters())


def _shard(model: nn.Module, group: mx.distributed.Group) -> None:
    ranks = group.size()
    model_type = _model_type(model)
    if model_type in SHARDED_BY_KV_SERVE:
        _shard_gemma3(model, group)
        return
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(
            f"{model_type} has no tensor-parallel sharding rule: kv-serve shards models whose "
            f"mlx-lm class has shard() and {', '.join(SHARDED_BY_KV_SERVE)}"
        )
    _check_even_heads(model, model_type, ranks)
    try:
        model.shard(group)
    except (AssertionError, ValueError) as error:
        raise UnsupportedModelError(
            f"mlx-lm could not shard {model_type} over {ranks} ranks: {error}"
        ) from error


def _model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    name = getattr(args, "model_type", None)
    return str(name) if name else type(model).__module__.rsplit(".", 1)[-1]


def _heads(module: Any) -> tuple[int | None, int | None]:
    """(query heads, KV heads) of an attention module, where it says."""
    queries = getattr(module, "n_heads", None) or getattr(module, "num_attention_heads", None)
    kv = getattr(module, "n_kv_heads", None) or getattr(module, "num_key_value_heads", None)
    return queries, kv


def _check_even_heads(model: nn.Module, model_type: str, ranks: int) -> None:
    """mlx-lm's rules split every attention layer's heads ``ranks`` ways: they must divide."""
    layout = layout_from_model(model)
    layers = find_layers(model)
    for spec in layout.specs:
        if spec.kind is LayerKind.STATE:
            continue
        queries, _ = _heads(attention_module(layers[spec.layer_id]))
        for what, count in (("query", queries), ("KV", spec.n_kv_heads)):
            if count is not None and count % ranks:
                raise UnsupportedModelError(
                    f"{model_type} layer {spec.layer_id} has {count} {what} heads, which "
                    f"{ranks} ranks cannot split evenly (mlx-lm's shard() divides them; use a "
                    f"world size that divides {count})"
                )


def _shard_gemma3(model: nn.Module, group: mx.distributed.Group) -> None:
    ranks, rank = group.size(), group.rank()
    layers = find_layers(model)
    # Every check first: a refused model is left whole.
    for i, layer in enumerate(layers):
        attention = layer.self_attn
        queries, kv = attention.n_heads, attention.n_kv_heads
        if queries % ranks:
            raise UnsupportedModelError(
                f"gemma3_text layer {i} has {queries} query heads, which {ranks} ranks cannot "
                "split evenly"
            )
        if kv % ranks and ranks % kv:
            raise UnsupportedModelError(
                f"gemma3_text layer {i} has {kv} KV heads: {ranks} ranks can neither split "
                "them evenly nor replicate them (the world size must divide the KV heads or "
                "be a multiple of them)"
            )
        width = layer.mlp.gate_proj.weight.shape[0]
        if width % ranks:
            raise UnsupportedModelError(
                f"gemma3_text layer {i}'s MLP width {width} does not split over {ranks} ranks"
            )
    for layer in layers:
        attention = layer.self_attn
        queries, kv = attention.n_heads, attention.n_kv_heads
        attention.q_proj = shard_linear(attention.q_proj, "all-to-sharded", group=group)
        attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
        if kv % ranks == 0:
            attention.k_proj = shard_linear(attention.k_proj, "all-to-sharded", group=group)
            attention.v_proj = shard_linear(attention.v_proj, "all-to-sharded", group=group)
            attention.n_kv_heads = kv // ranks
        else:
            # Rank r's query heads r*q/N .. (r+1)*q/N - 1 all read KV head r*kv // N.
            head = rank * kv // ranks
            for projection in (attention.k_proj, attention.v_proj):
                _keep_rows(projection, head * attention.head_dim, attention.head_dim, kv)
            attention.n_kv_heads = 1
        attention.n_heads = queries // ranks
        attention.repeats = attention.n_heads // attention.n_kv_heads
        mlp = layer.mlp
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def _keep_rows(projection: nn.Module, start: int, count: int, heads: int) -> None:
    """Keep output rows ``start .. start + count`` of a (possibly quantized) linear layer."""
    rows = projection.weight.shape[0]
    if rows % heads:
        raise UnsupportedModelError(f"a KV projection of {rows} rows does not hold {heads} heads")
    for name in ("weight", "scales", "biases", "bias"):
        value = getattr(projection, name, None)
        if isinstance(value, mx.array):
            setattr(projection, name, mx.contiguous(value[start : start + count]))
