"""Every sampling field, logprobs and n sequences, against independent oracles.

- logprobs (generated and prompt tokens) equal the log-softmax of mlx-lm's own logits for the
  same prefix, computed by the model alone on its own caches;
- penalties, bias and ``min_tokens`` equal a plain-numpy reference of OpenAI's formulas (and,
  end to end, greedy decoding under them equals mlx-lm alone with the numpy processor);
- the ``top_k`` / ``top_p`` / ``min_p`` cut keeps exactly the tokens a numpy reference keeps;
- ``n`` sequences with a seed equal each seed submitted alone, and share the prompt's pages.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from kv_batching import DecodeEngine, SamplingParams
from kv_batching._sampling import Sampler, SamplingRow, _cut, _process, top_candidates
from kv_protocol import RequestStateError
from kv_serve import build_engine
from kv_testing import build_tiny_model, build_zoo_model, mlx_lm_greedy

WINDOW = 8
VOCAB = 64


@cache
def tiny(arch: str = "gpt_oss") -> nn.Module:
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
    return [(7 * i + 3 * seed + 1) % VOCAB for i in range(n)]


def mlx_lm_logprobs(model: nn.Module, tokens: Sequence[int]) -> np.ndarray:
    """``(len(tokens), vocab)`` log-softmax of mlx-lm's logits, the model alone."""
    caches = make_prompt_cache(model)
    logits = model(mx.array(list(tokens))[None], cache=caches)[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_logprobs_are_the_log_softmax_of_mlx_lm_s_logits() -> None:
    model = tiny()
    widths = [None, 0, 2, 5]
    prompts = [prompt(n, s) for s, n in enumerate((5, 17, 11, 30))]
    e = engine(model)
    ids = [
        e.submit(p, 6, sampling=SamplingParams(logprobs=w))
        for p, w in zip(prompts, widths, strict=True)
    ]
    e.run()
    for rid, p, width in zip(ids, prompts, widths, strict=True):
        out = e.output(rid)
        assert list(out.tokens) == mlx_lm_greedy(model, p, 6)
        if width is None:
            assert out.logprobs is None
            continue
        assert out.logprobs is not None and len(out.logprobs) == 6
        want = mlx_lm_logprobs(model, [*p, *out.tokens[:-1]])[len(p) - 1 :]
        assert e.token_logprobs(rid, 4) == out.logprobs[4:]
        for step, lp in enumerate(out.logprobs):
            row = want[step]
            assert lp.token == out.tokens[step]
            assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4)
            assert len(lp.top) == width
            best = np.argsort(-row)[:width]
            assert [t for t, _ in lp.top] == best.tolist()
            assert [v for _, v in lp.top] == pytest.approx(row[best].tolist(), abs=1e-4)
            # Greedy: the chosen token is the most likely one.
            if width:
                assert lp.top[0][0] == lp.token


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text"])
def test_prompt_logprobs_span_chunks_and_windows_and_skip_the_prefix_cache(arch: str) -> None:
    model = build_tiny_model(arch, window=WINDOW, vocab_size=VOCAB)
    p = prompt(29, 3)
    e = engine(model, prefill_chunk=8)
    plain = e.submit(p, 3)
    e.run()
    asking = e.submit(p, 3, sampling=SamplingParams(prompt_logprobs=3))
    hits = e.stats.prefix_hit_tokens
    e.run()
    assert e.stats.prefix_hit_tokens == hits  # computed, not reused
    out = e.output(asking)
    assert out.tokens == e.output(plain).tokens
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(p)
    assert out.prompt_logprobs[0] is None
    want = mlx_lm_logprobs(model, p)
    for j in range(1, len(p)):
        lp = out.prompt_logprobs[j]
        assert lp is not None and lp.token == p[j]
        assert lp.logprob == pytest.approx(float(want[j - 1, p[j]]), abs=1e-4)
        assert [t for t, _ in lp.top] == np.argsort(-want[j - 1])[:3].tolist()
    # A later request still reuses what the asking one wrote.
    again = e.submit([*p, 9], 2)
    e.run()
    assert e.stats.prefix_hit_tokens > hits
    assert list(e.output(again).tokens) == mlx_lm_greedy(model, [*p, 9], 2)


# ---------------------------------------------------------------- the logits processors


def numpy_processed(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """OpenAI's penalties, the multiplicative repetition penalty, bias and min_tokens."""
    p = row.params
    out = logits.astype(np.float64).copy()
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt) | set(row.output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    counts = Counter(row.output)
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias.items():
        out[t] += b
    if row.generated < p.min_tokens:
        for t in row.stop_tokens:
            out[t] = -np.inf
    return out


rows_strategy = st.builds(
    lambda rp, fp, pp, bias, mt, prompt_, output: SamplingRow(
        params=SamplingParams(
            repetition_penalty=rp,
            frequency_penalty=fp,
            presence_penalty=pp,
            logit_bias=bias,
            min_tokens=mt,
        ),
        generated=len(output),
        prompt=prompt_,
        output=output,
        stop_tokens=(3, 5),
    ),
    st.sampled_from([1.0, 0.7, 1.3]),
    st.sampled_from([0.0, 0.5, -1.25, 2.0]),
    st.sampled_from([0.0, 1.0, -0.5]),
    st.dictionaries(st.integers(0, 19), st.sampled_from([-100.0, -3.5, 4.0, 100.0]), max_size=3),
    st.integers(0, 4),
    st.lists(st.integers(0, 19), max_size=6),
    st.lists(st.integers(0, 19), max_size=6),
)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(rows_strategy, min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_penalties_bias_and_min_tokens_equal_the_numpy_formulas(
    rows: list[SamplingRow], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    # One row without any processing rides along and must come out unchanged.
    rows = [*rows, SamplingRow(params=SamplingParams(), generated=0)]
    logits = rng.standard_normal((len(rows), 20)).astype(np.float32) * 3
    got = np.array(_process(mx.array(logits), rows))
    for b, row in enumerate(rows):
        np.testing.assert_allclose(got[b], numpy_processed(logits[b], row), rtol=1e-5, atol=1e-5)


def test_greedy_under_penalties_equals_mlx_lm_alone_with_the_numpy_processor() -> None:
    model = tiny()
    params = SamplingParams(
        frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 2.0}
    )
    prompts = [prompt(9, 1), prompt(14, 2)]
    e = engine(model)
    ids = [e.submit(p, 10, sampling=params) for p in prompts]
    e.run()
    for rid, p in zip(ids, prompts, strict=True):
        caches = make_prompt_cache(model)
        logits = model(mx.array(p)[None], cache=caches)[0, -1]
        out: list[int] = []
        for _ in range(10):
            row = SamplingRow(params=params, generated=len(out), prompt=p, output=out)
            token = int(np.argmax(numpy_processed(np.array(logits.astype(mx.float32)), row)))
            out.append(token)
            logits = model(mx.array([[token]]), cache=caches)[0, -1]
        assert list(e.output(rid).tokens) == out
        assert out != mlx_lm_greedy(model, p, 10)  # the penalties changed something


def test_logit_bias_moves_the_greedy_token() -> None:
    model = tiny()
    p = prompt(12, 4)
    greedy = mlx_lm_greedy(model, p, 1)[0]
    e = engine(model)
    away = e.submit(p, 1, sampling=SamplingParams(logit_bias={greedy: -100}))
    forced = e.submit(p, 3, sampling=SamplingParams(logit_bias={11: 100}))
    e.run()
    assert e.output(away).tokens[0] != greedy
    assert e.output(forced).tokens == (11, 11, 11)


def test_min_tokens_holds_the_stop_tokens_back() -> None:
    model = tiny()
    p = prompt(10, 5)
    first = mlx_lm_greedy(model, p, 1)[0]
    e = engine(model)
    stops = e.submit(p, 8, stop_tokens=[first])
    held = e.submit(p, 8, stop_tokens=[first], sampling=SamplingParams(min_tokens=4))
    e.run()
    assert e.output(stops).tokens == (first,) and e.output(stops).finish_reason == "stop"
    tokens = e.output(held).tokens
    assert first not in tokens[:4] and len(tokens) >= 4


# ---------------------------------------------------------------- top_k, top_p, min_p


def numpy_kept(logits: np.ndarray, params: SamplingParams) -> set[int] | None:
    """The tokens the cut keeps, by numpy in float64; None when the nucleus boundary lies
    within float32 rounding of ``top_p`` (two summation orders may then keep one token more
    or less, and both are right).
    """
    scaled = logits.astype(np.float64) / (params.temperature or 1.0)
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones(len(scaled), dtype=bool)
    k = params.top_k
    if k:
        keep &= scaled >= scaled[order[min(k, len(scaled)) - 1]]
    if params.top_p < 1.0:
        cand = [t for t in order[: k or len(scaled)]]
        probs = np.exp(scaled[cand] - scaled[cand].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        if np.any(np.abs(before - params.top_p) < 1e-5):
            return None
        last = cand[max(int(np.sum(before < params.top_p)) - 1, 0)]
        keep &= scaled >= scaled[last]
    if params.min_p > 0:
        keep &= scaled >= scaled.max() + math.log(params.min_p)
    return {int(t) for t in np.flatnonzero(keep)}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.sampled_from([24, 24, 5000]),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 7]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_the_cut_keeps_what_numpy_keeps_and_draws_only_from_it(
    seed: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # Wide vocabularies take the candidate paths: a flat one (top_p past the first 1024
    # candidates: the whole row is sorted) or a peaked one (the candidates decide).
    spread = 2 if vocab == 24 else float(rng.choice([0.2, 6.0]))
    logits = (rng.standard_normal((3, vocab)) * spread).astype(np.float32)
    rows = [SamplingRow(params=params, generated=0, seed=seed + b) for b in range(3)]
    cut = np.array(_cut(mx.array(logits), rows))
    sampler = Sampler(seed)
    for b in range(3):
        kept = numpy_kept(logits[b], params)
        if kept is not None:
            assert {int(t) for t in np.flatnonzero(np.isfinite(cut[b]))} == kept
    drawn = [int(t) for t in sampler.sample(mx.array(logits), rows).token_list()]
    for b, token in enumerate(drawn):
        kept = numpy_kept(logits[b], params)
        assert kept is None or token in kept


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.sampled_from([7, 300, 2049, 20_000]),
    k=st.sampled_from([1, 5, 40]),
    masked=st.booleans(),
)
def test_top_candidates_are_the_exact_top_k(seed: int, vocab: int, k: int, masked: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, vocab)).astype(np.float32)
    if masked:  # a row with few finite entries (a cut row)
        x[1, 3:] = -np.inf
    values, ids = top_candidates(mx.array(x), k)
    width = min(k, vocab)
    assert values.shape == (3, width) and ids.shape == (3, width)
    got_v, got_i = np.array(values), np.array(ids)
    for b in range(3):
        want = np.sort(x[b])[::-1][:width]
        np.testing.assert_array_equal(got_v[b], want)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(x[b][got_i[b][finite]], want[finite])


def test_a_seeded_row_draws_the_same_in_any_batch() -> None:
    rng = np.random.default_rng(7)
    logits = mx.array(rng.standard_normal((4, 40)).astype(np.float32))
    params = SamplingParams(temperature=1.0, top_k=9, top_p=0.8)
    seeded = SamplingRow(params=params, generated=3, seed=42)
    alone = Sampler(0).sample(logits[2:3], [seeded]).token_list()[0]
    others = [
        SamplingRow(params=SamplingParams(temperature=t, top_k=k), generated=0)
        for t, k in ((1.0, 0), (0.0, 0), (1.5, 20))
    ]
    mixed = Sampler(1).sample(logits, [others[0], others[1], seeded, others[2]]).token_list()
    assert mixed[2] == alone


# ---------------------------------------------------------------- n sequences


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text", "lfm2"])
def test_n_sequences_equal_their_seeds_alone_and_share_the_prompt(arch: str) -> None:
    model = build_zoo_model(arch) if arch == "lfm2" else build_tiny_model(arch, window=WINDOW)
    p = prompt(21, 6)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, logprobs=1)
    e = engine(model)
    ids = e.submit_n(p, 8, 4, sampling=params)
    assert ids == list(range(ids[0], ids[0] + 4))
    e.step()
    e.step()
    e.step()  # 21 prompt tokens in chunks of 8: the prompt is prefilled once
    assert e.stats.prefill_tokens == len(p) and e.num_running == 4
    e.run()
    for i, rid in enumerate(ids):
        alone = engine(model)
        r = alone.submit(p, 8, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=11 + i))
        alone.run()
        assert e.output(rid).tokens == alone.output(r).tokens, i
        logprobs = e.output(rid).logprobs
        assert logprobs is not None and [lp.token for lp in logprobs] == list(e.output(rid).tokens)
    assert len({e.output(r).tokens for r in ids}) > 1  # the streams differ


def test_n_sequences_hold_the_prompt_s_pages_once() -> None:
    model = tiny()
    p = prompt(64, 2)
    e = engine(model, max_context=96, page_size=4, prefill_chunk=64, prefix_caching=False)
    ids = e.submit_n(p, 4, 4, sampling=SamplingParams(temperature=1.0, seed=3))
    e.step()
    used = e.memory_report().pages_used["full"]
    # 64 prompt tokens = 16 full pages, shared; each sequence adds at most one page so far.
    assert e.num_running == 4 and used <= 16 + 4
    e.run()
    assert all(e.output(r).finish_reason == "length" for r in ids)
    assert e.memory_report().pages_used["full"] == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {3: 200}}, r"logit_bias\[3\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_sampling_fields_are_refused_by_name(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(RequestStateError, match=match):
        SamplingParams(**fields)


def test_bad_submits_change_nothing() -> None:
    e = engine(tiny(), num_pages=40)
    before = e.num_requests
    for call, match in (
        (
            lambda: e.submit([1, 2], 4, sampling=SamplingParams(logit_bias={VOCAB: 1.0})),
            "vocabulary",
        ),
        (lambda: e.submit_n([1, 2], 4, 0), "n"),
        (lambda: e.submit_n([1, 2], 120, 30), "n=30 sequences"),
        (lambda: e.submit([1, 2], 4, sampling=SamplingParams(), temperature=1.0), "not both"),
        (lambda: e.token_logprobs(e.submit([1], 1)), "did not ask"),
    ):
        with pytest.raises(RequestStateError, match=match):
            call()
    assert e.num_requests == before + 1  # only the valid submit of the last case
    assert e.submit_n([1, 2], 4, 3) == [before + 1, before + 2, before + 3]
