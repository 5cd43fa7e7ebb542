"""The prefill phase of a step: admission, prefix reuse and prompt chunks within a budget.

Each step after the decode phase admits queued requests (:class:`Scheduler.admit`), starts
each at the longest prefix the cache holds, and prefills chunks of at most the step's budget
(:class:`PrefillBudget`, the leader rank's on tensor-parallel ranks). A chunk is a
transaction: all of it lands, or nothing and a raise that fails only its request. The chunk
that ends a prompt samples the first token, for every sequence of the prompt that forks.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from kv_protocol import Reservation

from ._agreement import RankAgreement
from ._engine_core import EngineCore, written_state
from ._forks import Forks
from ._outputs import StepOutputs
from ._prefill_budget import PrefillBudget
from ._requests import EngineRequest
from ._sampling import SampledTokens, log_softmax_top
from ._snapshot_policy import SnapshotPolicy
from ._state_snapshots import StateSnapshot

__all__ = ["PrefillPhase"]

logger = logging.getLogger(__name__)


class PrefillPhase:
    """Admits and prefills requests, one chunk a request at a time, within a step's budget.

    ``logit_rows`` bounds the prompt positions one chunk computes full-vocabulary logits
    for (prompt logprobs).
    """

    def __init__(
        self,
        core: EngineCore,
        outputs: StepOutputs,
        *,
        budget: PrefillBudget,
        agreement: RankAgreement | None,
        snapshots: SnapshotPolicy | None,
        logit_rows: int,
    ) -> None:
        self._core = core
        self._outputs = outputs
        self._forks = Forks(core, outputs)
        self.budget = budget
        self._agreement = agreement
        self._snapshots = snapshots
        self._logit_rows = logit_rows

    def run(self, produced: dict[int, list[int]], decode_seconds: float | None) -> None:
        """Prefill within the step's budget (``decode_seconds``: this step's decode, if any)."""
        scheduler = self._core.scheduler
        budget = self.budget.tokens(decode_seconds)
        if self._agreement is not None:
            budget = self._agreement.prefill_budget(budget)
        while budget > 0:
            request = scheduler.prefilling
            if request is None:
                request = scheduler.admit()
                if request is not None:
                    self.reuse_prefix(request)
            if request is None:
                if scheduler.may_admit():
                    continue  # the head of the queue failed admission; try the next one
                return
            tokens = request.prefill_tokens()
            wanted = min(budget, len(tokens) - request.prefilled)
            if self._snapshots is not None:
                wanted = min(wanted, self._snapshots.chunk_limit(request.prefilled, len(tokens)))
            if request.prompt_logprobs_missing:
                wanted = min(wanted, self._logit_rows)
            try:
                reservation = scheduler.reserve_chunk(request, wanted)
            except Exception as error:  # the pool raised: nothing was reserved
                scheduler.fail(request, error)
                continue
            if reservation is None:
                if not scheduler.running:
                    # Nothing else holds pages: this request alone cannot fit.
                    scheduler.finish(request, "pool_exhausted")
                    continue
                if request.prefilled == 0:
                    scheduler.requeue_unstarted(request)
                return
            try:
                self.chunk(request, tokens, reservation, produced)
            except Exception as error:
                scheduler.fail(request, error)
            budget -= reservation.n_tokens[0]

    def reuse_prefix(self, request: EngineRequest) -> None:
        """Start a just-admitted request at the longest prefix the cache holds.

        A request asking for its prompt's logprobs reuses nothing (every prompt position's
        logits are computed) but still hashes its text, so that what it writes is cached.
        """
        core = self._core
        cache = core.prefix_cache
        # Reported once: a preempted request re-admitted later hits its own pages.
        first = request.cached_tokens is None
        if first:
            request.cached_tokens = 0
        if cache is None:
            return
        policy = self._snapshots
        states: list[Any] | None = None
        try:
            if request.hashes is None:
                # Once per request: its tokens' hashes then grow with what it decodes.
                request.hashes = cache.hash_tokens(request.prefill_tokens())
            if request.prompt_logprobs_missing:
                return
            hashes = request.hashes
            if core.state_layer_ids:
                # A recurrent state cannot be cut back: a prefix is usable only where a
                # snapshot of the state after it is kept.
                if policy is None:
                    return
                snapshots = policy.cache
                hit = cache.match_prefix(
                    hashes, usable=lambda length: hashes.prefix_hash(length) in snapshots
                )
                if hit:
                    snapshot = snapshots.get(hashes.prefix_hash(hit.length))
                    if snapshot is None:  # usable() saw it a moment ago
                        return
                    states = snapshot.caches()
            else:
                hit = cache.match_prefix(hashes)
            cache.reuse_prefix(request.rid, hit)
        except Exception as error:  # nothing was reused; prefill computes everything
            logger.warning("prefix cache: reuse for request %d failed: %r", request.rid, error)
            return
        if hit:
            request.prefilled = hit.length
            if first:
                request.cached_tokens = min(hit.length, len(request.prompt))
            if states is not None and policy is not None:
                request.states = states
                policy.cache.note_hit(hit.length)
            core.stats.prefix_hit_tokens += hit.length

    def chunk(
        self,
        request: EngineRequest,
        tokens: list[int],
        reservation: Reservation,
        produced: dict[int, list[int]],
    ) -> None:
        """Prefill the chunk ``reservation`` holds: all of it, or nothing and a raise."""
        core = self._core
        begin, n = request.prefilled, reservation.n_tokens[0]
        started = time.perf_counter()
        saved = core.sampler.save()
        first: SampledTokens | None = None
        forks: list[EngineRequest] = []
        prompt_part: tuple[int, SampledTokens] | None = None
        # The state before the chunk, put back if the chunk fails.
        before = None if request.states is None else StateSnapshot(request.states, begin)
        try:
            if request.states is None and core.make_state_caches is not None:
                request.states = core.make_state_caches()
            caches = core.request_caches(request.states or [], reservation)
            # Prompt logprobs need the logits of every position the chunk predicts a prompt
            # token from (position j predicts token j + 1).
            targets = tokens[begin + 1 : min(begin + n + 1, len(request.prompt))]
            every = bool(targets) and request.prompt_logprobs_missing
            # No token is sampled from a chunk before the prompt's end (or of a request
            # that already generated: a resumed one).
            sampled = not (begin + n < len(tokens) or request.generated)
            logits = core.runner.prefill(
                tokens[begin : begin + n], caches, every_position=every, sampled=sampled
            )
            tic = time.perf_counter()
            pending: list[mx.array] = []
            if every:
                width = request.params.prompt_logprobs or 0
                chosen, ids, values = log_softmax_top(
                    logits[0, : len(targets)], mx.array(targets, dtype=mx.int32), width
                )
                part = SampledTokens(
                    tokens=mx.array(targets, dtype=mx.int32),
                    logprob_rows=tuple(range(len(targets))),
                    widths=(width,) * len(targets),
                    chosen=chosen,
                    top_ids=ids,
                    top_logprobs=values,
                )
                prompt_part = (begin + 1, part)
                pending.extend(part.arrays())
            if not sampled:
                # No token is sampled from this chunk: evaluate what it wrote (the caches'
                # state), not its logits, so the last layer's attention and MLP, which only
                # the logits need, are never computed (mlx-lm's prefill does the same).
                mx.eval(written_state(caches), pending)
            else:
                forks = self._forks.ready(request)
                rows = [r.sampling_row() for r in (request, *forks)]
                last = logits[:, -1, :]
                if forks:
                    last = mx.broadcast_to(last, (len(rows), last.shape[-1]))
                masks = core.token_masks([request, *forks], last)
                first = core.sampler.sample(last, rows, masks)
                mx.eval(first.arrays(), pending)
            if request.states:
                mx.eval([getattr(c, "cache", []) for c in request.states])
            core.stats.prefill_device_seconds += core.device_seconds(tic)
        except BaseException:
            core.sampler.restore(saved)
            # The recurrent states go back to what they were before the chunk, the pool to
            # the request's length before it.
            request.states = None if before is None else before.caches()
            core.scheduler.rollback(reservation)
            raise
        core.scheduler.note_state_bytes(request)
        if prompt_part is not None and request.prompt_logprobs is not None:
            start, part = prompt_part
            request.prompt_logprobs[start : start + len(part.logprob_rows)] = part.logprobs()
        core.commit(request, begin + n)
        request.prefilled = begin + n
        policy = self._snapshots
        if policy is not None and policy.is_point(begin + n, len(tokens)):
            policy.keep(request, StateSnapshot(request.states or [], begin + n))
        core.stats.record_prefill_chunk(n)
        self.budget.note_prefill(n, time.perf_counter() - started)
        if request.prefilled < len(tokens):
            return
        core.scheduler.start_running(request)
        if first is None:
            return
        picked = list(zip(first.token_list(), first.logprobs(), strict=True))
        # The other sequences of the prompt take a fork of its pages before the first one
        # emits (a stop token would free them).
        for follower, pick in zip(forks, picked[1:], strict=True):
            self._forks.start(request, follower, pick, produced)
        self._forks.release(request)
        self._outputs.emit(request, picked[0][0], produced, picked[0][1])
