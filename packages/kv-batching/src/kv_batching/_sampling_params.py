"""What one request asks of sampling, and the values sampling works on.

:class:`SamplingParams` (checked when made), :class:`TokenLogprob` (what a sampled token comes
back with) and :class:`SamplingRow` (one batch row as the sampler sees it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kv_protocol import RequestStateError, TokenConstraintFactory, as_int, check_int, check_number

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_PENALTY",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "plain_greedy",
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
    the prefix cache: its prompt's logits are computed). ``constraint`` (structured output)
    makes a fresh ``TokenConstraint`` for each generated sequence: only the tokens its mask
    allows are sampled, each sampled token is passed to it, and the sequence finishes
    (``"stop"``) when it says the output is complete.

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
    constraint: TokenConstraintFactory | None = None

    def __post_init__(self) -> None:
        setter = object.__setattr__
        if self.constraint is not None and not callable(self.constraint):
            raise RequestStateError(
                "constraint must be a factory (a callable returning a TokenConstraint), got "
                f"{self.constraint!r}"
            )
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


def plain_greedy(params: SamplingParams) -> bool:
    """Whether a row's token is the plain argmax of the model's logits, nothing else asked.

    Greedy, without penalties, bias or ``min_tokens`` and without logprobs: such a row's
    token may come from a head that picks the argmax itself (``Sampler.picked``).
    """
    return params.greedy and not params.processes_logits and params.logprobs is None


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
    prompt: Collection[int] = ()
    output: Sequence[int] = ()
    stop_tokens: Collection[int] = ()

    @property
    def temperature(self) -> float:
        """The row's temperature (0: greedy)."""
        return self.params.temperature
