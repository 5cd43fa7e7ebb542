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
3. greedy rows take the argmax; sampled rows are scaled by their temperature and cut by
   ``top_k``, ``top_p`` and ``min_p`` as thresholds on the scaled logits (a token tied with the
   cut-off value stays), then drawn by inverse transform sampling with one uniform number per
   row: from the sampler's own stream, or with a seed from the row's own key
   (:func:`token_key`), so a seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import mlx.core as mx

from kv_protocol import RequestStateError, as_int, check_int, check_number, exp_nonpositive

__all__ = [
    "MAX_LOGPROBS",
    "SampledTokens",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "sample_top_p",
    "token_key",
]

#: The most top alternatives one token's logprobs may list.
MAX_LOGPROBS = 20
#: The largest logit bias (OpenAI's range is -100..100).
MAX_LOGIT_BIAS = 100.0
#: Presence and frequency penalties lie in -2..2 (OpenAI's range).
MAX_PENALTY = 2.0


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens; every field is checked at construction.

    ``temperature`` 0 is greedy (``top_k``, ``top_p``, ``min_p`` and ``seed`` then change
    nothing); ``top_p`` in ``(0, 1]``, ``top_k`` >= 0 (0: off), ``min_p`` in ``[0, 1]``
    (tokens less likely than ``min_p`` times the most likely one are dropped; 0: off).
    ``presence_penalty`` and ``frequency_penalty`` in ``[-2, 2]`` act on the generated tokens
    (OpenAI's definition); ``repetition_penalty`` > 0 divides positive and multiplies negative
    logits of every token of the prompt and the output (1: off). ``logit_bias`` maps token ids
    to ``[-100, 100]`` added to their logits. The request's stop tokens cannot be sampled
    before ``min_tokens`` tokens were generated. ``seed`` (``0 .. 2**64 - 1``) gives the
    request its own random stream. ``logprobs`` (``0 .. MAX_LOGPROBS``; ``None``: off) reports
    each generated token's log-probability and that many most likely alternatives;
    ``prompt_logprobs`` the same for every prompt token (such a request is not served from
    the prefix cache: its prompt's logits are computed).

    A bad value raises ``RequestStateError`` (a ``ValueError``) naming the field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        setter = object.__setattr__
        setter(self, "temperature", check_number(self.temperature, "temperature", minimum=0.0))
        setter(
            self,
            "top_p",
            check_number(self.top_p, "top_p", minimum=0.0, maximum=1.0, min_inclusive=False),
        )
        setter(self, "top_k", check_int(self.top_k, "top_k", minimum=0))
        setter(self, "min_p", check_number(self.min_p, "min_p", minimum=0.0, maximum=1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_number(
                getattr(self, name), name, minimum=-MAX_PENALTY, maximum=MAX_PENALTY
            )
            setter(self, name, value)
        setter(
            self,
            "repetition_penalty",
            check_number(
                self.repetition_penalty, "repetition_penalty", minimum=0.0, min_inclusive=False
            ),
        )
        setter(self, "logit_bias", MappingProxyType(_check_bias(self.logit_bias)))
        setter(self, "min_tokens", check_int(self.min_tokens, "min_tokens", minimum=0))
        if self.seed is not None:
            setter(self, "seed", check_int(self.seed, "seed", minimum=0, maximum=2**64 - 1))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setter(self, name, check_int(value, name, minimum=0, maximum=MAX_LOGPROBS))

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely (processed) token."""
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, a bias or ``min_tokens`` changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


def _check_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise RequestStateError(
            f"logit_bias must map token ids to numbers in -100..100, got {bias!r}"
        )
    checked: dict[int, float] = {}
    for token, value in bias.items():
        key = as_int(token)
        if key is None or key < 0:
            raise RequestStateError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        checked[key] = check_number(
            value, f"logit_bias[{key}]", minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS
        )
    return checked


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely alternatives.

    ``top`` holds ``(token id, logprob)`` pairs, most likely first (empty when none were
    asked for). Log-probabilities are of the model's own distribution: before temperature,
    penalties, bias and masks.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class SamplingRow:
    """How one row of a batch samples its next token.

    ``generated`` is the index of the token being sampled (tokens generated so far);
    ``seed`` the row's own stream (``None``: the sampler's); ``history`` the tokens the
    penalties look at: ``prompt`` then ``output`` (for repetition: both; for presence and
    frequency: the output only); ``stop_tokens`` are masked while ``generated <
    params.min_tokens``.
    """

    params: SamplingParams
    generated: int
    seed: int | None = None
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    stop_tokens: Collection[int] = ()

    @property
    def temperature(self) -> float:
        """The row's temperature (0: greedy)."""
        return self.params.temperature


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
        # Sorted values only (thresholds, not indices): the largest top_k is enough unless a
        # row cuts by top_p over the whole vocabulary.
        whole = any(p.top_p < 1.0 and k == 0 for p, k in zip(params, ks, strict=True))
        width = vocab if whole else max(ks)
        if width < vocab:
            part = mx.partition(-scaled, kth=width - 1, axis=-1)[:, :width]
            ranked = -mx.sort(part, axis=-1)
        else:
            ranked = -mx.sort(-scaled, axis=-1)
        positions = mx.arange(width)[None, :]
        kept = mx.array([k or width for k in ks], dtype=mx.int32)[:, None]
        in_k = positions < kept
        if cut_p:
            masked = mx.where(in_k, ranked, -mx.inf)
            weights = exp_nonpositive(masked - masked[:, :1])
            probs = weights / mx.sum(weights, axis=-1, keepdims=True)
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


def _process(logits: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
    """The logits after the rows' penalties, bias and ``min_tokens`` masks (float32)."""
    which = [b for b, r in enumerate(rows) if r.params.processes_logits]
    if not which:
        return logits
    sub = logits[mx.array(which)] if len(which) < len(rows) else logits
    vocab = sub.shape[-1]
    n = len(which)
    prow: list[int] = []
    ptok: list[int] = []
    grow: list[int] = []
    gtok: list[int] = []
    brow: list[int] = []
    btok: list[int] = []
    bval: list[float] = []
    mrow: list[int] = []
    mtok: list[int] = []
    rp: list[float] = []
    freq: list[float] = []
    pres: list[float] = []
    for i, b in enumerate(which):
        row = rows[b]
        p = row.params
        rp.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
        if p.repetition_penalty != 1.0:
            seen = [*row.prompt, *row.output]
            prow.extend([i] * len(seen))
            ptok.extend(seen)
        if p.frequency_penalty or p.presence_penalty:
            grow.extend([i] * len(row.output))
            gtok.extend(row.output)
        for token, value in p.logit_bias.items():
            brow.append(i)
            btok.append(token)
            bval.append(value)
        if row.generated < p.min_tokens:
            stops = list(row.stop_tokens)
            mrow.extend([i] * len(stops))
            mtok.extend(stops)
    out = sub
    if prow:
        seen_mask = mx.zeros((n, vocab), dtype=mx.bool_)
        seen_mask[mx.array(prow), mx.array(ptok)] = True
        penalty = mx.array(rp, dtype=mx.float32)[:, None]
        penalised = mx.where(out > 0, out / penalty, out * penalty)
        out = mx.where(seen_mask, penalised, out)
    if gtok:
        counts = mx.zeros((n, vocab), dtype=mx.float32).at[mx.array(grow), mx.array(gtok)].add(1.0)
        f = mx.array(freq, dtype=mx.float32)[:, None]
        s = mx.array(pres, dtype=mx.float32)[:, None]
        out = out - f * counts - s * (counts > 0).astype(mx.float32)
    if btok:
        out = out.at[mx.array(brow), mx.array(btok)].add(mx.array(bval, dtype=mx.float32))
    if mtok:
        out = out.at[mx.array(mrow), mx.array(mtok)].add(-mx.inf)
    if len(which) == len(rows):
        return out
    full = mx.array(logits)
    full[mx.array(which)] = out
    return full


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
    width = min(width, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=width - 1, axis=-1)[:, :width]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return (
        chosen,
        mx.take_along_axis(ids, order, axis=-1),
        mx.take_along_axis(values, order, axis=-1),
    )


class Sampler:
    """Turns a batch's last-position logits into tokens, one :class:`SamplingRow` per row.

    Rows without a seed draw from the sampler's own stream (seeded once); a step that is
    rolled back puts the stream back with :meth:`restore` so a retry samples the same.
    """

    def __init__(self, seed: int) -> None:
        self._key = mx.random.key(seed)

    def save(self) -> mx.array:
        """The stream's state now (for :meth:`restore`)."""
        return self._key

    def restore(self, saved: mx.array) -> None:
        """Put the stream back where :meth:`save` found it."""
        self._key = saved

    def sample(self, logits: mx.array, rows: Sequence[SamplingRow]) -> SampledTokens:
        """The batch's next tokens and asked-for logprobs (lazy) for ``(B, vocab)`` logits."""
        raw = logits.astype(mx.float32)
        processed = _process(raw, rows)
        tokens = mx.argmax(processed, axis=-1)
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            tokens = self._draw(processed, tokens, rows, sampled)
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

    def _draw(
        self,
        processed: mx.array,
        greedy: mx.array,
        rows: Sequence[SamplingRow],
        sampled: list[int],
    ) -> mx.array:
        """``greedy`` with the sampled rows' tokens drawn in their place.

        Inverse transform sampling: one uniform number per row, compared with the running sum
        of the row's kept probabilities in vocabulary order (exact, and a seeded row's token
        depends on its own logits and key only).
        """
        index = mx.array(sampled)
        cut = _cut(processed[index], [rows[b] for b in sampled])
        weights = exp_nonpositive(cut - mx.max(cut, axis=-1, keepdims=True))
        running = mx.cumsum(weights, axis=-1)
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
        u = mx.stack(draws)[:, None] * running[:, -1:]
        picks = mx.minimum(mx.sum(running <= u, axis=-1), running.shape[-1] - 1)
        tokens = mx.array(greedy)
        tokens[index] = picks.astype(greedy.dtype)
        return tokens
