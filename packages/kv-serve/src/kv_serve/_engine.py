"""``build_engine``: the one place where layout, pool, kernels and prefill caches are wired."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, overload

import mlx.core as mx
import mlx.nn as nn

from kv_batching import DecodeEngine, EngineConfig, NgramProposer, SpeculationConfig
from kv_caches import PoolBackedKVCache
from kv_metal_kernels import CpuSlotWriter, rope_config_from_module, select_kernels
from kv_pool import HybridKVPool, required_bytes
from kv_protocol import (
    CacheLayout,
    KernelSet,
    KVCache,
    KVPool,
    RequestStateError,
    Reservation,
    SlotWriter,
    UnsupportedModelError,
    attention_module,
    check_int,
    find_layers,
    kv_quantization_choice,
    layout_from_model,
)

from ._config import PoolConfig, split_settings
from ._lockstep import LockstepEngine
from ._native_norms import NativeNorms
from ._ranks import STARTUP_TIMEOUT, RankGroup
from ._sizes import DEFAULT_KV_SLAB_BYTES, NGRAM_SPECULATIVE_TOKENS

__all__ = [
    "DEFAULT_KV_SLAB_BYTES",
    "build_engine",
    "build_kernels",
    "build_pool",
    "pool_backed_cache",
]


def pool_backed_cache(pool: KVPool, reservation: Reservation, layer_id: int) -> KVCache:
    """The prefill cache factory of every engine built here: K/V go straight into the pool.

    One layer's cache for one prefill chunk: it writes the chunk at the slots ``reservation``
    holds for its one request.
    """
    (request_id,) = reservation.request_ids
    return PoolBackedKVCache(pool, request_id, layer_id, reservation=reservation)


def build_kernels(model: nn.Module, layout: CacheLayout, *, fused_rope: str = "off") -> KernelSet:
    """Kernels for ``model``: RoPE described from a full layer's (else any attention layer's)."""
    layers = find_layers(model)
    ids = layout.full_layer_ids or layout.attention_layer_ids
    rope = getattr(attention_module(layers[ids[0]]), "rope", None) if ids else None
    config, why = rope_config_from_module(rope) if rope is not None else (None, "no rope module")
    return select_kernels(config, fused_rope=fused_rope, rope_unsupported_reason=why)


def build_pool(
    layout: CacheLayout,
    *,
    kv_budget_bytes: int | None = None,
    num_pages: int | None = None,
    page_size: int = 16,
    max_running: int = 16,
    max_context: int = 4096,
    prefill_chunk: int = 512,
    prefix_caching: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    kv_quantize: str = "all",
    kv_slab_bytes: int | None = DEFAULT_KV_SLAB_BYTES,
) -> HybridKVPool:
    """A pool from a byte budget, from a page count, or sized for ``max_running`` x context.

    Without ``kv_budget_bytes`` and ``num_pages`` the pool holds exactly what ``max_running``
    requests of ``max_context`` tokens need at their peak (``kv_pool.required_bytes``).
    ``prefix_caching`` keeps complete pages for reuse by later requests with the same prefix.
    ``kv_bits`` (8 or 4) stores pages quantized in groups of ``kv_group_size`` along
    ``head_dim``, for the layer kinds ``kv_quantize`` names (``all``, ``full``,
    ``sliding``); a budget then holds about 1.9x (8-bit) or 3.5x (4-bit) the tokens.

    The budget (or page count) is a cap: the buffers start at one slab of about
    ``kv_slab_bytes`` per sub-pool and grow by slabs as pages are first needed (pages never
    move; admission is still decided on the cap), and ``shrink()`` gives them back when idle.
    ``kv_slab_bytes=None`` allocates the whole cap up front.
    """
    if kv_budget_bytes is not None and num_pages is not None:
        raise RequestStateError("give kv_budget_bytes or num_pages, not both")
    if kv_slab_bytes is not None:
        kv_slab_bytes = check_int(kv_slab_bytes, "kv_slab_bytes", minimum=1)
    quantization = kv_quantization_choice(kv_bits, kv_group_size, kv_quantize)
    page_size = check_int(page_size, "page_size", minimum=1)
    max_running = check_int(max_running, "max_running", minimum=1)
    max_context = check_int(max_context, "max_context", minimum=1)
    prefill_chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
    if not layout.attention_layer_ids:
        # A pure recurrent model: no pages to size; prefixes (for state snapshots) end every
        # ``page_size`` tokens.
        return HybridKVPool(
            layout,
            num_pages={},
            page_size=page_size,
            prefix_caching=prefix_caching,
            slot_writer=_slot_writer(),
        )
    if num_pages is not None:
        pages = check_int(num_pages, "num_pages", minimum=2)
        return HybridKVPool(
            layout,
            num_pages=pages,
            page_size=page_size,
            prefix_caching=prefix_caching,
            kv_quantization=quantization,
            slab_bytes=kv_slab_bytes,
            slot_writer=_slot_writer(),
        )
    if kv_budget_bytes is None:
        budget = required_bytes(
            layout,
            max_context=max_context,
            concurrency=max_running,
            page_size=page_size,
            prefill_chunk=prefill_chunk,
            kv_quantization=quantization,
        )
    else:
        budget = check_int(kv_budget_bytes, "kv_budget_bytes", minimum=1)
    return HybridKVPool.from_budget(
        layout,
        budget,
        max_context=max_context,
        concurrency=max_running,
        page_size=page_size,
        prefill_chunk=prefill_chunk,
        prefix_caching=prefix_caching,
        kv_quantization=quantization,
        slab_bytes=kv_slab_bytes,
        slot_writer=_slot_writer(),
    )


def _slot_writer() -> SlotWriter | None:
    """kv-metal-kernels' ``CpuSlotWriter`` on MLX's CPU device where it works, else ``None``."""
    if mx.default_device().type != mx.cpu:
        return None
    writer = CpuSlotWriter()
    return writer if writer.available else None


@overload
def build_engine(
    model: nn.Module,
    config: EngineConfig | None = None,
    *,
    pool_config: PoolConfig | None = None,
    pool: KVPool | None = None,
    speculative: str | SpeculationConfig | None = None,
    num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS,
    ranks: None = None,
    **settings: Any,
) -> DecodeEngine: ...


@overload
def build_engine(
    model: nn.Module,
    config: EngineConfig | None = None,
    *,
    pool_config: PoolConfig | None = None,
    pool: KVPool | None = None,
    speculative: str | SpeculationConfig | None = None,
    num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS,
    ranks: RankGroup,
    **settings: Any,
) -> LockstepEngine: ...


def build_engine(
    model: nn.Module,
    config: EngineConfig | None = None,
    *,
    pool_config: PoolConfig | None = None,
    pool: KVPool | None = None,
    speculative: str | SpeculationConfig | None = None,
    num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS,
    ranks: RankGroup | None = None,
    **settings: Any,
) -> DecodeEngine | LockstepEngine:
    """A ``DecodeEngine`` serving ``model`` on a ``HybridKVPool`` with the selected kernels.

    The engine's settings are ``config`` (a :class:`kv_batching.EngineConfig`), the pool's
    ``pool_config`` (a :class:`PoolConfig`); any field of either may also be given by keyword
    (``max_running=4``, ``page_size=8``), replacing the config's. ``prefix_caching`` is on
    unless it is ``False``.

    The pool comes from :func:`build_pool` (a byte budget, a page count, or sized for
    ``max_running`` requests of ``max_context`` tokens), RoPE is fused only when
    ``fused_rope`` asks for it and the model's RoPE allows it, and prompts are prefilled in
    chunks of ``prefill_chunk`` tokens through :class:`kv_caches.PoolBackedKVCache`, so the
    K/V land in the pool with no second copy. A ready ``pool`` (any ``KVPool`` built for
    the model's layout) replaces the sizing arguments. ``decode_path`` (``auto``,
    ``universal`` or ``fast``) picks each attention layer's decode path (see
    :class:`kv_batching.DecodeEngine`; ``engine.decode_plan`` reports each layer's route).

    ``kv_budget_bytes`` bounds the KV pool (a cap: its buffers grow by slabs of about
    ``kv_slab_bytes`` as pages are first needed and ``engine.shrink_pool()`` cuts them back;
    ``kv_slab_bytes=None`` allocates the cap up front); a model with recurrent STATE layers
    also keeps one state per running request beside it (``engine.memory_report()`` shows
    both), which ``state_budget_bytes`` caps at admission. Building the engine wraps the attention
    modules it serves on the fast path in place; ``engine.close()`` puts them back.

    ``prefix_caching`` (on by default) keeps the complete pages of finished and running
    requests, sliding-window ones included, so a request whose prompt starts with a cached
    prefix prefills only the rest. On a model with recurrent STATE layers it also snapshots
    each request's state every ``state_snapshot_interval`` tokens (a multiple of the page
    size; default the largest such multiple up to 256), at the last page boundary of each
    prompt and when a request leaves the pool, keeping the snapshots under the prefix's
    page hash within ``state_cache_bytes`` (default
    :data:`kv_batching.DEFAULT_STATE_CACHE_BYTES`, least recently used out first): a prefix
    is reused there up to the longest boundary with both its pages and a snapshot.
    ``prefix_caching=False`` turns it all off. ``step_snapshots`` keeps each running
    request's state before its last decode step, so ``engine.restore(id, length - 1)`` can
    undo that step.

    ``prefill_stall`` bounds a step's prefill while requests decode, as a multiple of the
    step's decode time (e.g. ``2.0``: a running request's next token waits at most about
    three decode steps for a prompt being prefilled beside it); ``None`` prefills
    ``prefill_chunk`` tokens a step whatever decodes.

    ``kv_bits`` (8 or 4; ``None``: the model's dtype) stores the pool's pages quantized in
    groups of ``kv_group_size`` (32, 64 or 128) along ``head_dim``, sliding-window layers
    included, for the layer kinds ``kv_quantize`` names (``all``, ``full`` or ``sliding``).
    Decode and prefill read them dequantized; the fused RoPE kernel is not used on them.

    ``speculative="ngram"`` turns on speculative decoding with prompt lookup
    (:class:`kv_batching.NgramProposer`), proposals of up to ``num_speculative_tokens``
    (1 .. 16, 8 by default: a prompt-lookup proposal costs nothing to make, and each
    request's length adapts down to what is accepted) tokens; a
    :class:`kv_batching.SpeculationConfig` sets every part of it. Greedy requests then emit
    up to that many tokens more per step, the same tokens as without it.

    ``ranks`` (this process's :class:`RankGroup`, from :func:`init_ranks`; the model already
    sharded by :func:`shard_model`) builds one rank's :class:`LockstepEngine` of a
    tensor-parallel group: the ranks first check that they were given the same layout and
    settings and agree on the pool's page count (``all_min``), then run in lock step.
    Speculative decoding is refused with it.

    ``fast_activations`` (on MLX's CPU) computes the wide SiLU / tanh-GELU gated MLPs'
    activation from vectorised arithmetic in the engine's forwards (see
    :class:`kv_batching.DecodeEngine`); ``False`` keeps mlx-lm's own operations.
    """
    _, pool_settings, engine_settings = split_settings(settings)
    engine = EngineConfig.from_settings(config, engine_settings)
    sizes = dataclasses.replace(pool_config or PoolConfig(), **pool_settings)
    if engine.speculation is not None and speculative is not None:
        raise RequestStateError("give speculative= or a config's speculation, not both")
    speculation = engine.speculation or speculation_config(speculative, num_speculative_tokens)
    layout = layout_from_model(model)
    use_prefix = engine.prefix_caching is not False
    if pool is None:
        pool = build_pool(
            layout,
            kv_budget_bytes=sizes.kv_budget_bytes,
            num_pages=sizes.num_pages,
            page_size=sizes.page_size,
            max_running=engine.max_running,
            max_context=sizes.max_context,
            prefill_chunk=engine.prefill_chunk,
            prefix_caching=use_prefix,
            kv_bits=sizes.kv_bits,
            kv_group_size=sizes.kv_group_size,
            kv_quantize=sizes.kv_quantize,
            kv_slab_bytes=sizes.kv_slab_bytes,
        )
    elif sizes.kv_budget_bytes is not None or sizes.num_pages is not None:
        raise RequestStateError("give a pool or kv_budget_bytes / num_pages, not both")
    elif sizes.kv_bits is not None:
        raise RequestStateError("give a pool or kv_bits, not both (build the pool quantized)")
    kernels = build_kernels(model, layout, fused_rope=sizes.fused_rope)
    if ranks is not None:
        if speculation is not None:
            raise RequestStateError(
                "speculative decoding does not run on tensor-parallel ranks: serve without "
                "--speculative / --draft-model, or on one rank"
            )
        agreed: tuple[object, ...] = (engine.max_running, engine.prefill_chunk, engine.seed)
        agreed += (engine.decode_path, use_prefix, engine.prefill_stall)
        agreed += (engine.state_budget_bytes, engine.state_snapshot_interval)
        agreed += (engine.state_cache_bytes,)
        pool = _agree_on_pool(
            ranks,
            layout,
            pool,
            repr(agreed),
            sizes.kv_bits,
            sizes.kv_group_size,
            sizes.kv_quantize,
        )
    # The pool was built with a prefix cache unless told False: the engine uses it if present.
    final = dataclasses.replace(
        engine, prefix_caching=None if use_prefix else False, speculation=speculation
    )
    built = DecodeEngine(
        model, pool, kernels, pool_backed_cache, final, agreement=ranks, changes=[NativeNorms()]
    )
    return built if ranks is None else LockstepEngine(built, ranks)


def _agree_on_pool(
    ranks: RankGroup,
    layout: CacheLayout,
    pool: KVPool,
    settings: str,
    kv_bits: int | None,
    kv_group_size: int,
    kv_quantize: str,
) -> KVPool:
    """The pool every rank of ``ranks`` can hold: the same page count on all (``all_min``).

    First every rank checks that the others serve the same layout with the same engine
    settings (ranks started with other arguments would never agree on a step).
    """
    report = pool.memory_report()
    described = repr((layout.specs, [(s.name, s.page_size) for s in report.sub_pools], settings))
    mine = zlib.crc32(described.encode())
    seen = ranks.all_gather(mine, "comparing the ranks' settings", seconds=STARTUP_TIMEOUT)
    if len(set(seen)) != 1:
        raise UnsupportedModelError(
            f"rank {ranks.rank}: the ranks were started with different models or engine "
            "settings (every rank must run the same command)"
        )
    pages = [s.num_pages for s in report.sub_pools]
    agreed = ranks.all_min(pages, "agreeing on the pool's page count")
    if agreed == pages:
        return pool
    if not isinstance(pool, HybridKVPool):
        raise UnsupportedModelError(
            f"rank {ranks.rank}: its pool holds {pages} pages and another rank's {agreed}; "
            "give every rank a pool of the same size"
        )
    return HybridKVPool(
        layout,
        num_pages={s.name: n for s, n in zip(report.sub_pools, agreed, strict=True)},
        page_size={s.name: s.page_size for s in report.sub_pools},
        prefix_caching=pool.prefix_cache is not None,
        kv_quantization=kv_quantization_choice(kv_bits, kv_group_size, kv_quantize),
        slab_pages=pool.slab_pages,
        slot_writer=pool.slot_writer,
    )


#: The proposers ``build_engine(speculative=...)`` and ``--speculative`` take by name.
SPECULATIVE_METHODS = ("ngram",)


def speculation_config(
    speculative: str | SpeculationConfig | None,
    num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS,
) -> SpeculationConfig | None:
    """The engine's speculation for ``build_engine``'s ``speculative`` argument."""
    if speculative is None or isinstance(speculative, SpeculationConfig):
        return speculative
    if speculative == "ngram":
        return SpeculationConfig(proposer=NgramProposer(), num_tokens=num_speculative_tokens)
    raise RequestStateError(
        f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, a SpeculationConfig or "
        f"None, got {speculative!r}"
    )
