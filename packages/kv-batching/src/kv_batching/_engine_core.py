"""What the phases of one engine's step share: its pool, scheduler, runner, sampler and stats.

A :class:`~kv_batching._engine.DecodeEngine` step runs two phases, each in a module of its
own: the decode phase (:mod:`._decode_phase`, with speculative verification in
:mod:`._verification`) and the prefill phase (:mod:`._prefill_phase`, with forks of one
prompt's sequences in :mod:`._forks`). Both end in the update phase (:mod:`._outputs`), which
commits what a request wrote, keeps its state snapshots (:mod:`._snapshot_policy`) and emits
its tokens. :class:`EngineCore` is the one object they all act through; nothing travels
between them in globals or in attributes stashed on caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kv_protocol import EvaluationClock, KVCache, KVPool, KVPrefixCache, Reservation

from ._constraints import collect_token_masks
from ._engine_stats import EngineStats
from ._model_runner import DecodeOutput, ModelRunner
from ._requests import EngineRequest, RequestTable
from ._sampling import Sampler, TokenMasks
from ._scheduler import Scheduler
from ._state_cache import StateCacheFactory, request_caches

__all__ = ["EngineCore", "PrefillCacheFactory", "kv_length", "written_state"]

logger = logging.getLogger(__name__)

#: ``make_prefill_cache(pool, reservation, layer_id)`` -> the cache of one layer for one
#: prefill chunk: ``reservation`` holds the chunk's request (alone), its start length and the
#: chunk's reserved slots; the cache writes the chunk's K/V there (see
#: ``kv_caches.PoolBackedKVCache``) and reads what attention needs.
PrefillCacheFactory = Callable[[KVPool, Reservation, int], KVCache]


@dataclass(kw_only=True, eq=False)
class EngineCore:
    """The parts of one engine that its step phases read and drive.

    ``pool`` holds the requests' K/V; ``scheduler`` decides who runs and reserves pool room;
    ``runner`` runs the model; ``sampler`` picks tokens; ``stats`` counts; ``requests`` keeps
    every request by id. ``make_prefill_cache`` builds a chunk's per-layer caches,
    ``make_state_caches`` a request's recurrent-state caches (``None`` without STATE
    layers). ``prefix_cache`` is the pool's prefix cache where the engine reuses prefixes.
    ``head_clock`` counts native kernels' evaluation inside a forward (device time).
    """

    pool: KVPool
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    stats: EngineStats
    requests: RequestTable
    make_prefill_cache: PrefillCacheFactory
    make_state_caches: StateCacheFactory | None
    num_layers: int
    state_layer_ids: tuple[int, ...]
    prefix_cache: KVPrefixCache | None
    head_clock: EvaluationClock

    def request_caches(self, states: Sequence[Any], reservation: Reservation) -> list[Any]:
        """One request's per-layer caches for a chunk on ``reservation``.

        Its own ``states`` on STATE layers, a prefill cache over the reservation elsewhere.
        """
        return request_caches(
            self.num_layers,
            self.state_layer_ids,
            states,
            lambda layer_id: self.make_prefill_cache(self.pool, reservation, layer_id),
        )

    def device_seconds(self, tic: float) -> float:
        """Seconds since ``tic`` plus the native kernels' evaluation inside the forward."""
        return time.perf_counter() - tic + self.head_clock.take()

    def commit(self, request: EngineRequest, length: int) -> None:
        """Tell the prefix cache the request's positions below ``length`` hold their K/V."""
        cache, hashes = self.prefix_cache, request.hashes
        if cache is None or hashes is None:
            return
        try:
            cache.commit(request.rid, hashes, length)
        except Exception as error:  # the cache only loses an entry; the request goes on
            logger.warning("prefix cache: commit for request %d failed: %r", request.rid, error)

    def token_masks(
        self, batch: Sequence[EngineRequest], source: mx.array | DecodeOutput
    ) -> TokenMasks | None:
        """The constrained rows' token masks, or ``None`` when no row has one.

        The logits are ``source``, or a decode output's (read only when a row is constrained).
        The logits' evaluation starts first, so the host fills the masks while the device
        runs the forward; nothing is done (the logits are not read) when no row is
        constrained.
        """
        if all(r.constraint is None for r in batch):
            return None
        logits = source.logits if isinstance(source, DecodeOutput) else source
        mx.async_eval(logits)
        tic = time.perf_counter()
        masks = collect_token_masks([r.constraint for r in batch], logits.shape[-1])
        self.stats.mask_seconds += time.perf_counter() - tic
        self.stats.masks_filled += len(masks.rows) if masks is not None else 0
        return masks


def kv_length(request: EngineRequest) -> int:
    """Positions a running request holds: its text but the last token (the next input)."""
    return len(request.prompt) + len(request.generated) - 1


def written_state(caches: Sequence[Any]) -> list[mx.array]:
    """The arrays of the caches' ``state``: what evaluating a prefill chunk's writes needs.

    An explicit stack, not a recursive closure: a closure that calls itself is a reference
    cycle, which would keep the list (the pool's buffers of that moment) alive until the
    cycle collector ran, and buffers a growing pool has replaced with that.
    """
    arrays: list[mx.array] = []
    stack: list[object] = [getattr(cache, "state", None) for cache in reversed(caches)]
    while stack:
        value = stack.pop()
        if isinstance(value, mx.array):
            arrays.append(value)
        elif isinstance(value, list | tuple):
            stack.extend(reversed(value))
    return arrays
