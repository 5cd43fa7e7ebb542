"""An engine assembled: its model, pool and config checked and turned into the parts a step uses.

:func:`assemble` does every check that can refuse a model (the layouts agree, the vocabulary
is known, a decode path serves each layer: one probe step through the pool), changes the model
where the config asks (attention wrappers, fast MLPs, ragged-state mixers, and the caller's
own :class:`~kv_batching._model_surgery.ModelChange` list first), all through one
:class:`~kv_batching._model_surgery.ModelSurgery`, and builds the
:class:`~kv_batching._engine_core.EngineCore` and the phases that act through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.nn as nn

from kv_protocol import (
    EVALUATION_CLOCK,
    CacheLayout,
    KernelSet,
    KVPool,
    KVPrefixCache,
    LayoutError,
    RequestStateError,
    UnsupportedModelError,
    layout_from_model,
)

from ._agreement import RankAgreement
from ._cache_nesting import CacheNesting
from ._decode_paths import DecodePlan, choose_decode_paths
from ._decode_phase import DecodePhase
from ._decode_step import PoolAddressing
from ._engine_config import EngineConfig
from ._engine_core import EngineCore, PrefillCacheFactory
from ._engine_stats import EngineStats
from ._fast_mlp import FastMLPs
from ._model_forward import decode_forward, last_position_forward, vocabulary_size
from ._model_runner import ModelRunner
from ._model_surgery import ModelChange, ModelSurgery
from ._outputs import StepOutputs
from ._prefill_budget import PrefillBudget
from ._prefill_phase import PrefillPhase
from ._ragged_state import RaggedStateMixers
from ._requests import RequestTable
from ._sampling import Sampler
from ._scheduler import Scheduler
from ._snapshot_policy import SnapshotPolicy
from ._state_cache import StateCacheFactory, model_state_caches, request_state_bytes
from ._verification import Verifier

__all__ = ["EngineParts", "assemble"]


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    """What :func:`assemble` built: the core, the two phases and what the engine reports."""

    core: EngineCore
    decode_phase: DecodePhase
    prefill_phase: PrefillPhase
    snapshots: SnapshotPolicy | None
    decode_plan: DecodePlan
    vocab_size: int
    #: The prefill forward that projects only the last position (``None``: the whole model).
    prefill_forward: object | None


def _check_layouts(model_layout: CacheLayout, pool_layout: CacheLayout) -> None:
    if model_layout.num_layers != pool_layout.num_layers:
        raise LayoutError(
            f"the pool was built for {pool_layout.num_layers} layers but the model has "
            f"{model_layout.num_layers}"
        )
    for mine, theirs in zip(model_layout.specs, pool_layout.specs, strict=True):
        same = (
            mine.kind is theirs.kind
            and mine.window == theirs.window
            and mine.n_kv_heads == theirs.n_kv_heads
            and mine.head_dim == theirs.head_dim
        )
        if not same:
            raise LayoutError(
                f"layer {mine.layer_id}: the model has {mine.kind.value} window={mine.window} "
                f"{mine.n_kv_heads}x{mine.head_dim} but the pool's layout has "
                f"{theirs.kind.value} window={theirs.window} {theirs.n_kv_heads}x{theirs.head_dim}"
            )


def _choose_prefix_cache(pool: KVPool, wanted: bool | None) -> KVPrefixCache | None:
    """The pool's prefix cache if it has one and the model can use it."""
    cache = pool.prefix_cache
    if wanted is False or (wanted is None and cache is None):
        return None
    if cache is None:
        raise UnsupportedModelError(
            "prefix_caching=True needs a pool built with prefix caching on (a pool whose "
            "prefix_cache is not None)"
        )
    return cache


def assemble(
    model: nn.Module,
    pool: KVPool,
    kernels: KernelSet,
    make_prefill_cache: PrefillCacheFactory,
    config: EngineConfig,
    *,
    make_state_caches: StateCacheFactory | None,
    agreement: RankAgreement | None,
    changes: Sequence[ModelChange] = (),
) -> EngineParts:
    """Check ``model`` against ``pool`` and ``config`` and build the engine's parts.

    Raises what :class:`~kv_batching.DecodeEngine` documents (``LayoutError``,
    ``UnsupportedModelError``, ``RequestStateError``) before the model is changed where a
    check allows it; the decode paths' probe itself runs on the changed model. ``changes``
    are installed before the engine's own; a refusal after any change undoes them all.
    """
    speculation = config.speculation
    if speculation is not None and agreement is not None:
        raise RequestStateError(
            "speculative decoding does not run on tensor-parallel ranks (speculation= "
            "and agreement= together); serve with one of them"
        )
    prefill_budget = PrefillBudget(config.prefill_chunk, prefill_stall=config.prefill_stall)
    model_layout = layout_from_model(model)
    _check_layouts(model_layout, pool.layout)
    nesting = CacheNesting.from_model(model)
    state_layer_ids = tuple(model_layout.state_layer_ids)
    # Checked before anything is built (the decode paths patch the model).
    prefix_cache = _choose_prefix_cache(pool, config.prefix_caching)
    snapshots = SnapshotPolicy.choose(
        prefix_cache,
        bool(state_layer_ids),
        config.state_snapshot_interval,
        config.state_cache_bytes,
    )
    step_snapshots = config.step_snapshots and bool(state_layer_ids)
    if state_layer_ids and make_state_caches is None:
        make_state_caches = model_state_caches(model, model_layout)
    table_rows = vocabulary_size(model)
    vocab_size = config.vocab_size
    if vocab_size is None:
        if table_rows is None:
            raise UnsupportedModelError(
                f"cannot tell the vocabulary size of {type(model).__name__} (no embedding "
                "table, no args.vocab_size): pass vocab_size= to DecodeEngine"
            )
        vocab_size = table_rows
    if table_rows is not None and vocab_size > table_rows:
        raise UnsupportedModelError(
            f"vocab_size={vocab_size} is larger than the model's embedding table "
            f"({table_rows} rows)"
        )
    #: A large quantized head projected natively on the CPU (``kernels.quantized_head``).
    quantized_head = getattr(kernels, "quantized_head", None)
    prefill_forward = (
        last_position_forward(model, vocab_size, quantized_head)
        if config.prefill_last_logits
        else None
    )
    head_decode_forward = decode_forward(model, vocab_size, quantized_head)
    surgery = ModelSurgery(model)
    try:
        for change in changes:
            surgery.install(change)
        decode_plan = choose_decode_paths(
            model,
            pool,
            kernels,
            make_prefill_cache,
            config.decode_path,
            vocab_size=vocab_size,
            num_layers=model_layout.num_layers,
            state_caches=make_state_caches,
            state_layer_ids=state_layer_ids,
            nesting=nesting,
            prefill_forward=prefill_forward,
            decode_forward=head_decode_forward,
            surgery=surgery,
        )
    except BaseException:
        surgery.undo()
        raise
    stats = EngineStats(window=config.stats_window)
    runner = ModelRunner(
        model,
        pool,
        kernels,
        addressing=PoolAddressing.from_pool(pool, decode_plan.routes),
        state_layer_ids=state_layer_ids,
        nesting=nesting,
        prefill_forward=prefill_forward,
        decode_forward=head_decode_forward,
        surgery=surgery,
    )
    if config.fast_activations:
        # Outside the runner's forwards a swapped MLP is the model's own call.
        surgery.install(FastMLPs(kernel=getattr(kernels, "gated_activation", None)))
    EVALUATION_CLOCK.take()  # the construction probes' evaluations
    if speculation is not None and state_layer_ids and make_state_caches is not None:
        # Proposals verify inside the shared step when every recurrent mixer runs a
        # request's rows in order (else each verification is a forward of its own).
        surgery.install(
            RaggedStateMixers(nesting, model_layout.num_layers, state_layer_ids, make_state_caches)
        )
    scheduler = Scheduler(
        pool,
        stats,
        max_running=config.max_running,
        state_budget_bytes=config.state_budget_bytes,
    )
    if state_layer_ids:
        # Known before the first admission, so a state budget holds from the start.
        scheduler.state_bytes_per_request = request_state_bytes(model, model_layout)
    scheduler.state_copies = 1 + int(snapshots is not None) + int(step_snapshots)
    if snapshots is not None and prefix_cache is not None:
        # A snapshot is kept no longer than the pool keeps the page ending at it.
        prefix_cache.add_eviction_listener(snapshots.cache.forget_block)
        scheduler.on_leave = snapshots.keep_pending
    core = EngineCore(
        pool=pool,
        scheduler=scheduler,
        runner=runner,
        sampler=Sampler(config.seed, agree=None if agreement is None else agreement.tokens),
        stats=stats,
        requests=RequestTable(),
        make_prefill_cache=make_prefill_cache,
        make_state_caches=make_state_caches,
        num_layers=model_layout.num_layers,
        state_layer_ids=state_layer_ids,
        prefix_cache=prefix_cache,
        head_clock=EVALUATION_CLOCK,
    )
    outputs = StepOutputs(core, speculation=speculation, snapshots=snapshots)
    verifier = (
        None
        if speculation is None
        else Verifier(
            core,
            outputs,
            speculation,
            snapshots=snapshots,
            step_snapshots=step_snapshots,
        )
    )
    decode_phase = DecodePhase(core, outputs, verifier=verifier, step_snapshots=step_snapshots)
    prefill_phase = PrefillPhase(
        core,
        outputs,
        budget=prefill_budget,
        agreement=agreement,
        snapshots=snapshots,
        # Prompt positions one chunk computes full-vocabulary logits for (prompt
        # logprobs): about 64 MiB of float32 logits.
        logit_rows=max(1, 2**24 // vocab_size),
    )

    return EngineParts(
        core=core,
        decode_phase=decode_phase,
        prefill_phase=prefill_phase,
        snapshots=snapshots,
        decode_plan=decode_plan,
        vocab_size=vocab_size,
        prefill_forward=prefill_forward,
    )
