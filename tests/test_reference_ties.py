"""The oracle's tie check: where two greedy continuations first differ, and whether it is a tie."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kv_testing import build_tiny_model, mlx_lm_greedy
from tools.reference import TIE_ULPS, first_divergence

PROMPT = [3, 17, 5, 41, 8, 22, 9]


def _model_and_reference(n: int = 12) -> tuple[Any, list[int]]:
    model = build_tiny_model("gemma3_text", window=8, seed=5)
    return model, mlx_lm_greedy(model, PROMPT, n)


def test_equal_continuations_have_no_divergence() -> None:
    model, reference = _model_and_reference()
    assert first_divergence(model, PROMPT, reference, list(reference), dtype=mx.float32) is None


def test_a_clearly_worse_token_is_a_mismatch_not_a_tie() -> None:
    model, reference = _model_and_reference()
    k = 4
    logits = model(mx.array([PROMPT + reference[:k]]))[0, -1]
    worst = int(mx.argmin(logits))
    other = [*reference[:k], worst, *reference[k + 1 :]]
    where = first_divergence(model, PROMPT, reference, other, dtype=mx.bfloat16)
    assert where is not None and where.index == k
    assert (where.reference_token, where.other_token) == (reference[k], worst)
    expected_gap = float(logits[reference[k]]) - float(logits[worst])
    assert where.gap == pytest.approx(expected_gap, rel=1e-5)
    assert where.gap > where.tolerance and not where.is_tie


def test_exactly_tied_logits_are_a_tie() -> None:
    model, reference = _model_and_reference()
    k = 3
    vocab = model.args.vocab_size
    top = reference[k]
    twin = vocab - 1 if top != vocab - 1 else vocab - 2
    # Copying the greedy token's row of the output projection (the head, or the embedding
    # when they are tied) onto a later id gives that id the same logit everywhere, and greedy
    # (first maximum) still picks `top`.
    head = getattr(model, "lm_head", None) or model.model.embed_tokens
    table = head.weight
    table[twin] = table[top]
    head.weight = table
    assert mlx_lm_greedy(model, PROMPT, 12) == reference
    other = [*reference[:k], twin, *reference[k + 1 :]]
    where = first_divergence(model, PROMPT, reference, other, dtype=mx.bfloat16)
    assert where is not None and where.index == k and where.other_token == twin
    assert where.gap == 0.0 and where.is_tie


def test_one_side_stopping_early_is_a_mismatch() -> None:
    model, reference = _model_and_reference()
    where = first_divergence(model, PROMPT, reference, reference[:5], dtype=mx.bfloat16)
    assert where is not None and where.index == 5 and not where.is_tie


def test_tolerance_is_ulps_of_the_larger_logit() -> None:
    model, reference = _model_and_reference()
    k = 2
    logits = model(mx.array([PROMPT + reference[:k]]))[0, -1]
    second = int(mx.argsort(logits)[-2])
    other = [*reference[:k], second, *reference[k + 1 :]]
    for dtype, eps in ((mx.bfloat16, 2.0**-7), (mx.float16, 2.0**-10), (mx.float32, 2.0**-23)):
        where = first_divergence(model, PROMPT, reference, other, dtype=dtype)
        assert where is not None
        top = max(abs(float(logits[reference[k]])), abs(float(logits[second])), 1.0)
        assert where.tolerance == pytest.approx(TIE_ULPS * eps * top, rel=1e-5)
