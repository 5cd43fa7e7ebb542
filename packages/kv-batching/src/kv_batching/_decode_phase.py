"""The decode phase of a step: every running request advances by one batched forward.

The scheduler reserves one pool room for the whole batch; the runner runs one ``(B, 1)``
forward (plus the proposal rows of requests that verify in the batch,
:class:`~kv_batching._verification.Verifier`); the sampler, or the head's greedy pick when
every row is plainly greedy, chooses the tokens; :class:`StepOutputs` commits and emits
them. A failed batched forward is rolled back and retried request by request in the same
step, so only a request that fails alone is finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import mlx.core as mx

from kv_protocol import RequestStateError, Reservation

from ._engine_core import EngineCore, kv_length
from ._outputs import StepOutputs
from ._requests import EngineRequest
from ._sampling_params import TokenLogprob, plain_greedy
from ._state_cache import group_by_state_shapes
from ._state_snapshots import StateSnapshot
from ._verification import Verifier

__all__ = ["DecodePhase"]

logger = logging.getLogger(__name__)


class DecodePhase:
    """Decodes the running requests: one batched step, verification rows where they pay.

    ``verifier`` is ``None`` without speculative decoding; ``step_snapshots`` keeps each
    request's state before its step for :meth:`DecodeEngine.restore`.
    """

    def __init__(
        self,
        core: EngineCore,
        outputs: StepOutputs,
        *,
        verifier: Verifier | None,
        step_snapshots: bool,
    ) -> None:
        self._core = core
        self._outputs = outputs
        self.verifier = verifier
        self._step_snapshots = step_snapshots

    def run(self, produced: dict[int, list[int]]) -> None:
        """Decode every running request once (verifying proposals where they pay)."""
        core = self._core
        scheduler, stats = core.scheduler, core.stats
        start = time.perf_counter()
        rows: list[EngineRequest] | None = None
        drafts: dict[int, list[int]] = {}
        verifier = self.verifier
        shared = verifier is not None and core.runner.verifies_in_batch
        size = len(scheduler.running)
        emitted_before = 0 if verifier is None else verifier.emitted(produced)
        if verifier is not None and shared:
            # Proposals are verified as extra rows of the shared step.
            # Where plain steps are faster at this batch size nothing is proposed at all
            # (the proposals' host time counts in a step's rate too).
            if verifier.verifies_at(size):
                drafts = verifier.proposals(list(scheduler.running), batched=True)
        elif verifier is not None and size <= verifier.config.max_batch:
            rows = [r for r in list(scheduler.running) if not verifier.speculate(r, produced)]
            if not rows:
                stats.decode_seconds += time.perf_counter() - start
                return
        try:
            reservation = scheduler.reserve_decode(rows, {rid: len(d) for rid, d in drafts.items()})
        except Exception as error:
            # The pool raised instead of granting or refusing: nothing was reserved, and
            # each request is tried alone (the group's fallback).
            logger.warning("the decode step's reservation raised %r", error)
            reservation = None
        running = scheduler.running
        batch = list(running) if rows is None else [r for r in rows if r in running]
        if not batch:
            return
        if core.state_layer_ids:
            # Rows decode together only where their recurrent states stack (same shapes);
            # a state that grows with the text (an n-gram context) splits the batch early on.
            groups = group_by_state_shapes(batch, lambda r: r.states or [])
        else:
            groups = [batch]
        if len(groups) == 1:
            verifying = reservation is not None and any(n > 1 for n in reservation.n_tokens)
            if verifier is not None and reservation is not None and verifying:
                try:
                    verifier.verify_batch(batch, reservation, drafts, produced)
                except Exception as error:
                    # Rolled back: the step decodes one token per request instead.
                    logger.warning("batched verification failed (%r); decoding plainly", error)
                    stats.decode_fallbacks += 1
                    self._group(batch, scheduler.reserve_rows(batch), produced)
                stats.record_decode(time.perf_counter() - start, len(batch))
                verifier.record_rate(size, True, emitted_before, produced, start)
                return
            self._group(batch, reservation, produced)
            if verifier is not None and shared:
                verifier.record_rate(size, False, emitted_before, produced, start)
        else:
            # The whole batch fits; each group takes its own part of that room.
            if reservation is not None:
                scheduler.rollback(reservation)
            for group in groups:
                self._group(group, scheduler.reserve_rows(group), produced)
        stats.record_decode(time.perf_counter() - start, len(batch))

    def _group(
        self,
        batch: list[EngineRequest],
        reservation: Reservation | None,
        produced: dict[int, list[int]],
    ) -> None:
        """Decode ``batch`` on ``reservation``; on a failure, each request alone."""
        scheduler = self._core.scheduler
        if self._step_snapshots:
            for request in batch:
                request.step_snapshot = StateSnapshot(request.states or [], kv_length(request))
        try:
            if reservation is None:
                raise RequestStateError(
                    f"the pool no longer holds room for requests {[r.rid for r in batch]}"
                )
            chosen = self._batch(batch, reservation)
        except Exception as error:
            # Nothing of the batch was kept; find the request(s) that fail on their own.
            self._core.stats.decode_fallbacks += 1
            logger.warning(
                "batched decode of %d requests failed (%r); retrying them one by one",
                len(batch),
                error,
            )
            for request in batch:
                try:
                    alone = scheduler.reserve_rows([request])
                    if alone is None:
                        raise RequestStateError(
                            f"the pool no longer holds room for request {request.rid}"
                        ) from error
                    picked = self._batch([request], alone)[0]
                except Exception as failure:
                    scheduler.fail(request, failure)
                else:
                    self._outputs.advance(request, picked, alone.lengths[0], produced)
        else:
            for request, picked, length in zip(batch, chosen, reservation.lengths, strict=True):
                self._outputs.advance(request, picked, length, produced)

    def _batch(
        self, batch: Sequence[EngineRequest], reservation: Reservation
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One batched decode of ``batch`` on its reservation; a rollback and a raise on error."""
        core = self._core
        saved = core.sampler.save()
        try:
            out = core.runner.decode(
                reservation,
                [r.generated[-1] for r in batch],
                [r.states or [] for r in batch],
            )
            rows = [r.sampling_row() for r in batch]
            masks = core.token_masks(batch, out)
            sampled = None
            if masks is None and all(plain_greedy(row.params) for row in rows):
                tokens = out.greedy_tokens()
                if tokens is not None:
                    sampled = core.sampler.picked(tokens)
                    core.stats.greedy_head_steps += 1
            if sampled is None:
                sampled = core.sampler.sample(out.logits, rows, masks)
            tic = time.perf_counter()
            # One evaluation for the tokens, their logprobs and the new states together.
            mx.eval(sampled.arrays(), out.state_arrays())
            chosen = list(zip(sampled.token_list(), sampled.logprobs(), strict=True))
            core.stats.decode_device_seconds += core.device_seconds(tic)
            out.split_states()
            return chosen
        except BaseException:
            core.sampler.restore(saved)
            core.scheduler.rollback(reservation)
            raise
