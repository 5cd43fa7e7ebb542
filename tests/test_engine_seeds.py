"""Per-request seeds: a seeded request's samples depend on its seed alone, never on the
batch it shares, on when it joined, or on preemption and re-prefill."""

from __future__ import annotations

from typing import Any

import pytest

from kv_protocol import RequestStateError
from kv_serve import build_engine
from kv_testing import build_tiny_model

VOCAB = 64


def _model() -> Any:
    return build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=VOCAB, seed=2)


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % VOCAB for j in range(n)]


def _alone(seed: int, prompt: list[int], n: int) -> list[int]:
    engine = build_engine(_model(), max_running=1, max_context=96, page_size=4)
    rid = engine.submit(prompt, n, temperature=0.9, top_p=0.95, seed=seed)
    return engine.run()[rid]


def test_a_seeded_request_samples_the_same_in_any_batch() -> None:
    prompt = _prompt(0, 11)
    want = _alone(1234, prompt, 20)
    engine = build_engine(_model(), max_running=4, max_context=96, page_size=4, seed=99)
    others = [engine.submit(_prompt(i, 5 + 4 * i), 20, temperature=1.0) for i in range(1, 4)]
    engine.step()  # the seeded request joins a batch that is already running
    rid = engine.submit(prompt, 20, temperature=0.9, top_p=0.95, seed=1234)
    out = engine.run()
    assert out[rid] == want
    assert all(len(out[o]) == 20 for o in others)


def test_a_seeded_request_survives_preemption_unchanged() -> None:
    prompts = [_prompt(i, 9 + 5 * i) for i in range(4)]
    want = [_alone(500 + i, p, 24) for i, p in enumerate(prompts)]
    # A pool too small for all four at full length: the newest are preempted and re-prefilled.
    engine = build_engine(_model(), num_pages=40, page_size=4, max_running=4)
    ids = [
        engine.submit(p, 24, temperature=0.9, top_p=0.95, seed=500 + i)
        for i, p in enumerate(prompts)
    ]
    out = engine.run()
    assert engine.stats.preemptions > 0
    assert [out[i] for i in ids] == want


def test_different_seeds_give_different_samples() -> None:
    prompt = _prompt(3, 7)
    runs = {seed: tuple(_alone(seed, prompt, 16)) for seed in (1, 2, 3)}
    assert len(set(runs.values())) > 1


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "7"])
def test_a_bad_seed_is_refused_and_nothing_is_queued(seed: object) -> None:
    engine = build_engine(_model(), max_running=1, max_context=32, page_size=4)
    with pytest.raises(RequestStateError, match="seed"):
        engine.submit([1, 2, 3], 4, temperature=1.0, seed=seed)  # type: ignore[arg-type]
    assert not engine.has_work
    assert engine.submit([1, 2, 3], 1) == 0
