"""Sampling the next tokens of a batch: one vectorised logits pipeline, logprobs, seeds.

A request's :class:`SamplingParams` say how it samples; each step the engine hands the
:class:`Sampler` the batch's last-position logits and one :class:`SamplingRow` per row (the
params plus what the request generated so far). The pipeline runs over the batch in a few MLX
operations, whatever mix of fields the rows ask for:

1. log-probabilities, for the rows that ask: the log-softmax of the model's own logits, before
   anything below changes them (one ``logsumexp`` and one partial sort over those rows);
2. the logits processors, on the rows that use one: repetition penalty (multiplicative, over
   prompt and generated tokens), frequency and presence penalties (OpenAI's: minus
   ``frequency * count + presence * (count > 0)`` over the generated tokens), logit bias, and
   the stop tokens masked while fewer than ``min_tokens`` were generated;
3. the token masks of constrained rows (structured output: :class:`TokenMasks`, one packed
   bit set per row from its ``TokenConstraint``), applied as one operation to those rows
   only: a step without a constrained row does no mask work at all;
4. greedy rows take the argmax; sampled rows are scaled by their temperature and cut by
   ``top_k``, ``top_p`` and ``min_p`` as thresholds on the scaled logits (a token tied with the
   cut-off value stays), then drawn by inverse transform sampling with one uniform number per
   row: from the sampler's own stream, or with a seed from the row's own key
   (:func:`token_key`), so a seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from kv_protocol import exp_nonpositive

from ._sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingRow,
    TokenLogprob,
    plain_greedy,
)

__all__ = [
    "MAX_LOGPROBS",
    "SampledTokens",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "TokenMasks",
    "apply_token_masks",
    "plain_greedy",
    "sample_top_p",
    "token_key",
]


def token_key(seed: int, index: int) -> mx.array:
    """The random key of the ``index``-th generated token of a request seeded ``seed``.

    A pure function of both (the ``index``-th of ``index + 1`` keys split from the seed's
    key), so a rolled-back or re-prefilled step samples the same token again.
    """
    return mx.random.split(mx.random.key(seed), index + 1)[index]


def sample_top_p(
    logits: mx.array, temperatures: Sequence[float], top_ps: Sequence[float], key: mx.array
) -> mx.array:
    """Temperature + nucleus sampling, one row per request, in one graph.

    Row ``b`` keeps the smallest set of most likely tokens whose probability reaches
    ``top_ps[b]`` (the most likely token always stays) and samples from it.
    """
    rows = [
        SamplingRow(params=SamplingParams(temperature=t, top_p=p), generated=0)
        for t, p in zip(temperatures, top_ps, strict=True)
    ]
    sampler = Sampler(0)
    sampler._key = key
    greedy = mx.zeros((len(rows),), dtype=mx.uint32)
    return sampler._draw(logits.astype(mx.float32), greedy, rows, list(range(len(rows))))


#: Candidates a ``top_p`` cut over the whole vocabulary looks at first; only when they do not
#: reach ``top_p`` is the whole row sorted.
_NUCLEUS_CANDIDATES = 1024


def _cut(logits: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
    """Temperature-scaled logits with the tokens ``top_k``, ``top_p`` and ``min_p`` drop at -inf.

    Each cut is a threshold on the scaled logits of its row, so the result has the full
    vocabulary: a seeded row's draw depends on its own logits and key only.
    """
    params = [r.params for r in rows]
    temperatures = mx.array([p.temperature or 1.0 for p in params], dtype=mx.float32)
    scaled = logits / temperatures[:, None]
    vocab = scaled.shape[-1]
    floor = mx.full((len(rows),), -mx.inf, dtype=mx.float32)
    if any(p.min_p > 0 for p in params):
        logs = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        floor = mx.maximum(floor, mx.max(scaled, axis=-1) + mx.array(logs, dtype=mx.float32))
    ks = [min(p.top_k, vocab) for p in params]
    cut_p = any(p.top_p < 1.0 for p in params)
    if any(ks) or cut_p:
        nucleus = [p.top_p for p, k in zip(params, ks, strict=True) if p.top_p < 1.0 and k == 0]
        ranked, total = _ranked(scaled, max(ks), max(nucleus) if nucleus else None)
        width = ranked.shape[-1]
        positions = mx.arange(width)[None, :]
        kept = mx.array([k or width for k in ks], dtype=mx.int32)[:, None]
        in_k = positions < kept
        if cut_p:
            weights = exp_nonpositive(mx.where(in_k, ranked, -mx.inf) - ranked[:, :1])
            # Rows with a top_k renormalise over their candidates, the others over the row.
            has_k = mx.array([k > 0 for k in ks])[:, None]
            denominator = mx.where(has_k, mx.sum(weights, axis=-1, keepdims=True), total)
            probs = weights / denominator
            before = mx.cumsum(probs, axis=-1) - probs
            tops = mx.array([p.top_p for p in params], dtype=mx.float32)[:, None]
            in_k = in_k & (before < tops)
        # The smallest kept value of each row: everything below it goes (rows that cut
        # neither way keep the whole vocabulary).
        last = mx.sum(in_k.astype(mx.int32), axis=-1, keepdims=True) - 1
        threshold = mx.take_along_axis(ranked, mx.maximum(last, 0), axis=-1)[:, 0]
        cuts = mx.array([k > 0 or p.top_p < 1.0 for p, k in zip(params, ks, strict=True)])
        floor = mx.maximum(floor, mx.where(cuts, threshold, -mx.inf))
    return mx.where(scaled >= floor[:, None], scaled, -mx.inf)


def _ranked(scaled: mx.array, top_k: int, nucleus: float | None) -> tuple[mx.array, mx.array]:
    """Each row's largest scaled logits, largest first, and its softmax denominator.

    ``top_k`` of them; or, when rows cut by ``top_p`` alone (``nucleus``: the largest such
    ``top_p``), enough to decide that cut exactly: the :data:`_NUCLEUS_CANDIDATES` largest
    when every row's candidates hold at least ``nucleus`` of its mass (checked: one
    evaluation), else the whole sorted row. ``total`` is ``sum(exp(scaled - max))``.
    """
    vocab = scaled.shape[-1]
    total = mx.sum(
        exp_nonpositive(scaled - mx.max(scaled, axis=-1, keepdims=True)), axis=-1, keepdims=True
    )
    if nucleus is None:
        return top_candidates(scaled, top_k)[0], total
    width = max(top_k, _NUCLEUS_CANDIDATES)
    if width < vocab:
        ranked = top_candidates(scaled, width)[0]
        mass = mx.sum(exp_nonpositive(ranked - ranked[:, :1]), axis=-1, keepdims=True) / total
        # The cut of a top_p the candidates' mass reaches lies among them.
        if bool(mx.all(mass >= nucleus)):
            return ranked, total
    return -mx.sort(-scaled, axis=-1), total


def _process(logits: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
    """The logits after the rows' penalties, bias and ``min_tokens`` masks (float32).

    Only the entries a row's fields touch are gathered, changed and written back, one
    gather and one scatter for the batch: repetition penalty on every token of the prompt and
    the output, frequency and presence penalties on the output's, the bias, the masked stops.
    """
    cells: list[tuple[int, int]] = []
    penalty: list[float] = []
    subtract: list[float] = []
    masked: list[bool] = []
    for b, row in enumerate(rows):
        p = row.params
        if not p.processes_logits:
            continue
        # token -> [repetition penalty, amount subtracted (penalties minus bias), masked]
        touched: dict[int, list[Any]] = {}
        if p.repetition_penalty != 1.0:
            for token in {*row.prompt, *row.output}:
                touched[token] = [p.repetition_penalty, 0.0, False]
        if p.frequency_penalty or p.presence_penalty:
            counts: dict[int, int] = {}
            for token in row.output:
                counts[token] = counts.get(token, 0) + 1
            for token, count in counts.items():
                entry = touched.setdefault(token, [1.0, 0.0, False])
                entry[1] += p.frequency_penalty * count + p.presence_penalty
        for token, value in p.logit_bias.items():
            touched.setdefault(token, [1.0, 0.0, False])[1] -= value
        if row.generated < p.min_tokens:
            for token in row.stop_tokens:
                touched.setdefault(token, [1.0, 0.0, False])[2] = True
        for token, (rp, sub, mask) in touched.items():
            cells.append((b, token))
            penalty.append(rp)
            subtract.append(sub)
            masked.append(mask)
    if not cells:
        return logits
    where_rows = mx.array([c[0] for c in cells])
    where_tokens = mx.array([c[1] for c in cells])
    old = logits[where_rows, where_tokens]
    rp = mx.array(penalty, dtype=mx.float32)
    new = mx.where(old > 0, old / rp, old * rp) - mx.array(subtract, dtype=mx.float32)
    new = mx.where(mx.array(masked), -mx.inf, new)
    out = mx.array(logits)
    out[where_rows, where_tokens] = new
    return out


@dataclass(frozen=True, eq=False)
class TokenMasks:
    """The allowed-token masks of a step's constrained rows.

    ``rows`` are the batch rows that have a constraint (increasing); ``packed`` is ``(len(rows),
    words)`` uint32 with ``32 * words`` at least the vocabulary: row ``i``'s token ``t`` is
    allowed when bit ``t % 32`` of word ``t // 32`` is set (``TokenConstraint``'s layout).
    """

    rows: tuple[int, ...]
    packed: mx.array


def apply_token_masks(logits: mx.array, masks: TokenMasks) -> mx.array:
    """``logits (B, V)`` with every token a constrained row's mask forbids at ``-inf``.

    One batched operation over the step: the masks (rows without one allow everything) are
    unpacked a byte at a time into a cap of ``+inf`` (allowed) or ``-inf`` (forbidden) per
    token, and the logits are capped with ``minimum``; elementwise arithmetic only, because
    ``where`` over a large vocabulary is several times slower on MLX's CPU backend. A row
    without a mask keeps its exact values (``minimum(x, +inf) == x``).
    """
    batch, vocab = logits.shape
    packed = masks.packed
    words = packed.shape[-1]
    if words * 32 < vocab:
        raise ValueError(f"token masks of {words} words cannot cover a vocabulary of {vocab}")
    if masks.rows != tuple(range(batch)):
        full = mx.full((batch, words), 0xFFFFFFFF, dtype=mx.uint32)
        full[mx.array(masks.rows, dtype=mx.int32)] = packed
        packed = full
    # Little-endian words: byte k of word w holds tokens 32 w + 8 k .. 32 w + 8 k + 7.
    # (Made here, not at import: an MLX array belongs to the stream of the thread that made it.)
    shifts = mx.arange(8, dtype=mx.uint8)
    octets = packed.view(mx.uint8)
    bits = mx.right_shift(octets[:, :, None], shifts[None, None, :]) & mx.array(1, mx.uint8)
    allowed = bits.reshape(batch, words * 32)[:, :vocab].astype(logits.dtype)
    return mx.minimum(logits, (allowed * 2 - 1) * mx.inf)


@dataclass(frozen=True, eq=False)
class SampledTokens:
    """What one batch's sampling left, lazy until evaluated with the step.

    ``tokens`` ``(B,)``; for the rows in ``logprob_rows``, the chosen tokens' logprobs and the
    ``width`` most likely alternatives (ids and logprobs, most likely first). Evaluate
    :meth:`arrays` with the step, then read :meth:`logprobs`.
    """

    tokens: mx.array
    logprob_rows: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    chosen: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """Every lazy array, to evaluate in the step's one ``mx.eval``."""
        parts = [self.tokens]
        for extra in (self.chosen, self.top_ids, self.top_logprobs):
            if extra is not None:
                parts.append(extra)
        return parts

    def token_list(self) -> list[int]:
        """The tokens on the host (after evaluation)."""
        return cast(list[int], self.tokens.tolist())

    def logprobs(self) -> list[TokenLogprob | None]:
        """Each row's :class:`TokenLogprob` (``None`` for rows that did not ask)."""
        out: list[TokenLogprob | None] = [None] * self.tokens.shape[0]
        if not self.logprob_rows or self.chosen is None:
            return out
        tokens = self.token_list()
        chosen = cast(list[float], self.chosen.tolist())
        ids: list[list[int]] = (
            cast(list[list[int]], self.top_ids.tolist()) if self.top_ids is not None else []
        )
        lps: list[list[float]] = (
            cast(list[list[float]], self.top_logprobs.tolist())
            if self.top_logprobs is not None
            else []
        )
        for i, (b, width) in enumerate(zip(self.logprob_rows, self.widths, strict=True)):
            top = tuple(zip(ids[i][:width], lps[i][:width], strict=True)) if width else ()
            out[b] = TokenLogprob(token=tokens[b], logprob=chosen[i], top=top)
        return out


#: Tokens per block of :func:`top_candidates` (a row's largest entries lie in the blocks with
#: the largest maxima).
_BLOCK = 256


def top_candidates(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest entries of each row of ``x (R, V)``, largest first, and their ids.

    Exact: the ``k`` largest entries lie in the ``k`` blocks of ``_BLOCK`` entries with the
    largest maxima, so only those blocks are partitioned (one pass over the row for the block
    maxima instead of a partition of the whole row). Rows with fewer than ``k`` finite
    entries list ``-inf`` values last (their ids are then arbitrary).
    """
    rows, vocab = x.shape
    k = max(1, min(k, vocab))
    blocks = -(-vocab // _BLOCK)
    if k * 4 >= blocks:
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(x, ids, axis=-1)
    else:
        pad = blocks * _BLOCK - vocab
        padded = mx.pad(x, [(0, 0), (0, pad)], constant_values=-math.inf) if pad else x
        grid = padded.reshape(rows, blocks, _BLOCK)
        best = mx.argpartition(-mx.max(grid, axis=-1), kth=k - 1, axis=-1)[:, :k]
        candidates = mx.take_along_axis(grid, best[:, :, None], axis=1).reshape(rows, -1)
        offsets = mx.arange(_BLOCK, dtype=best.dtype)[None, None, :]
        candidate_ids = (best[:, :, None] * _BLOCK + offsets).reshape(rows, -1)
        pick = mx.argpartition(-candidates, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(candidates, pick, axis=-1)
        ids = mx.minimum(mx.take_along_axis(candidate_ids, pick, axis=-1), vocab - 1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


def log_softmax_top(
    logits: mx.array, targets: mx.array, width: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Logprobs of ``targets`` under each row of ``logits`` and the ``width`` most likely.

    ``logits (R, V)`` (any float dtype), ``targets (R,)``; returns ``(chosen (R,), ids (R,
    width), logprobs (R, width))`` with the alternatives most likely first (``None`` for
    ``width == 0``).
    """
    raw = logits.astype(mx.float32)
    peak = mx.max(raw, axis=-1, keepdims=True)
    total = mx.sum(exp_nonpositive(raw - peak), axis=-1, keepdims=True)
    logprobs = raw - (peak + mx.log(total))
    chosen = mx.take_along_axis(logprobs, targets[:, None].astype(mx.int32), axis=-1)[:, 0]
    if width == 0:
        return chosen, None, None
    values, ids = top_candidates(logprobs, width)
    return chosen, ids, values


class Sampler:
    """Turns a batch's last-position logits into tokens, one :class:`SamplingRow` per row.

    Rows without a seed draw from the sampler's own stream (seeded once); a step that is
    rolled back puts the stream back with :meth:`restore` so a retry samples the same.
    ``agree`` (tensor-parallel ranks) replaces each batch's sampled tokens with the leader
    rank's before anything reads them.
    """

    def __init__(self, seed: int, *, agree: Callable[[mx.array], mx.array] | None = None) -> None:
        self._key = mx.random.key(seed)
        self._agree = agree

    def save(self) -> mx.array:
        """The stream's state now (for :meth:`restore`)."""
        return self._key

    def restore(self, saved: mx.array) -> None:
        """Put the stream back where :meth:`save` found it."""
        self._key = saved

    def picked(self, tokens: mx.array) -> SampledTokens:
        """The batch's greedy ``tokens``, picked without logits (every row :func:`plain_greedy`).

        What :meth:`sample` gives for such rows: the tokens (the leader rank's under
        ``agree``), no logprobs, the stream untouched.
        """
        if self._agree is not None:
            tokens = self._agree(tokens)
        return SampledTokens(tokens=tokens)

    def sample(
        self, logits: mx.array, rows: Sequence[SamplingRow], masks: TokenMasks | None = None
    ) -> SampledTokens:
        """The batch's next tokens and asked-for logprobs (lazy) for ``(B, vocab)`` logits.

        ``masks`` restrict the constrained rows to the tokens their masks allow (after the
        penalties and the bias; logprobs stay those of the model's own distribution).
        """
        raw = logits.astype(mx.float32)
        processed = _process(raw, rows)
        if masks is not None and masks.rows:
            processed = apply_token_masks(processed, masks)
        tokens = mx.argmax(processed, axis=-1)
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            tokens = self._draw(processed, tokens, rows, sampled)
        if self._agree is not None:
            tokens = self._agree(tokens)
        asking = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
        if not asking:
            return SampledTokens(tokens=tokens)
        widths = tuple(cast(int, rows[b].params.logprobs) for b in asking)
        index = mx.array(asking)
        chosen, ids, values = log_softmax_top(raw[index], tokens[index], max(widths))
        return SampledTokens(
            tokens=tokens,
            logprob_rows=tuple(asking),
            widths=widths,
            chosen=chosen,
            top_ids=ids,
            top_logprobs=values,
        )

    def verify_draft(
        self, logits: mx.array, draft: Sequence[int], rows: Sequence[SamplingRow]
    ) -> tuple[int, int]:
        """Speculative sampling of one request: how many ``draft`` tokens stay, and the next.

        ``logits`` ``(k + 1, vocab)`` are the model's at the request's last token and at each
        of the ``k`` draft tokens; ``rows[i]`` samples position ``i`` (a row without
        penalties, bias or ``min_tokens``). The draft is deterministic (a proposal, or a
        draft model's greedy tokens), so token ``i`` stays with probability ``p_i(draft[i])``
        under the row's own distribution (temperature, ``top_k``, ``top_p``, ``min_p``); at
        the first one that does not, the next token is drawn from ``p_i`` without it
        (renormalised), and after a wholly kept draft from ``p_k``: each emitted token is
        distributed exactly as plain sampling's. A seeded row draws from its own key of each
        token index (two numbers a position); the others from the sampler's stream.
        """
        k = len(draft)
        cut = _cut(logits.astype(mx.float32), rows)
        weights = exp_nonpositive(cut - mx.max(cut, axis=-1, keepdims=True))
        probs = weights / mx.sum(weights, axis=-1, keepdims=True)
        uniforms = self._pair_uniforms(rows)
        if k:
            kept = probs[mx.arange(k), mx.array(list(draft), dtype=mx.int32)]
            stays = cast(list[bool], (uniforms[:k, 0] < kept).tolist())
            accepted = next((i for i, ok in enumerate(stays) if not ok), k)
        else:
            accepted = 0
        row = weights[accepted]
        if accepted < k:
            row = mx.where(mx.arange(row.shape[-1]) == draft[accepted], 0.0, row)
        token = cast(list[int], _pick(row[None], uniforms[accepted, 1][None]).tolist())[0]
        return accepted, token

    def _pair_uniforms(self, rows: Sequence[SamplingRow]) -> mx.array:
        """``(len(rows), 2)`` uniform numbers: a seeded row's from its token's key."""
        if rows and rows[0].seed is not None:
            pairs = [
                mx.random.uniform(shape=(2,), key=token_key(cast(int, r.seed), r.generated))
                for r in rows
            ]
            return mx.stack(pairs)
        self._key, key = mx.random.split(self._key)
        return mx.random.uniform(shape=(len(rows), 2), key=key)

    def _draw(
        self,
        processed: mx.array,
        greedy: mx.array,
        rows: Sequence[SamplingRow],
        sampled: list[int],
    ) -> mx.array:
        """``greedy`` with the sampled rows' tokens drawn in their place.

        Inverse transform sampling: one uniform number per row, compared with the running sum
        of the row's kept probabilities (exact; a seeded row's token depends on its own
        logits and key only). Rows with a ``top_k`` draw among their candidates (largest
        first); the others over the vocabulary, in its order.
        """
        uniforms = self._uniforms(rows, sampled)
        tokens = mx.array(greedy)
        by_k = [i for i, b in enumerate(sampled) if rows[b].params.top_k > 0]
        whole = [i for i, b in enumerate(sampled) if rows[b].params.top_k == 0]
        for group, draw in ((by_k, _draw_candidates), (whole, _draw_vocabulary)):
            if not group:
                continue
            index = mx.array([sampled[i] for i in group])
            picks = draw(
                processed[index], [rows[sampled[i]] for i in group], uniforms[mx.array(group)]
            )
            tokens[index] = picks.astype(greedy.dtype)
        return tokens

    def _uniforms(self, rows: Sequence[SamplingRow], sampled: list[int]) -> mx.array:
        """One uniform number per sampled row: its seed's key, or the sampler's stream."""
        draws: list[Any] = [None] * len(sampled)
        shared = [i for i, b in enumerate(sampled) if rows[b].seed is None]
        if shared:
            self._key, key = mx.random.split(self._key)
            values = mx.random.uniform(shape=(len(shared),), key=key)
            for j, i in enumerate(shared):
                draws[i] = values[j]
        for i, b in enumerate(sampled):
            seed = rows[b].seed
            if seed is not None:
                draws[i] = mx.random.uniform(key=token_key(seed, rows[b].generated))
        return mx.stack(draws)


def _pick(weights: mx.array, uniforms: mx.array) -> mx.array:
    """The position where each row's running sum of ``weights`` passes ``uniforms`` of it."""
    running = mx.cumsum(weights, axis=-1)
    below = mx.sum(running <= uniforms[:, None] * running[:, -1:], axis=-1)
    return mx.minimum(below, running.shape[-1] - 1)


def _draw_vocabulary(logits: mx.array, rows: Sequence[SamplingRow], uniforms: mx.array) -> mx.array:
    """Tokens of rows without ``top_k``: the cut logits over the whole vocabulary."""
    cut = _cut(logits, rows)
    return _pick(exp_nonpositive(cut - mx.max(cut, axis=-1, keepdims=True)), uniforms)


def _draw_candidates(logits: mx.array, rows: Sequence[SamplingRow], uniforms: mx.array) -> mx.array:
    """Tokens of rows with a ``top_k``: among each row's ``top_k`` largest, cut further.

    ``top_p`` renormalises over the row's candidates (then keeps the smallest set that
    reaches it), ``min_p`` compares with the largest; the candidates are found once for the
    largest ``top_k`` of the rows.
    """
    params = [r.params for r in rows]
    temperatures = mx.array([p.temperature or 1.0 for p in params], dtype=mx.float32)
    scaled = logits / temperatures[:, None]
    values, ids = top_candidates(scaled, max(p.top_k for p in params))
    width = values.shape[-1]
    kept = mx.arange(width)[None, :] < mx.array([min(p.top_k, width) for p in params])[:, None]
    weights = exp_nonpositive(mx.where(kept, values, -mx.inf) - values[:, :1])
    if any(p.top_p < 1.0 for p in params):
        probs = weights / mx.sum(weights, axis=-1, keepdims=True)
        before = mx.cumsum(probs, axis=-1) - probs
        tops = mx.array([p.top_p for p in params], dtype=mx.float32)[:, None]
        weights = mx.where(before < tops, weights, 0.0)
    if any(p.min_p > 0 for p in params):
        floor = mx.array([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
        weights = mx.where(values - values[:, :1] >= floor[:, None], weights, 0.0)
    picks = _pick(weights, uniforms)
    return mx.take_along_axis(ids, picks[:, None], axis=-1)[:, 0]
