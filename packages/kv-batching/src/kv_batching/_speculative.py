"""Speculative decoding: proposers, the settings, and each request's adaptive proposal length.

A :class:`Proposer` guesses the next tokens of a request from its text; the engine scores a
guess of ``k`` tokens in one forward of ``k + 1`` positions and keeps the longest prefix the
model agrees with, plus the model's own next token, so greedy output is exactly what plain
decoding gives. :class:`NgramProposer` is prompt lookup: the last few tokens are searched for
earlier in the request's own prompt and output, and what followed them there is proposed (no
second model). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kv_protocol import check_int

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "BatchProposer",
    "NgramProposer",
    "Proposer",
    "SpeculationConfig",
    "SpeculationState",
]

#: The most tokens one proposal may hold.
MAX_SPECULATIVE_TOKENS = 16


@runtime_checkable
class Proposer(Protocol):
    """Proposes the continuation of a request's text (an n-gram lookup, a draft model...)."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``tokens`` (the prompt and output so far).

        An empty list proposes nothing: the request decodes one token as usual.
        """
        ...


@runtime_checkable
class BatchProposer(Proposer, Protocol):
    """A proposer that guesses for every speculating request of a step at once.

    The engine calls :meth:`propose_batch` once per decode step with the texts of the
    requests that propose (a draft model then decodes them as one batch) instead of
    :meth:`Proposer.propose` once per request.
    """

    def propose_batch(self, texts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[int]]:
        """For each text, at most ``ks[i]`` tokens guessed to follow it (``[]``: none)."""
        ...


@dataclass(frozen=True, kw_only=True)
class NgramProposer:
    """Prompt lookup: find the text's last ``n`` tokens earlier in it, propose what followed.

    ``n`` runs from ``max_ngram`` down to ``min_ngram``; the most recent earlier occurrence
    of the longest suffix that occurs wins, and up to ``k`` of the tokens after it are
    proposed. Repetitive outputs (rewriting, quoting, code edits) are its workload.
    """

    max_ngram: int = 4
    min_ngram: int = 2
    #: Only the last this many tokens are searched (bounds the host time per step).
    lookback: int = 4096

    def __post_init__(self) -> None:
        check_int(self.min_ngram, "min_ngram", minimum=1)
        check_int(self.max_ngram, "max_ngram", minimum=self.min_ngram)
        check_int(self.lookback, "lookback", minimum=self.max_ngram + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the text's longest matching suffix."""
        text = list(tokens[-self.lookback :])
        size = len(text)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = text[size - n :]
            first = suffix[0]
            # Latest start first; the suffix itself (start size - n) is not a match.
            for start in range(size - n - 1, -1, -1):
                if text[start] == first and text[start : start + n] == suffix:
                    return text[start + n : start + n + k]
        return []


@dataclass(frozen=True, kw_only=True)
class SpeculationConfig:
    """How the engine speculates.

    ``proposer`` guesses; ``num_tokens`` is the longest proposal (``1 ..
    MAX_SPECULATIVE_TOKENS``); a request's own length adapts between 1 and it to how much of
    its proposals the model accepts. ``max_batch``: speculation runs only while at most this
    many requests decode, on models with recurrent state layers whose mixers cannot run a
    step's rows (``kv_batching._ragged_state`` refused them), where each speculating request
    is verified by a forward of its own (which a large batch's shared decode step does more
    cheaply). Everywhere else (attention-only models, and state hybrids whose mixers run a
    request's rows in order) the proposals are verified inside the shared decode step, as
    extra rows of its forward, at any batch size: beside other requests a request verifies
    while at least ``min_acceptance`` of its proposed tokens are accepted
    (:meth:`SpeculationState.pays_in_batch`). A request that had
    ``cooldown_after`` proposals in a row wholly rejected stops proposing for ``cooldown``
    steps. With ``shadow`` (the default), a request decoding beside others speculates only
    once its record pays for the forward a verification costs, and until then its proposals
    are shadowed: compared with the tokens it decodes in the batch, which costs nothing
    (:class:`SpeculationState`); ``shadow=False`` verifies a request's first proposal at once.
    With ``compare_rates`` (the default) the engine also measures, per number of running
    requests, the tokens per second of shared steps that verify proposals and of plain ones,
    and verifies only while that pays (:class:`StepRates`): extra rows cost what this machine
    says they cost, whatever the acceptance.
    """

    proposer: Proposer
    num_tokens: int = 4
    max_batch: int = 2
    cooldown_after: int = 3
    cooldown: int = 8
    shadow: bool = True
    min_acceptance: float = 0.5
    compare_rates: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.proposer, Proposer):
            raise TypeError(
                f"proposer must have a propose(tokens, k) method, got {type(self.proposer)!r}"
            )
        check_int(self.num_tokens, "num_tokens", minimum=1, maximum=MAX_SPECULATIVE_TOKENS)
        check_int(self.max_batch, "max_batch", minimum=1)
        check_int(self.cooldown_after, "cooldown_after", minimum=1)
        check_int(self.cooldown, "cooldown", minimum=0)
        if not isinstance(self.shadow, bool):
            raise TypeError(f"shadow must be a bool, got {self.shadow!r}")
        if not isinstance(self.compare_rates, bool):
            raise TypeError(f"compare_rates must be a bool, got {self.compare_rates!r}")
        rate = self.min_acceptance
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise ValueError(f"min_acceptance must be a number in [0, 1], got {rate!r}")


class SpeculationState:
    """One request's speculation: its proposal length, counts and cooldown.

    :meth:`length` is the next proposal's length; :meth:`record` takes a verification's
    outcome: all accepted grows the length by one (up to the maximum), a partial acceptance
    sets it to the accepted count plus one, none accepted counts toward a cooldown.

    While speculation does not (yet) pay beside the other requests, a proposal can be
    *shadowed* (:meth:`shadow`): nothing is verified, the request decodes in the batch, and
    :meth:`observe` compares the tokens it then emits with the proposal, so its record grows
    at no cost (``shadow_steps`` / ``shadow_accepted``, apart from the verified counts).
    """

    __slots__ = (
        "_k",
        "_limit",
        "_misses",
        "_resting",
        "_shadow",
        "_shadow_kept",
        "accepted",
        "proposed",
        "shadow_accepted",
        "shadow_proposed",
        "shadow_steps",
        "steps",
    )

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._k = limit
        self._misses = 0
        self._resting = 0
        #: Proposed and accepted tokens, and verification steps, of this request.
        self.proposed = 0
        self.accepted = 0
        self.steps = 0
        #: Shadowed proposals and how many of their tokens the request then emitted.
        self.shadow_steps = 0
        self.shadow_proposed = 0
        self.shadow_accepted = 0
        self._shadow: list[int] = []
        self._shadow_kept = 0

    def length(self) -> int:
        """The next proposal's length (0 while cooling down; the caller then counts a step)."""
        if self._resting:
            self._resting -= 1
            return 0
        return self._k

    def pays_at(self, batch: int, *, shadow: bool = True) -> bool:
        """Whether this request's speculation pays beside ``batch - 1`` others decoding.

        A verification costs about one forward; in a batch of ``batch`` the request's share
        of a plain step is ``1 / batch`` of one, so its verifications (and shadowed
        proposals) must emit ``batch + 1`` tokens on average. Alone it always may; beside
        others, not before it has a record (a shadowed proposal gives one for free), or,
        with ``shadow`` off, once before it has one.
        """
        if batch <= 1:
            return True
        steps = self.steps + self.shadow_steps
        if not steps:
            return not shadow
        return 1 + (self.accepted + self.shadow_accepted) / steps >= batch + 1

    def pays_in_batch(self, batch: int, min_acceptance: float, *, shadow: bool = True) -> bool:
        """Whether verifying this request's proposals inside a shared step of ``batch`` pays.

        There a proposal of ``k`` tokens costs ``k`` more rows of the step's forward, not a
        forward of its own: it pays while the share of proposed tokens the model accepts
        (verified and shadowed together) is at least ``min_acceptance``. Alone it always
        may; beside others, not before a record exists (shadowed first), unless ``shadow``
        is off.
        """
        if batch <= 1:
            return True
        # A shadowed proposal still being observed counts with the tokens it has matched:
        # a request whose proposal is being emitted token for token need not wait for its
        # end (a mismatch ends it at once).
        proposed = self.proposed + self.shadow_proposed + self._shadow_kept
        if not proposed:
            return not shadow
        accepted = self.accepted + self.shadow_accepted + self._shadow_kept
        return accepted / proposed >= min_acceptance

    @property
    def shadowing(self) -> bool:
        """Whether a shadowed proposal waits for the request's next tokens."""
        return bool(self._shadow)

    def shadow(self, proposal: list[int]) -> None:
        """Compare ``proposal`` with the tokens the request emits next (nothing verified)."""
        self._shadow = list(proposal)
        self._shadow_kept = 0

    def observe(self, token: int, config: SpeculationConfig) -> None:
        """The request emitted ``token``: score the shadowed proposal against it."""
        if not self._shadow:
            return
        if token == self._shadow[0]:
            self._shadow.pop(0)
            self._shadow_kept += 1
            if self._shadow:
                return
            proposed = self._shadow_kept
        else:
            proposed = self._shadow_kept + len(self._shadow)
        kept = self._shadow_kept
        self._shadow = []
        self._shadow_kept = 0
        self.shadow_steps += 1
        self.shadow_proposed += proposed
        self.shadow_accepted += kept
        self._adapt(proposed, kept, config)

    def record(self, proposed: int, accepted: int, config: SpeculationConfig) -> None:
        """A verification of ``proposed`` tokens kept ``accepted`` of them.

        A shadowed proposal still being observed ends here, scored by the tokens it matched.
        """
        if self._shadow_kept:
            self.shadow_steps += 1
            self.shadow_proposed += self._shadow_kept
            self.shadow_accepted += self._shadow_kept
        self._shadow = []
        self._shadow_kept = 0
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        self._adapt(proposed, accepted, config)

    def _adapt(self, proposed: int, accepted: int, config: SpeculationConfig) -> None:
        if accepted == proposed:
            self._k = min(self._limit, self._k + 1)
            self._misses = 0
            return
        self._k = max(1, accepted + 1)
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._misses >= config.cooldown_after:
            self._misses = 0
            self._resting = config.cooldown


class StepRates:
    """Tokens per second of shared decode steps with and without verification, by batch size.

    The rows a proposal adds cost what the machine makes them cost (on MLX's CPU a matrix
    product's time jumps with its row count), so whether verifying in a step of ``batch``
    requests pays is measured rather than assumed: :meth:`record` keeps an exponentially
    weighted rate of each kind per batch-size class (1, 2-3, 4-7, 8-15, ...: powers of two,
    so a batch that shrinks by one does not start over), and :meth:`verify` says whether the
    next step of that class proposes and verifies: a plain step first (the baseline), then a
    verifying one, then whichever is faster, trying the other after ``explore_every``
    decisions so a rate that changed is noticed. An exploration that leaves the choice as it
    was doubles the class's interval (up to ``explore_max``: a choice that keeps being right
    costs ever fewer steps of the slower kind); one that changes it starts over at
    ``explore_every``.
    """

    __slots__ = ("_explorations", "_explore_every", "_explore_max", "_rates", "_smoothing")

    def __init__(
        self, *, explore_every: int = 16, explore_max: int = 128, smoothing: float = 0.25
    ) -> None:
        self._explore_every = check_int(explore_every, "explore_every", minimum=2)
        self._explore_max = check_int(explore_max, "explore_max", minimum=explore_every)
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self._smoothing = smoothing
        self._rates: dict[tuple[int, bool], float] = {}
        #: Per size class: decisions since the last exploration, the interval, and the
        #: choice an exploration went against (until the next decision reads it).
        self._explorations: dict[int, tuple[int, int, bool | None]] = {}

    @staticmethod
    def size_class(batch: int) -> int:
        """The class ``batch`` running requests are measured in: its highest power of two."""
        return 1 << (max(batch, 1).bit_length() - 1)

    def rate(self, batch: int, verified: bool) -> float | None:
        """The measured tokens per second at ``batch``'s size class, or None."""
        return self._rates.get((self.size_class(batch), verified))

    def interval(self, batch: int) -> int:
        """Decisions between two explorations at ``batch``'s size class now."""
        return self._explorations.get(self.size_class(batch), (0, self._explore_every, None))[1]

    def verify(self, batch: int) -> bool:
        """Whether the next shared step of ``batch`` requests proposes and verifies."""
        batch = self.size_class(batch)
        plain = self._rates.get((batch, False))
        if plain is None:
            return False
        spec = self._rates.get((batch, True))
        if spec is None:
            return True
        better = spec >= plain
        count, interval, explored = self._explorations.get(batch, (0, self._explore_every, None))
        if explored is not None:
            # The exploration's step is measured: did it change the choice?
            same = explored == better
            interval = min(2 * interval, self._explore_max) if same else self._explore_every
        count += 1
        if count >= interval:
            self._explorations[batch] = (0, interval, better)
            return not better
        self._explorations[batch] = (count, interval, None)
        return better

    def record(self, batch: int, verified: bool, tokens: int, seconds: float) -> None:
        """A shared step of ``batch`` requests emitted ``tokens`` in ``seconds``."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        key = (self.size_class(batch), verified)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + self._smoothing * (rate - old)
