"""Speculative decoding inside the engine's step: proposals, their verification, the outcome.

A request verifies a proposal of ``k`` tokens by running its last token and the proposal as
``k + 1`` positions: as extra rows of the shared decode step where the runner verifies in
the batch (:meth:`Verifier.verify_batch`), else by a forward of its own
(:meth:`Verifier.speculate`). The longest prefix of the proposal the model agrees with is
kept with the model's token after it (greedy: exactly plain decoding's tokens; sampled: the
rejection rule of :meth:`Sampler.verify_draft`, which keeps the distribution). What follows
goes back to the pool, and a recurrent state is rolled back to the kept tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx

from kv_protocol import RequestStateError, Reservation

from ._engine_core import EngineCore, kv_length, written_state
from ._model_runner import DecodeOutput
from ._outputs import StepOutputs
from ._requests import EngineRequest
from ._sampling_params import TokenLogprob, plain_greedy
from ._snapshot_policy import SnapshotPolicy
from ._speculative import BatchProposer, SpeculationConfig, SpeculationState, StepRates
from ._state_snapshots import StateSnapshot

__all__ = ["Verifier", "kept_count", "speculates"]

logger = logging.getLogger(__name__)


def speculates(request: EngineRequest) -> bool:
    """Whether ``request`` may verify proposals: its logits are used as the model gives them.

    Greedy requests then keep exactly plain decoding's tokens; sampled ones (temperature,
    ``top_k``, ``top_p``, ``min_p``, seeded or not) keep its distribution
    (:meth:`Sampler.verify_draft`). Penalised, biased, ``min_tokens``, logprob-reporting and
    constrained requests decode one token at a time.
    """
    params = request.params
    return not params.processes_logits and params.logprobs is None and request.constraint is None


def kept_count(request: EngineRequest, emitted: Sequence[int]) -> int:
    """How many of a verification's ``emitted`` tokens ``request`` keeps.

    All of them, or up to and including a stop token or the one that reaches ``max_tokens``.
    """
    kept = 0
    for token in emitted:
        kept += 1
        if token in request.stop_tokens or len(request.generated) + kept >= request.max_tokens:
            break
    return kept


class Verifier:
    """Proposes, verifies and keeps speculative tokens for an engine's requests.

    ``config`` is the engine's :class:`SpeculationConfig`; ``step_rates`` (kept when
    ``config.compare_rates``) compares verifying and plain shared steps' tokens a second, so
    proposals stop where plain steps are faster at a batch size. ``step_snapshots`` keeps a
    plain row's state before the step for :meth:`DecodeEngine.restore`.
    """

    def __init__(
        self,
        core: EngineCore,
        outputs: StepOutputs,
        config: SpeculationConfig,
        *,
        snapshots: SnapshotPolicy | None,
        step_snapshots: bool,
    ) -> None:
        self._core = core
        self._outputs = outputs
        self.config = config
        self._snapshots = snapshots
        self._step_snapshots = step_snapshots
        self.step_rates = StepRates() if config.compare_rates else None

    # ------------------------------------------------------------------ proposals

    def proposals(
        self, requests: Sequence[EngineRequest], *, batched: bool
    ) -> dict[int, list[int]]:
        """The proposals ``requests`` verify this step, by request id (absent: none).

        ``batched``: a proposal would be verified as extra rows of the shared decode step
        (:meth:`SpeculationState.pays_in_batch`), else by a forward of its own
        (:meth:`SpeculationState.pays_at`). A proposal that does not pay yet is shadowed. A
        :class:`BatchProposer` guesses for all of them in one call.
        """
        config = self.config
        batch = len(self._core.scheduler.running)
        wanted: list[tuple[EngineRequest, int, bool]] = []
        for request in requests:
            if not speculates(request):
                continue
            state = request.speculation
            if state is None:
                state = request.speculation = SpeculationState(config.num_tokens)
            if batched:
                pays = state.pays_in_batch(batch, config.min_acceptance, shadow=config.shadow)
            else:
                pays = state.pays_at(batch, shadow=config.shadow)
            if not pays and state.shadowing:
                continue
            k = min(state.length(), request.max_tokens - len(request.generated) - 1)
            if k > 0:
                wanted.append((request, k, pays))
        if not wanted:
            return {}
        proposer = config.proposer
        texts = [r.prompt + r.generated for r, _, _ in wanted]
        ks = [k for _, k, _ in wanted]
        if isinstance(proposer, BatchProposer):
            guesses = proposer.propose_batch(texts, ks)
        else:
            guesses = [proposer.propose(text, k) for text, k in zip(texts, ks, strict=True)]
        drafts: dict[int, list[int]] = {}
        for (request, k, pays), guess in zip(wanted, guesses, strict=True):
            draft = [int(t) for t in guess][:k]
            if not draft:
                continue
            if pays:
                drafts[request.rid] = draft
            else:
                # Beside other requests without a record: compare the proposal with what the
                # request decodes in the batch (free), instead of verifying it.
                assert request.speculation is not None
                request.speculation.shadow(draft)
        return drafts

    # ------------------------------------------------------------------ step rates

    def verifies_at(self, size: int) -> bool:
        """Whether a shared step of ``size`` rows proposes at all (plain steps may be faster)."""
        return self.step_rates is None or self.step_rates.verify(size)

    def emitted(self, produced: Mapping[int, list[int]]) -> int:
        """Tokens in ``produced`` so far (what :meth:`record_rate` counts from)."""
        if self.step_rates is None:
            return 0
        return sum(len(tokens) for tokens in produced.values())

    def record_rate(
        self,
        size: int,
        verified: bool,
        emitted_before: int,
        produced: Mapping[int, list[int]],
        start: float,
    ) -> None:
        """Feed a shared step's tokens per second to :class:`StepRates`."""
        if self.step_rates is None:
            return
        emitted = sum(len(tokens) for tokens in produced.values()) - emitted_before
        self.step_rates.record(size, verified, emitted, time.perf_counter() - start)

    # ------------------------------------------------------------------ verification

    def speculate(self, request: EngineRequest, produced: dict[int, list[int]]) -> bool:
        """A speculative step of ``request`` alone; False when it decodes with the batch.

        The request's last token and a proposal of ``k`` tokens run as one chunk of ``k +
        1`` positions; the longest prefix of the proposal that equals the model's greedy
        tokens is kept, with the model's token after it. The positions of rejected tokens
        go back to the pool; a recurrent state is put back as it was and advanced through
        the kept tokens alone.
        """
        core = self._core
        draft = self.proposals([request], batched=False).get(request.rid, [])
        if not draft:
            return False
        inputs = [request.generated[-1], *draft]
        try:
            reservation = core.scheduler.reserve_verify(request, len(inputs))
        except Exception as error:  # the pool raised: nothing was reserved
            logger.warning("speculative reservation of request %d raised %r", request.rid, error)
            return False
        if reservation is None:
            return False
        length = kv_length(request)
        before = None if request.states is None else StateSnapshot(request.states, length)
        saved = core.sampler.save()
        try:
            caches = core.request_caches(request.states or [], reservation)
            logits = core.runner.verify(inputs, caches)[0]
            tic = time.perf_counter()
            mx.eval(logits, [getattr(c, "cache", []) for c in request.states or []])
            core.stats.decode_device_seconds += core.device_seconds(tic)
            greedy = (
                [int(t) for t in cast(list[int], logits.argmax(axis=-1).tolist())]
                if request.params.greedy
                else None
            )
            accepted, token = self.accept(request, draft, logits, greedy)
        except Exception as error:
            core.sampler.restore(saved)
            request.states = None if before is None else before.caches()
            core.scheduler.rollback(reservation)
            logger.warning("speculative step of request %d failed: %r", request.rid, error)
            return False
        self.keep_verified(request, draft, accepted, token, length, produced, before)
        return True

    def verify_batch(
        self,
        batch: list[EngineRequest],
        reservation: Reservation,
        drafts: Mapping[int, list[int]],
        produced: dict[int, list[int]],
    ) -> None:
        """One shared decode step in which some requests also verify their proposals.

        A request the reservation holds ``k + 1`` positions for runs its last token and its
        proposal of ``k`` as ``k + 1`` rows of the step (each attending up to its own
        position); the others take one row and are sampled as in a plain step. Nothing is
        kept unless the whole forward and every choice went through: on an error the
        sampler and the reservation are put back and the error raised.
        """
        core = self._core
        counts = reservation.n_tokens
        inputs: list[list[int]] = []
        for request, n in zip(batch, counts, strict=True):
            draft = drafts.get(request.rid, []) if n > 1 else []
            if len(draft) != n - 1:
                raise RequestStateError(
                    f"request {request.rid} was reserved {n} positions for a proposal of "
                    f"{len(draft)} tokens"
                )
            inputs.append([request.generated[-1], *draft])
        first = [0]
        for n in counts:
            first.append(first[-1] + n)
        plain = [i for i, n in enumerate(counts) if n == 1]
        # A recurrent state comes out of the step advanced through every row of its request;
        # a verification that keeps fewer tokens goes back to the state before the step.
        befores = [
            None if r.states is None else StateSnapshot(r.states, start)
            for r, start in zip(batch, reservation.start_lengths, strict=True)
        ]
        saved = core.sampler.save()
        try:
            out = core.runner.decode(reservation, inputs, [r.states or [] for r in batch])
            chosen: dict[int, tuple[int, TokenLogprob | None]] = {}
            pending: list[Any] = []
            sampled = None
            plain_rows = mx.array([first[i] for i in plain], dtype=mx.int32) if plain else None
            # Every request plainly greedy: the head picks every row's token, no logits.
            picked = (
                out.greedy_tokens()
                if all(plain_greedy(r.params) and r.constraint is None for r in batch)
                else None
            )
            logits: mx.array | None = None
            if picked is not None:
                core.stats.greedy_head_steps += 1
                argmax = picked
                if plain_rows is not None:
                    sampled = core.sampler.picked(picked[plain_rows])
                    pending.append(sampled.arrays())
            else:
                logits = out.logits
                if plain_rows is not None:
                    plain_batch = [batch[i] for i in plain]
                    rows_of_plain = logits[plain_rows]
                    masks = core.token_masks(plain_batch, rows_of_plain)
                    sampled = core.sampler.sample(
                        rows_of_plain, [r.sampling_row() for r in plain_batch], masks
                    )
                    pending.append(sampled.arrays())
                argmax = logits.argmax(axis=-1)
            tic = time.perf_counter()
            mx.eval(pending, argmax, out.state_arrays())
            core.stats.decode_device_seconds += core.device_seconds(tic)
            if sampled is not None:
                picks = zip(sampled.token_list(), sampled.logprobs(), strict=True)
                chosen = dict(zip(plain, picks, strict=True))
            greedy_all = [int(t) for t in cast(list[int], argmax.tolist())]
            verdicts: dict[int, tuple[int, int]] = {}
            for i, request in enumerate(batch):
                if counts[i] == 1:
                    continue
                rows = slice(first[i], first[i + 1])
                greedy = greedy_all[rows] if request.params.greedy else None
                request_logits = None if logits is None else logits[rows]
                verdicts[i] = self.accept(request, inputs[i][1:], request_logits, greedy)
        except BaseException:
            core.sampler.restore(saved)
            core.scheduler.rollback(reservation)
            raise
        out.split_states()
        replayed = self._replay_mixers(batch, out, first, inputs, verdicts, befores)
        for i, request in enumerate(batch):
            if i in verdicts:
                accepted, token = verdicts[i]
                start = reservation.start_lengths[i]
                before = None if i in replayed else befores[i]
                self.keep_verified(
                    request,
                    inputs[i][1:],
                    accepted,
                    token,
                    start,
                    produced,
                    before,
                    self._state_after(out, first[i], befores[i]),
                )
            else:
                if self._step_snapshots:
                    request.step_snapshot = befores[i]
                self._outputs.advance(request, chosen[i], reservation.lengths[i], produced)

    def accept(
        self,
        request: EngineRequest,
        draft: list[int],
        logits: mx.array | None,
        greedy: list[int] | None,
    ) -> tuple[int, int]:
        """``(accepted, token)``: how much of ``draft`` is kept and the token after it.

        ``logits`` are the ``(len(draft) + 1, vocab)`` rows of the request's last token and
        its proposal (``None`` where the head picked a greedy step's tokens without them);
        ``greedy`` their argmax for a greedy request (exactly plain decoding's tokens),
        ``None`` for a sampled one (the rejection rule of :meth:`Sampler.verify_draft`,
        which keeps the request's distribution).
        """
        if greedy is not None:
            accepted = 0
            while accepted < len(draft) and draft[accepted] == greedy[accepted]:
                accepted += 1
            return accepted, greedy[accepted]
        if logits is None:
            raise RequestStateError("a sampled request's proposal is verified on its logits")
        base = request.sampling_row()
        rows = [replace(base, generated=base.generated + i) for i in range(len(draft) + 1)]
        return self._core.sampler.verify_draft(logits, draft, rows)

    # ------------------------------------------------------------------ the outcome

    def keep_verified(
        self,
        request: EngineRequest,
        draft: list[int],
        accepted: int,
        token: int,
        length: int,
        produced: dict[int, list[int]],
        before: StateSnapshot | None = None,
        state_after: Callable[[int], list[Any]] | None = None,
    ) -> None:
        """Keep a verification's outcome: trim the rest, commit and emit the kept tokens.

        The pool holds ``len(draft) + 1`` new positions from ``length`` (the last token and
        the proposal); what follows the kept tokens goes back, and a recurrent state
        (``before`` the step) is put back and advanced through the kept tokens alone. With
        state snapshots, the last prefix boundary the kept tokens reach is snapshotted as a
        plain step's would be: from the state after them, or ``state_after(n)`` (the state
        after the step's first ``n`` rows) for a boundary inside them.
        """
        core = self._core
        state = request.speculation
        assert state is not None
        inputs = [request.generated[-1], *draft]
        emitted = [*draft[:accepted], token]
        kept = kept_count(request, emitted)
        try:
            core.pool.trim_request(request.rid, len(inputs) - kept)
            if before is not None and kept < len(inputs):
                self.replay_state(request, before, inputs[:kept])
        except Exception as error:
            core.scheduler.fail(request, error)
            return
        state.record(len(draft), accepted, self.config)
        core.stats.record_speculation(len(draft), accepted, kept)
        request.step_snapshot = None
        if request.hashes is not None:
            request.hashes.extend(inputs[:kept])
            core.commit(request, length + kept)
            if self._snapshots is not None and request.states:
                self._snapshots.after_verification(request, length, length + kept, state_after)
        for emitted_token in emitted[:kept]:
            self._outputs.emit(request, emitted_token, produced)

    def replay_state(
        self, request: EngineRequest, before: StateSnapshot, tokens: list[int]
    ) -> None:
        """Put ``request``'s recurrent state back to ``before`` and run ``tokens`` through it.

        The pool holds ``tokens``' positions (already written, with the same K/V): they are
        given back and reserved again for the chunk that rewrites them.
        """
        core = self._core
        core.pool.trim_request(request.rid, len(tokens))
        request.states = before.caches()
        reservation = core.scheduler.reserve_verify(request, len(tokens))
        if reservation is None:
            raise RequestStateError(
                f"the pool no longer holds room to replay request {request.rid}'s state"
            )
        try:
            caches = core.request_caches(request.states, reservation)
            core.runner.prefill(tokens, caches)
            mx.eval(written_state(caches), [getattr(c, "cache", []) for c in request.states])
        except BaseException:
            core.scheduler.rollback(reservation)
            request.states = before.caches()
            raise

    def _state_after(
        self, out: DecodeOutput, first_row: int, before: StateSnapshot | None
    ) -> Callable[[int], list[Any]] | None:
        """The state after the first ``n`` of a request's rows in the step ``out``.

        By the mixers alone, from its state ``before`` the step (its rows start at step row
        ``first_row``); ``None`` where the mixers do not run the step's rows.
        """
        mixers = self._core.runner.ragged_state_mixers
        if mixers is None or before is None:
            return None
        snapshot = before

        def state_after(n: int) -> list[Any]:
            assert mixers is not None
            states = mixers.replay(out.states, [first_row], [n], [snapshot.caches()])[0]
            mx.eval([getattr(c, "cache", []) for c in states])
            return states

        return state_after

    def _replay_mixers(
        self,
        batch: list[EngineRequest],
        out: DecodeOutput,
        first: list[int],
        inputs: list[list[int]],
        verdicts: Mapping[int, tuple[int, int]],
        befores: Sequence[StateSnapshot | None],
    ) -> set[int]:
        """Put back the states of verifications that keep fewer tokens than they ran.

        Their recurrent mixers run again from the state before the step on the kept rows'
        inputs, all such requests at once (:meth:`RaggedStateMixers.replay`); returns the
        indices in ``batch`` done so. On an error nothing is changed and the requests replay
        by a forward of their own in :meth:`keep_verified`.
        """
        mixers = self._core.runner.ragged_state_mixers
        partial: list[tuple[int, int]] = []
        for i, (accepted, token) in verdicts.items():
            kept = kept_count(batch[i], [*inputs[i][1 : accepted + 1], token])
            if befores[i] is not None and kept < len(inputs[i]):
                partial.append((i, kept))
        if mixers is None or not partial:
            return set()
        try:
            states = mixers.replay(
                out.states,
                [first[i] for i, _ in partial],
                [kept for _, kept in partial],
                [cast(StateSnapshot, befores[i]).caches() for i, _ in partial],
            )
            mx.eval([getattr(c, "cache", []) for state in states for c in state])
        except Exception as error:
            logger.warning("replaying the mixers of a verifying step failed: %r", error)
            return set()
        for (i, _), state in zip(partial, states, strict=True):
            batch[i].states = state
        return {i for i, _ in partial}
