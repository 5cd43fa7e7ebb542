"""Token constraints (structured output) inside the engine's batch, against independent oracles.

The constraint here is plain Python (a set of allowed tokens that depends on the tokens taken
so far), so the checks share no code with a grammar library:

- the batched mask application equals a plain-numpy masking of the same logits (hypothesis);
- a constrained greedy row equals mlx-lm's own logits, argmax over the allowed set, step by
  step; every constrained sequence (greedy, sampled, each of ``n``) takes only allowed tokens
  and ends with ``"stop"`` when its constraint says it is complete;
- greedy free rows are token for token the same with and without constrained neighbours (and
  equal mlx-lm alone); a step with no constrained row fills no mask;
- a constraint that raises ends its own request with ``"error"``, nobody else's.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching import DecodeEngine, SamplingParams
from kv_batching._sampling import TokenMasks, apply_token_masks
from kv_protocol import RequestStateError, TokenConstraint, mask_words
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

VOCAB = 96
WINDOW = 8


@cache
def tiny(arch: str = "gemma3_text") -> nn.Module:
    return build_tiny_model(arch, window=WINDOW, vocab_size=VOCAB)


def engine(model: nn.Module, **kwargs: Any) -> DecodeEngine:
    defaults: dict[str, Any] = {
        "max_running": 8,
        "max_context": 160,
        "page_size": 4,
        "prefill_chunk": 8,
    }
    engine: DecodeEngine = build_engine(model, **(defaults | kwargs))
    return engine


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(5 * i + 3 * seed + 2) % VOCAB for i in range(n)]


def allowed_after(taken: list[int], salt: int) -> set[int]:
    """The oracle's rule: a few tokens that depend on how many were taken and the last one."""
    last = taken[-1] if taken else salt
    step = len(taken)
    return {(last * 7 + step * 13 + salt + k * 11) % VOCAB for k in range(4)}


class SetConstraint:
    """Allows the tokens of :func:`allowed_after`; complete after ``length`` tokens."""

    made = 0

    def __init__(self, length: int, salt: int) -> None:
        SetConstraint.made += 1
        self.length = length
        self.salt = salt
        self.taken: list[int] = []

    def fill_next_mask(self, mask: memoryview) -> None:
        words = np.frombuffer(mask, dtype=np.uint32)
        words[:] = 0
        for token in allowed_after(self.taken, self.salt):
            words[token // 32] |= np.uint32(1 << (token % 32))

    def accept_token(self, token: int) -> None:
        if token not in allowed_after(self.taken, self.salt):
            raise ValueError(f"token {token} was not allowed")
        self.taken.append(token)

    @property
    def is_finished(self) -> bool:
        return len(self.taken) >= self.length


def factory(length: int, salt: int) -> Any:
    def make() -> TokenConstraint:
        return SetConstraint(length, salt)

    return make


def obeys(tokens: tuple[int, ...], salt: int) -> bool:
    return all(t in allowed_after(list(tokens[:i]), salt) for i, t in enumerate(tokens))


def masked_greedy(model: nn.Module, ids: list[int], n: int, salt: int) -> list[int]:
    """mlx-lm alone, its own caches: argmax of its logits over the allowed set, n times."""
    return mlx_lm_greedy(model, ids, n, allowed=lambda out: allowed_after(list(out), salt))


# ---------------------------------------------------------------------- the batched mask


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 130),
    data=st.data(),
)
def test_batched_mask_application_equals_numpy_masking(rows: int, vocab: int, data: Any) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    logits[rng.random(size=(rows, vocab)) < 0.1] = -np.inf  # already masked (min_tokens, bias)
    constrained = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    words = mask_words(vocab) + data.draw(st.integers(0, 1))  # a wider mask allows nothing more
    packed = rng.integers(0, 2**32, size=(len(constrained), words), dtype=np.uint64)
    packed = packed.astype(np.uint32)
    masks = TokenMasks(rows=tuple(constrained), packed=mx.array(packed))
    got = np.array(apply_token_masks(mx.array(logits), masks))
    want = logits.copy()
    for i, b in enumerate(constrained):
        for t in range(vocab):
            if not (int(packed[i, t // 32]) >> (t % 32)) & 1:
                want[b, t] = -np.inf
    np.testing.assert_array_equal(got, want)


def test_masks_narrower_than_the_vocabulary_are_refused() -> None:
    masks = TokenMasks(rows=(0,), packed=mx.zeros((1, 1), dtype=mx.uint32))
    with pytest.raises(ValueError, match="cannot cover a vocabulary of 33"):
        apply_token_masks(mx.zeros((1, 33)), masks)


# ---------------------------------------------------------------------- in the engine


def test_a_constrained_greedy_row_is_mlx_lm_argmax_over_the_allowed_tokens() -> None:
    model = tiny()
    p = prompt(9)
    e = engine(model)
    rid = e.submit(p, 30, sampling=SamplingParams(constraint=factory(12, salt=3)))
    e.run()
    out = e.output(rid)
    assert list(out.tokens) == masked_greedy(model, p, 12, salt=3)
    assert out.finish_reason == "stop"


def test_mixed_batches_constrain_only_their_rows_and_leave_greedy_free_rows_unchanged() -> None:
    model = tiny()
    free = [prompt(n, s) for s, n in enumerate((5, 14, 9))]
    constrained = [prompt(n, 10 + s) for s, n in enumerate((7, 11, 4))]
    SetConstraint.made = 0

    mixed = engine(model)
    free_ids = [mixed.submit(p, 10) for p in free]
    sampled_free = mixed.submit(free[0], 10, sampling=SamplingParams(temperature=1.0, seed=5))
    kinds = [
        SamplingParams(constraint=factory(6, salt=1)),
        SamplingParams(temperature=1.0, seed=9, constraint=factory(8, salt=2)),
        SamplingParams(temperature=0.8, top_k=3, seed=1, constraint=factory(5, salt=4)),
    ]
    lengths = [6, 8, 5]
    salts = [1, 2, 4]
    constrained_ids = [
        mixed.submit(p, 20, sampling=params) for p, params in zip(constrained, kinds, strict=True)
    ]
    forked = mixed.submit_n(
        constrained[0],
        20,
        3,
        sampling=SamplingParams(temperature=1.0, seed=3, constraint=factory(7, salt=6)),
    )
    mixed.run()
    assert SetConstraint.made == 3 + 3  # one per sequence, n included

    for rid, length, salt in zip(constrained_ids, lengths, salts, strict=True):
        out = mixed.output(rid)
        assert out.finish_reason == "stop" and len(out.tokens) == length
        assert obeys(out.tokens, salt)
    for rid in forked:
        out = mixed.output(rid)
        assert out.finish_reason == "stop" and len(out.tokens) == 7 and obeys(out.tokens, 6)
    assert mixed.output(sampled_free).finish_reason == "length"
    assert mixed.stats.masks_filled > 0

    alone = engine(model)
    alone_ids = [alone.submit(p, 10) for p in free]
    alone.run()
    assert alone.stats.masks_filled == 0 and alone.stats.mask_seconds == 0.0
    for rid_mixed, rid_alone, p in zip(free_ids, alone_ids, free, strict=True):
        tokens = list(mixed.output(rid_mixed).tokens)
        assert tokens == list(alone.output(rid_alone).tokens)
        assert tokens == mlx_lm_greedy(model, p, 10)


@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2"])
def test_constrained_sequences_of_other_architectures_obey(arch: str) -> None:
    model = tiny(arch)
    e = engine(model)
    ids = [
        e.submit(prompt(6 + i, i), 20, sampling=SamplingParams(constraint=factory(9, salt=i)))
        for i in range(4)
    ]
    e.run()
    for i, rid in enumerate(ids):
        out = e.output(rid)
        assert out.finish_reason == "stop" and obeys(out.tokens, i)
    assert list(e.output(ids[0]).tokens) == masked_greedy(model, prompt(6, 0), 9, salt=0)


class Breaks(SetConstraint):
    """Raises on its ``at``-th token: in ``accept_token`` or in the mask after it."""

    def __init__(self, at: int, where: str) -> None:
        super().__init__(50, 0)
        self.at = at
        self.where = where

    def fill_next_mask(self, mask: memoryview) -> None:
        if self.where == "mask" and len(self.taken) == self.at:
            raise RuntimeError("mask broke")
        super().fill_next_mask(mask)

    def accept_token(self, token: int) -> None:
        if self.where == "accept" and len(self.taken) == self.at:
            raise RuntimeError("accept broke")
        super().accept_token(token)


@pytest.mark.parametrize("where", ["accept", "mask"])
@pytest.mark.parametrize("at", [0, 3])
def test_a_constraint_that_raises_ends_only_its_own_request(where: str, at: int) -> None:
    model = tiny()
    e = engine(model)
    free = e.submit(prompt(8), 12)
    good = e.submit(prompt(6, 2), 30, sampling=SamplingParams(constraint=factory(5, salt=2)))
    bad = e.submit(prompt(7, 1), 30, sampling=SamplingParams(constraint=lambda: Breaks(at, where)))
    e.run()
    out = e.output(bad)
    assert out.finish_reason == "error" and out.error is not None
    assert "broke" in str(out.error)
    assert e.output(good).finish_reason == "stop" and obeys(e.output(good).tokens, 2)
    assert list(e.output(free).tokens) == mlx_lm_greedy(model, prompt(8), 12)
    assert e.pool.memory_report().pages_used == dict.fromkeys(e.pool.memory_report().pages_used, 0)


def test_a_constraint_must_be_a_factory_and_a_failing_factory_queues_nothing() -> None:
    with pytest.raises(RequestStateError, match="constraint must be a factory"):
        SamplingParams(constraint=SetConstraint(3, 0))  # type: ignore[arg-type]

    def broken() -> TokenConstraint:
        raise RuntimeError("no grammar")

    e = engine(tiny())
    with pytest.raises(RequestStateError, match="no grammar"):
        e.submit_n(prompt(5), 4, 2, sampling=SamplingParams(constraint=broken))
    assert e.num_requests == 0 and not e.has_work
