"""Which decode route each attention layer takes, and the build-time check that they work.

The patched fast path serves an attention module that the wrapper's probe reproduces exactly:
route ``fused`` where the kernels' fused RoPE + scatter can address the layer (a FULL layer on
plain pages whose RoPE the kernel implements), ``unfused`` otherwise. Every other attention
layer takes the ``universal`` route (a pool-backed cache handed to the unmodified module).
:func:`check_batched_decode` then runs one ragged batched decode step through the pool and
compares it with prefilling the same tokens, so a model that no route serves is refused when
the engine is built, with the reason, never at decode time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    CacheLayout,
    KernelSet,
    KVPool,
    LayerKind,
    PoolExhaustedError,
    UnsupportedModelError,
    find_layers,
)

from ._cache_nesting import CacheNesting
from ._decode_step import DecodeRoute, PoolAddressing
from ._model_forward import DecodeForward, LastPositionForward
from ._model_runner import ModelRunner
from ._model_surgery import ModelSurgery
from ._patching import AttentionWrappers, wrap_attention_layer, wrapped_attention
from ._state_cache import StateCacheFactory, request_caches

__all__ = [
    "DecodePathChoice",
    "DecodePlan",
    "check_batched_decode",
    "choose_decode_paths",
    "fuse_routes",
    "plan_decode_paths",
]

logger = logging.getLogger("kv_batching")

#: What the engine is asked for: per-layer choice, or every layer on one path.
DecodePathChoice = Literal["auto", "fast", "universal"]
_CHOICES = ("auto", "fast", "universal")
#: Request ids of the build-time check, far above any id the engine hands out.
_PROBE_IDS = (1 << 62, (1 << 62) + 1)
#: Prompt lengths of the build-time check: ragged, so padding and masks are exercised.
_PROBE_LENGTHS = (3, 6)


@dataclass(frozen=True, kw_only=True)
class DecodePlan:
    """The decode route of every attention layer, and why a layer is not on the fast path.

    ``paths`` says the same per layer in two words: ``fast`` (``fused`` or ``unfused``: the
    wrapped module) or ``universal``.
    """

    routes: Mapping[int, DecodeRoute]
    reasons: Mapping[int, str] = field(default_factory=dict)

    @property
    def paths(self) -> Mapping[int, str]:
        """Attention layer id -> ``"fast"`` (wrapped module) or ``"universal"``."""
        return MappingProxyType(
            {i: "universal" if r == "universal" else "fast" for i, r in self.routes.items()}
        )

    @property
    def universal_layers(self) -> frozenset[int]:
        """Attention layers on the universal route."""
        return frozenset(i for i, route in self.routes.items() if route == "universal")

    @property
    def fast_layers(self) -> frozenset[int]:
        """Attention layers whose module is wrapped (routes ``fused`` and ``unfused``)."""
        return frozenset(i for i, route in self.routes.items() if route != "universal")

    @property
    def fused_layers(self) -> frozenset[int]:
        """Attention layers whose RoPE and K/V write go through the fused kernel."""
        return frozenset(i for i, route in self.routes.items() if route == "fused")

    def describe(self) -> str:
        """One line: how many layers take each route (and the first reason, if any)."""
        fused, fast = len(self.fused_layers), len(self.fast_layers)
        line = (
            f"decode paths: {fast} fast (patched; {fused} with fused RoPE), "
            f"{len(self.universal_layers)} universal"
        )
        if self.reasons:
            layer_id, reason = next(iter(sorted(self.reasons.items())))
            line += f"; e.g. layer {layer_id}: {reason}"
        return line


def plan_decode_paths(
    model: nn.Module,
    layout: CacheLayout,
    decode_path: str = "auto",
    *,
    nesting: CacheNesting | None = None,
) -> DecodePlan:
    """Choose each attention layer's decode path; nothing on the model changes.

    ``auto``: the fast path where the wrapper's probe accepts the module, the universal path
    otherwise (the probe's refusal is the reason). ``universal``: every layer universal.
    ``fast``: every layer fast, or the probe's ``UnsupportedModelError``. A model whose
    caches are not one per decoder layer (``nesting``, read from the model by default) takes
    the universal path on every layer (``fast`` refuses it).
    """
    if decode_path not in _CHOICES:
        raise UnsupportedModelError(
            f"decode_path must be one of {', '.join(_CHOICES)}, got {decode_path!r}"
        )
    if nesting is None:
        nesting = CacheNesting.from_model(model)
    if not nesting.by_layer:
        if decode_path == "fast":
            raise UnsupportedModelError(nesting.describe())
        ids = [i for i in layout.attention_layer_ids]
        return DecodePlan(
            routes=MappingProxyType(dict.fromkeys(ids, "universal")),
            reasons=MappingProxyType(dict.fromkeys(ids, nesting.describe())),
        )
    layers = find_layers(model)
    paths: dict[int, DecodeRoute] = {}
    reasons: dict[int, str] = {}
    for layer_id in layout.attention_layer_ids:
        if layout.kind(layer_id) is LayerKind.STATE:
            continue
        if decode_path == "universal":
            paths[layer_id] = "universal"
            reasons[layer_id] = "decode_path='universal' was asked for"
            continue
        try:
            wrap_attention_layer(layers[layer_id], layer_id, layout)
        except UnsupportedModelError as refusal:
            if decode_path == "fast":
                raise
            paths[layer_id] = "universal"
            reasons[layer_id] = str(refusal)
        else:
            paths[layer_id] = "unfused"
    return DecodePlan(routes=MappingProxyType(paths), reasons=MappingProxyType(reasons))


def fuse_routes(model: nn.Module, pool: KVPool, kernels: KernelSet, plan: DecodePlan) -> DecodePlan:
    """``plan`` with each wrapped FULL layer the fused RoPE + scatter kernel serves on ``fused``.

    The kernel writes plain pages at the layer's full-pool index, in the RoPE variant it
    implements: a layer on quantized pages (only the pool's ``set_kv`` writes those) or with
    a RoPE the kernel does not compute stays ``unfused``; the quantized ones are logged once.
    """
    rope = kernels.rope
    if rope is None:
        return plan
    full = pool.layout.full_attention_layer_id_mapping
    specs = {w.spec.layer_id: w.spec for w in wrapped_attention(model)}
    routes = dict(plan.routes)
    quantized: list[int] = []
    for layer_id, route in plan.routes.items():
        if route != "unfused" or layer_id not in full or layer_id not in specs:
            continue
        if pool.kv_quantization(layer_id) is not None:
            quantized.append(layer_id)
            continue
        config = specs[layer_id].rope_config
        if config is not None and rope.supports(config):
            routes[layer_id] = "fused"
    if quantized:
        logger.info(
            "fused RoPE + scatter kernel %r not used for layers %s: their pages are "
            "quantized, which only the pool's set_kv writes",
            rope.name,
            quantized,
        )
    return DecodePlan(routes=MappingProxyType(routes), reasons=plan.reasons)


def _tolerance(dtype: mx.Dtype, quantized: bool = False) -> float:
    """How far the probe's batched logits may be from prefill's.

    Quantized pages round each K/V value to a step of its group's range, so a last-bit
    difference between the batched and the prefill projection can move a value by a whole
    step: such pools get the tolerance of low-precision dtypes. So do GPUs, whose float32
    matrix products may round through TF32 (measured on an H200: 1.07e-3 on a tiny Gemma 3).
    """
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    return 1e-3 if dtype == mx.float32 and not quantized and on_cpu else 5e-2


def check_batched_decode(
    model: nn.Module,
    pool: KVPool,
    kernels: KernelSet,
    make_prefill_cache: Any,
    plan: DecodePlan,
    *,
    vocab_size: int,
    num_layers: int,
    state_caches: StateCacheFactory | None = None,
    state_layer_ids: tuple[int, ...] = (),
    nesting: CacheNesting | None = None,
    prefill_forward: LastPositionForward | None = None,
    decode_forward: DecodeForward | None = None,
    surgery: ModelSurgery | None = None,
) -> str | None:
    """Why one ragged batched decode step differs from prefill, or ``None`` if it agrees.

    ``surgery`` holds the model's changes, engaged around the check's forwards as the
    engine's runner engages them.

    Two short prompts are prefilled through ``make_prefill_cache`` into ``pool``, their next
    tokens decoded together through ``plan``'s caches, and each row's logits compared with
    prefilling the prompt and that token alone. Every probe request is freed afterwards,
    whatever happens. Returns ``None`` (and logs a warning) when the pool cannot hold the
    probe, which is tiny. STATE layers (``state_layer_ids``) get fresh caches from
    ``state_caches`` per prefill and the rows' states stacked for the batched step. Both
    sides project through the engine's ``prefill_forward`` / ``decode_forward`` heads when
    given (each checked against the model's own head by its own probe): a quantized head's
    own CPU product would make this check take seconds.
    """
    runner = ModelRunner(
        model,
        pool,
        kernels,
        addressing=PoolAddressing.from_pool(pool, plan.routes),
        state_layer_ids=state_layer_ids,
        nesting=nesting,
        prefill_forward=prefill_forward,
        decode_forward=decode_forward,
        surgery=surgery,
    )
    prompts = [[(11 * i + 5 * n + 1) % vocab_size for i in range(n)] for n in _PROBE_LENGTHS]
    nexts = [(7 * n + 2) % vocab_size for n in _PROBE_LENGTHS]
    added: list[int] = []

    states: dict[int, list[Any]] = {}

    def prefill(rid: int, tokens: list[int]) -> mx.array:
        pool.add_request(rid)
        added.append(rid)
        own = states[rid] = state_caches() if state_caches is not None else []
        reservation = pool.reserve(rid, len(tokens))
        caches = request_caches(
            num_layers,
            state_layer_ids,
            own,
            lambda layer_id: make_prefill_cache(pool, reservation, layer_id),
        )
        logits = runner.prefill(tokens, caches)[:, -1, :]
        mx.eval(logits)
        return logits

    try:
        for rid, prompt in zip(_PROBE_IDS, prompts, strict=True):
            prefill(rid, prompt)
        step = pool.try_reserve_batch(dict.fromkeys(_PROBE_IDS, 1))
        if step is None:
            logger.warning("the pool is too small for the build-time decode check; skipped")
            return None
        batched = runner.decode(step, nexts, [states[rid] for rid in _PROBE_IDS]).logits
        mx.eval(batched)
        for rid in list(added):
            pool.free_request(rid)
            added.remove(rid)
        worst = 0.0
        for row, (rid, prompt, token) in enumerate(zip(_PROBE_IDS, prompts, nexts, strict=True)):
            alone = prefill(rid, [*prompt, token])
            pool.free_request(rid)
            added.remove(rid)
            reference = alone[0].astype(mx.float32)
            mine = batched[row].astype(mx.float32)
            scale = float(mx.max(mx.abs(reference))) + 1e-6
            worst = max(worst, float(mx.max(mx.abs(mine - reference))) / scale)
        quantized = any(
            pool.kv_quantization(layer_id) is not None
            for layer_id in pool.layout.attention_layer_ids
        )
        tolerance = _tolerance(batched.dtype, quantized)
    except Exception as error:
        if isinstance(error, PoolExhaustedError) or isinstance(error.__cause__, PoolExhaustedError):
            logger.warning("the pool is too small for the build-time decode check; skipped")
            return None
        # Whatever else the model did, it is refused with the reason.
        return f"a batched decode step raised {error!r}"
    finally:
        for rid in added:
            pool.free_request(rid)
    if worst > tolerance:
        return (
            f"a batched decode step's logits differ from prefilling the same tokens by "
            f"{worst:.2e} (relative; tolerance {tolerance:.0e})"
        )
    return None


def choose_decode_paths(
    model: nn.Module,
    pool: KVPool,
    kernels: KernelSet,
    make_prefill_cache: Any,
    decode_path: str,
    *,
    vocab_size: int,
    num_layers: int,
    state_caches: StateCacheFactory | None = None,
    state_layer_ids: tuple[int, ...] = (),
    nesting: CacheNesting | None = None,
    prefill_forward: LastPositionForward | None = None,
    decode_forward: DecodeForward | None = None,
    surgery: ModelSurgery | None = None,
) -> DecodePlan:
    """Choose the layers' decode paths, wrap the fast ones and check one batched step.

    This **modifies the model**: the fast layers' attention modules are wrapped in place,
    installed as an :class:`~kv_batching._patching.AttentionWrappers` change through
    ``surgery`` (a new one on ``model`` by default), which puts them back.

    Under ``auto``, a model whose check fails with some layers on the fast path is tried
    again with every layer universal. A model neither path serves is unpatched and refused
    with ``UnsupportedModelError`` and the reason.
    """
    plan = plan_decode_paths(model, pool.layout, decode_path, nesting=nesting)
    surgery = surgery if surgery is not None else ModelSurgery(model)
    prefill_attention = getattr(kernels, "prefill_attention", None)
    surgery.install(
        AttentionWrappers(pool.layout, layers=plan.fast_layers, prefill_attention=prefill_attention)
    )
    plan = fuse_routes(model, pool, kernels, plan)
    problem = check_batched_decode(
        model,
        pool,
        kernels,
        make_prefill_cache,
        plan,
        vocab_size=vocab_size,
        num_layers=num_layers,
        state_caches=state_caches,
        state_layer_ids=state_layer_ids,
        nesting=nesting,
        prefill_forward=prefill_forward,
        decode_forward=decode_forward,
        surgery=surgery,
    )
    if problem is not None and decode_path == "auto" and plan.fast_layers:
        surgery.uninstall(AttentionWrappers)
        fallback = plan_decode_paths(model, pool.layout, "universal", nesting=nesting)
        retry = check_batched_decode(
            model,
            pool,
            kernels,
            make_prefill_cache,
            fallback,
            vocab_size=vocab_size,
            num_layers=num_layers,
            state_caches=state_caches,
            state_layer_ids=state_layer_ids,
            nesting=nesting,
            prefill_forward=prefill_forward,
            decode_forward=decode_forward,
            surgery=surgery,
        )
        if retry is None:
            logger.warning(
                "%s: the patched fast path failed the build-time check (%s); every layer "
                "takes the universal path",
                type(model).__name__,
                problem,
            )
            reason = f"the fast path failed the build-time check: {problem}"
            return DecodePlan(
                routes=fallback.routes, reasons=dict.fromkeys(fallback.routes, reason)
            )
        problem = retry
    if problem is not None:
        surgery.uninstall(AttentionWrappers)
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be served by batched decode: {problem} "
            f"({plan.describe()}); its attention must call cache.update_and_fetch and build "
            "its mask with cache.make_mask, as mlx-lm's caches expect"
        )
    return plan
