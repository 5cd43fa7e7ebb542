"""Running the model for the engine.

A prefill chunk goes through one request's caches; a batched decode step through the pool, on
the token per request the scheduler's reservation holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import KernelSet, KVPool, RequestStateError, Reservation

from ._cache_nesting import CacheNesting
from ._decode_step import DecodeStep, PoolAddressing
from ._fast_mlp import FastMLPs
from ._layer_cache import batched_layer_caches
from ._model_forward import (
    DecodeForward,
    LastPositionForward,
    SplitDecodeForward,
    VocabularyHead,
)
from ._model_surgery import ModelSurgery
from ._ragged_state import RaggedRows, RaggedStateMixers
from ._state_cache import StackedStateCache, install_stacked_states

__all__ = ["DecodeOutput", "ModelRunner"]


class DecodeOutput:
    """What one batched decode forward left.

    The last position's ``(B, vocab)`` logits (lazy), the step (its reserved token per
    request) and the stacked recurrent states, to be evaluated with the sampled tokens and
    then split back into the rows. Given the last position's ``hidden`` states and the
    ``head`` instead of ``logits``, the logits are projected when first read, and
    :meth:`greedy_tokens` may pick the rows' argmax without them.
    """

    def __init__(
        self,
        *,
        step: DecodeStep,
        states: list[StackedStateCache],
        logits: mx.array | None = None,
        hidden: mx.array | None = None,
        head: VocabularyHead | None = None,
    ) -> None:
        if (logits is None) == (hidden is None or head is None):
            raise ValueError("a decode output holds either logits or hidden states and a head")
        self.step = step
        self.states = states
        self._logits = logits
        self._hidden = hidden
        self._head = head

    @property
    def logits(self) -> mx.array:
        """The last position's ``(B, vocab)`` logits (lazy)."""
        if self._logits is None:
            assert self._head is not None and self._hidden is not None
            self._logits = self._head(self._hidden)
        return self._logits

    def greedy_tokens(self) -> mx.array | None:
        """Each row's ``argmax`` of :attr:`logits` (lazy, uint32) without projecting them all.

        ``None`` where the head does not pick them itself, or the logits were already read:
        the caller then takes the argmax of :attr:`logits`.
        """
        if self._logits is not None or self._head is None or self._hidden is None:
            return None
        return self._head.greedy(self._hidden)

    def split_states(self) -> None:
        """Hand each row its new recurrent state (after evaluation)."""
        for state in self.states:
            state.split()

    def state_arrays(self) -> list[Any]:
        """The new state arrays, to evaluate with the sampled tokens in one ``mx.eval``."""
        return [state.view.cache for state in self.states]


class ModelRunner:
    """Forward passes of one model over a paged pool, for the engine and its build check.

    ``addressing`` says where each attention layer's K/V live and its decode route: the
    ``universal`` layers take a :class:`~kv_batching._layer_cache.PoolDecodeCache` in a
    batched decode, the others a :class:`~kv_batching._layer_cache.BatchedLayerCache` (their
    modules must be wrapped); ``state_layer_ids`` get each row's recurrent state, stacked;
    ``nesting`` puts
    the flat per-layer caches back into the model's own cache structure. ``prefill_forward``
    (from :func:`~kv_batching.last_position_forward`) projects only the last position of a
    prefill chunk when given; ``decode_forward`` (``_model_forward.decode_forward``) replaces
    the model's call in a batched decode when given. When ``kernels`` carry a
    ``prefill_attention``, the wrapped (fast-path) layers attend through it during
    :meth:`prefill`. ``surgery`` holds the changes made to the model; every forward is built
    inside its :meth:`~kv_batching._model_surgery.ModelSurgery.engaged` (prompt chunks and
    verifications as prefill), so the changed modules compute their way only there.
    """

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        kernels: KernelSet,
        *,
        addressing: PoolAddressing,
        state_layer_ids: Sequence[int] = (),
        nesting: CacheNesting | None = None,
        prefill_forward: LastPositionForward | None = None,
        decode_forward: DecodeForward | None = None,
        surgery: ModelSurgery | None = None,
    ) -> None:
        self.model = model
        self.surgery = surgery if surgery is not None else ModelSurgery(model)
        self.pool = pool
        self.kernels = kernels
        self.state_layer_ids = tuple(state_layer_ids)
        self.nesting = nesting if nesting is not None else CacheNesting.from_model(model)
        self.prefill_forward = prefill_forward
        self.decode_forward = decode_forward
        self.addressing = addressing

    @property
    def ragged_state_mixers(self) -> RaggedStateMixers | None:
        """The STATE layers' mixers swapped to run a verification's ragged rows, if installed."""
        return self.surgery.find(RaggedStateMixers)

    @property
    def fast_mlps(self) -> bool:
        """Whether the model's gated MLPs are swapped for their vectorised form."""
        return self.surgery.find(FastMLPs) is not None

    @property
    def verifies_in_batch(self) -> bool:
        """Whether a decode step may hold several tokens per row (a verified proposal).

        Always on attention-only models; on models with STATE layers once their mixers run
        ragged rows (:attr:`ragged_state_mixers`).
        """
        return not self.state_layer_ids or self.ragged_state_mixers is not None

    def prefill(
        self,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        every_position: bool = False,
        sampled: bool = True,
    ) -> mx.array:
        """Logits (lazy) of one request's ``tokens`` run through its per-layer ``caches``.

        ``(1, T, vocab)``, or ``(1, 1, vocab)`` of the last position with ``prefill_forward``
        unless ``every_position`` asks for all of them. A chunk nothing is ``sampled`` from
        runs the model's own call, whose logits stay lazy and unevaluated
        (``prefill_forward`` may evaluate its input: a native head does).
        """
        chunk = mx.array(list(tokens), dtype=mx.int32)[None]
        model_caches = self.nesting.nest(caches)
        with self.surgery.engaged(prefill=True):
            if self.prefill_forward is not None and not every_position and sampled:
                return self.prefill_forward(chunk, model_caches)
            logits: mx.array = self.model(chunk, cache=model_caches)
            return logits

    def verify(self, tokens: Sequence[int], caches: list[Any]) -> mx.array:
        """Logits (lazy, ``(1, T, vocab)``) of every position of one request's ``tokens``.

        A speculative step: the request's last token and a proposal, run through its
        per-layer ``caches`` as a prefill chunk is, projected at every position (with
        ``decode_forward``'s head order when given: it is the faster one for a few rows).
        """
        chunk = mx.array(list(tokens), dtype=mx.int32)[None]
        model_caches = self.nesting.nest(caches)
        forward = self.decode_forward if self.decode_forward is not None else self.model
        with self.surgery.engaged(prefill=True):
            logits: mx.array = forward(chunk, cache=model_caches)
        return logits

    def decode(
        self,
        reservation: Reservation,
        last_tokens: Sequence[int] | Sequence[Sequence[int]],
        states: Sequence[Sequence[Any]],
    ) -> DecodeOutput:
        """One batched decode forward: each request's ``last_tokens`` entry at its position.

        ``reservation`` is the scheduler's reservation (rows in its order); ``states[b]`` are
        row ``b``'s recurrent state caches, one per STATE layer. A request the reservation
        holds ``n > 1`` tokens for (a speculative verification; on a model with STATE layers
        only with :attr:`ragged_state_mixers`) gives a list of ``n`` tokens, its last one and
        its proposal: the logits then have one row per token, in order, and each request's
        stacked state is its state after all ``n`` tokens. The caller rolls the reservation
        back if anything after fails.
        """
        step = DecodeStep.from_reservation(reservation, self.pool, self.kernels, self.addressing)
        flat: list[int] = []
        for entry, n in zip(last_tokens, reservation.n_tokens, strict=True):
            row = [entry] if isinstance(entry, int) else list(cast(Sequence[int], entry))
            if len(row) != n:
                raise RequestStateError(
                    f"a decode row was given {len(row)} tokens for {n} reserved positions"
                )
            flat.extend(row)
        ragged = None
        if len(flat) != len(last_tokens) and self.state_layer_ids:
            if self.ragged_state_mixers is None or not self.ragged_state_mixers.installed:
                raise RequestStateError(
                    "several tokens per row verify on a model with recurrent state layers only "
                    "where its state mixers run ragged rows (none are installed)"
                )
            ragged = RaggedRows.from_counts(reservation.n_tokens)
        tokens = mx.array([[t] for t in flat], dtype=mx.int32)
        caches = batched_layer_caches(step)
        stacked = (
            install_stacked_states(caches, self.state_layer_ids, states)
            if self.state_layer_ids
            else []
        )
        if ragged is not None:
            for state in stacked:
                RaggedStateMixers.mark(state.view, ragged)
        forward = self.decode_forward if self.decode_forward is not None else self.model
        with self.surgery.engaged():
            if isinstance(forward, SplitDecodeForward) and forward.head.picks_greedy:
                hidden = forward.backbone(tokens, cache=self.nesting.nest(caches))
                return DecodeOutput(
                    hidden=hidden[:, -1, :], head=forward.head, step=step, states=stacked
                )
            logits = forward(tokens, cache=self.nesting.nest(caches))
        return DecodeOutput(logits=logits[:, -1, :], step=step, states=stacked)
