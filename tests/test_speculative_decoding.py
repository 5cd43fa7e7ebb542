"""Speculative decoding: greedy tokens equal plain decoding's, whatever the proposals.

The oracle is mlx-lm generating each prompt alone with the model's own caches. Proposals come
from the n-gram proposer (prompt lookup) and from an oracle proposer that knows mlx-lm's
continuation and corrupts it at a chosen place (so every acceptance length, none to all, is
exercised). Architectures: full attention (llama), sliding windows (Gemma 3, gpt-oss, Cohere
2) and recurrent-state hybrids (Qwen3-Next, LFM2, Nemotron-H, Mamba 2, and more verifying in
the shared step). Also: prefix hits,
preemption, quantized pages, the adaptive length and the bad settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_batching import EngineStats, NgramProposer, SpeculationConfig
from kv_batching._speculative import SpeculationState, StepRates
from kv_metal_kernels import ATTENTION_ENV, CpuPagedAttention, ReferencePagedAttention
from kv_protocol import KVCacheError
from kv_serve import DraftModelProposer, EngineDraftProposer, build_engine, draft_speculation
from kv_testing import build_tiny_model, build_zoo_model, mlx_lm_greedy

VOCAB = 128
BASE = [(7 * j + 1) % VOCAB for j in range(30)]
#: Prompts whose continuation repeats what came before (n-gram friendly) and one that does not.
PROMPTS = [
    BASE + BASE[:20],
    [(3 * j + 5) % VOCAB for j in range(12)] * 3,
    [(11 * j + 2) % VOCAB for j in range(23)],
]
MAX_TOKENS = 20
ARCHS = ["llama", "gemma3_text", "gpt_oss", "cohere2", "qwen3_next", "lfm2", "nemotron_h", "mamba2"]


#: A gpt-oss of head_dim 64 (quantized pages need heads the quantization groups tile).
WIDE = "gpt_oss/head_dim=64"


@cache
def model(arch: str) -> nn.Module:
    if arch == WIDE:
        return build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=VOCAB, head_dim=64)
    return build_zoo_model(arch)


@cache
def greedy(arch: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> tuple[int, ...]:
    return tuple(mlx_lm_greedy(model(arch), list(prompt), max_tokens))


@dataclass
class OracleProposer:
    """Proposes mlx-lm's own continuation, wrong from token ``right`` of each proposal on."""

    arch: str
    right: int = 2
    proposals: list[int] = field(default_factory=list)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for prompt in PROMPTS:
            if list(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                truth = list(greedy(self.arch, tuple(prompt), MAX_TOKENS + 16))[done : done + k]
                out = [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(truth)]
                self.proposals.append(len(out))
                return out
        return []


class RaggedProposer(OracleProposer):
    """:class:`OracleProposer` with proposals of 1, 3 and 5 tokens for the three prompts."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for i, prompt in enumerate(PROMPTS):
            if list(tokens[: len(prompt)]) == prompt:
                return super().propose(tokens, min(k, 2 * i + 1))
        return []


def serve(
    arch: str,
    speculative: str | SpeculationConfig | None,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    **kwargs: Any,
) -> tuple[list[tuple[int, ...]], EngineStats]:
    """Each prompt's greedy tokens from one engine (all submitted at once), and its stats."""
    options: dict[str, Any] = {"page_size": 4, "max_context": 128, **kwargs}
    with build_engine(model(arch), speculative=speculative, **options) as engine:
        ids = [engine.submit(list(p), MAX_TOKENS) for p in prompts]
        out = engine.run()
        return [tuple(out[i]) for i in ids], engine.stats


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_speculation_gives_mlx_lm_s_tokens(arch: str) -> None:
    want = [greedy(arch, tuple(p)) for p in PROMPTS]
    one_at_a_time = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=NgramProposer(min_ngram=1), num_tokens=5
    )
    got, stats = serve(arch, one_at_a_time, prompts=PROMPTS[:1])
    assert got == want[:1]
    batched = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=NgramProposer(min_ngram=1), max_batch=3
    )
    got, stats = serve(arch, batched)
    assert got == want
    assert stats.speculative_steps > 0
    assert stats.decode_fallbacks == 0  # no verification failed over to plain decoding


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss", "llama"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_verifying_rows_attend_per_request_or_one_row_each(
    arch: str, grouped: bool, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel with ``attend_queries`` reads a verifying request's pages once for its rows;
    one without it gets one row per query. Both keep mlx-lm's tokens."""
    kernel: type[Any] = ReferencePagedAttention
    if backend == "cpu":
        if CpuPagedAttention().library.handle is None or mx.default_device().type != mx.cpu:
            pytest.skip("the CPU paged attention kernel does not build here")
        kernel = CpuPagedAttention
    monkeypatch.setenv(ATTENTION_ENV, backend)
    queries: list[int] = []
    if grouped:
        original = kernel.attend_queries

        def spy(self: Any, q: Any, *args: Any, **kwargs: Any) -> Any:
            queries.append(q.shape[2])
            return original(self, q, *args, **kwargs)

        monkeypatch.setattr(kernel, "attend_queries", spy)
    else:
        monkeypatch.delattr(kernel, "attend_queries")
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=RaggedProposer(arch, right=3), num_tokens=5
    )
    got, stats = serve(arch, config, max_running=3)
    assert got == [greedy(arch, tuple(p)) for p in PROMPTS]
    assert stats.speculative_steps > 0 and stats.decode_fallbacks == 0
    assert (max(queries) > 1) if grouped else not queries


#: Recurrent-state hybrids whose mixers run a verification's rows inside the shared step:
#: in one call on right-padded rows (mlx-lm's padding contract) or, where a mixer does not
#: keep that contract (Nemotron-H's SSM, OLMo hybrid's convolution) or takes no mask (Mamba,
#: Jamba), one call per group of requests with as many rows.
STATE_ARCHS = [
    "qwen3_next",
    "qwen3_5",
    "lfm2",
    "granitemoehybrid",
    "falcon_h1",
    "kimi_linear",
    "plamo2",
    "gear",
    "nemotron_h",
    "olmo_hybrid",
    "recurrent_gemma",
    "mamba",
    "jamba",
]


def spy_on_decode_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Each batched decode step's tokens per request, recorded as the engine runs."""
    from kv_batching._model_runner import ModelRunner

    steps: list[tuple[int, ...]] = []
    original = ModelRunner.decode

    def spy(self: ModelRunner, reservation: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append(tuple(reservation.n_tokens))
        return original(self, reservation, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", spy)
    return steps


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_state_hybrids_verify_inside_the_shared_step(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests of 1, 3 and 5 proposed tokens (partly wrong: states roll back) and plain rows
    share one forward; the tokens are mlx-lm's."""
    from kv_batching._verification import Verifier

    steps = spy_on_decode_steps(monkeypatch)
    forwards: list[int] = []
    replay_by_forward = Verifier.replay_state

    def spy(self: Verifier, request: Any, *args: Any) -> None:
        forwards.append(request.rid)
        replay_by_forward(self, request, *args)

    monkeypatch.setattr(Verifier, "replay_state", spy)
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=RaggedProposer(arch, right=3), num_tokens=5
    )
    got, stats = serve(arch, config, max_running=3)
    assert got == [greedy(arch, tuple(p)) for p in PROMPTS]
    assert stats.speculative_steps > 0 and stats.decode_fallbacks == 0
    assert stats.speculative_accepted < stats.speculative_proposed  # some rolled back
    assert any(len(step) > 1 and len(set(step)) > 1 for step in steps)
    # Rolled back by running the mixers again on the kept rows, not by forwards of their own.
    assert not forwards


def test_state_hybrids_without_ragged_mixers_verify_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kv_batching._model_surgery import ChangeReport
    from kv_batching._ragged_state import RaggedStateMixers

    def refuse(self: RaggedStateMixers, model: object) -> ChangeReport:
        return ChangeReport(name=self.name, installed=0, reason="refused by the test")

    monkeypatch.setattr(RaggedStateMixers, "install", refuse)
    steps = spy_on_decode_steps(monkeypatch)
    arch = "qwen3_next"
    config = SpeculationConfig(
        shadow=False,
        compare_rates=False,
        proposer=RaggedProposer(arch, right=3),
        num_tokens=5,
        max_batch=3,
    )
    got, stats = serve(arch, config, max_running=3)
    assert got == [greedy(arch, tuple(p)) for p in PROMPTS]
    assert stats.speculative_steps > 0
    assert all(set(step) == {1} for step in steps)  # verified by forwards of their own


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next"])
@pytest.mark.parametrize("right", [0, 1, 3, 8])
def test_every_acceptance_length_keeps_the_tokens(arch: str, right: int) -> None:
    proposer = OracleProposer(arch, right=right)
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=proposer, num_tokens=6, max_batch=3, cooldown=0
    )
    got, stats = serve(arch, config)
    assert got == [greedy(arch, tuple(p)) for p in PROMPTS]
    assert stats.speculative_steps > 0 and proposer.proposals
    assert stats.decode_fallbacks == 0
    rate = stats.acceptance_rate
    assert rate is not None
    if right == 0:
        assert stats.speculative_accepted == 0
    if right >= 6:
        # Every proposal right: each step emits its proposal and one more token.
        assert stats.speculative_accepted == stats.speculative_proposed
        assert stats.speculative_tokens == stats.speculative_proposed + stats.speculative_steps


def test_prefix_hits_preemption_and_quantized_pages() -> None:
    arch = "gpt_oss"
    config = SpeculationConfig(
        shadow=False,
        compare_rates=False,
        proposer=OracleProposer(arch, right=3),
        num_tokens=4,
        max_batch=4,
    )
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]  # the repeats hit the prefix cache
    want = [greedy(arch, tuple(p)) for p in prompts]
    got, stats = serve(arch, config, prompts=prompts, num_pages=24, max_running=4)
    assert got == want
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.speculative_steps
    wide = SpeculationConfig(
        shadow=False,
        compare_rates=False,
        proposer=NgramProposer(min_ngram=1),
        num_tokens=4,
        max_batch=8,
    )
    plain, _ = serve(WIDE, None, prompts=prompts, kv_bits=8)
    quantized, stats = serve(WIDE, wide, prompts=prompts, kv_bits=8)
    assert quantized == plain and stats.speculative_steps


def test_logprob_requests_decode_one_token_at_a_time() -> None:
    from kv_batching import SamplingParams

    arch = "llama"
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=OracleProposer(arch, right=8), max_batch=4
    )
    with build_engine(model(arch), page_size=4, max_context=128, speculative=config) as engine:
        penalised = engine.submit(
            PROMPTS[0], 6, sampling=SamplingParams(temperature=0.8, presence_penalty=0.5)
        )
        scored = engine.submit(PROMPTS[0], 6, sampling=SamplingParams(logprobs=2))
        engine.run()
        assert engine.stats.speculative_steps == 0
        assert engine.output(penalised).proposed_tokens == 0
        assert engine.output(scored).tokens == greedy(arch, tuple(PROMPTS[0]), 6)
    with build_engine(model(arch), page_size=4, max_context=128, speculative=config) as engine:
        rid = engine.submit(PROMPTS[0], 10)
        engine.run()
        out = engine.output(rid)
        assert out.tokens == greedy(arch, tuple(PROMPTS[0]), 10)
        assert out.proposed_tokens > 0 and out.accepted_tokens == out.proposed_tokens


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(KVCacheError, match="num_tokens"):
        SpeculationConfig(proposer=NgramProposer(), num_tokens=0)
    with pytest.raises(KVCacheError, match="num_tokens"):
        SpeculationConfig(proposer=NgramProposer(), num_tokens=100)
    with pytest.raises(TypeError, match="propose"):
        SpeculationConfig(proposer=object())  # type: ignore[arg-type]
    with pytest.raises(KVCacheError, match="speculative must be one of ngram"):
        build_engine(model("llama"), page_size=4, max_context=64, speculative="medusa")
    with pytest.raises(KVCacheError, match="num_tokens"):
        build_engine(
            model("llama"),
            page_size=4,
            max_context=64,
            speculative="ngram",
            num_speculative_tokens=0,
        )
    with pytest.raises(KVCacheError, match="min_ngram"):
        NgramProposer(min_ngram=0)


def lookup_oracle(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """Prompt lookup by brute force: the longest suffix, its latest earlier occurrence."""
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_ngram_proposals_equal_a_brute_force_lookup(
    tokens: list[int], k: int, low: int, extra: int
) -> None:
    proposer = NgramProposer(min_ngram=low, max_ngram=low + extra)
    assert proposer.propose(tokens, k) == lookup_oracle(tokens, k, low, low + extra)


def test_the_proposal_length_adapts_and_cools_down() -> None:
    config = SpeculationConfig(
        shadow=False,
        compare_rates=False,
        proposer=NgramProposer(),
        num_tokens=4,
        cooldown_after=2,
        cooldown=3,
    )
    state = SpeculationState(config.num_tokens)
    assert state.length() == 4
    state.record(4, 1, config)
    assert state.length() == 2  # one accepted: propose two next time
    state.record(2, 2, config)
    assert state.length() == 3  # all accepted: one more
    state.record(3, 0, config)
    state.record(1, 0, config)  # a second wholly rejected proposal in a row: rest
    assert [state.length() for _ in range(4)] == [0, 0, 0, 1]
    assert (state.proposed, state.accepted, state.steps) == (10, 3, 4)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen3_next"])
def test_a_draft_model_proposes_and_the_tokens_stay(arch: str, batched: bool) -> None:
    want = [greedy(arch, tuple(p)) for p in PROMPTS]
    # The same weights: every proposal is the model's own greedy continuation.
    twin = replace(
        draft_speculation(
            build_zoo_model(arch), model(arch), num_tokens=4, max_batch=3, batched=batched
        ),
        shadow=False,
        compare_rates=False,
    )
    got, stats = serve(arch, twin)
    assert got == want
    assert 0 < stats.speculative_accepted == stats.speculative_proposed
    # Other weights: mostly wrong proposals, the same tokens.
    other = replace(
        draft_speculation(build_zoo_model(arch, seed=7), model(arch), max_batch=3, batched=batched),
        shadow=False,
        compare_rates=False,
    )
    got, stats = serve(arch, other)
    assert got == want and stats.speculative_steps > 0
    for config in (twin, other):
        if isinstance(config.proposer, EngineDraftProposer):
            config.proposer.close()


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_the_draft_engine_decodes_a_step_s_proposals_as_one_batch(arch: str) -> None:
    draft = build_zoo_model(arch, seed=3)
    proposer = EngineDraftProposer.build(draft, max_running=4, max_context=128)
    try:
        texts = [list(p) for p in PROMPTS]
        ks = [4, 0, 3]
        got = proposer.propose_batch(texts, ks)
        # The oracle: mlx-lm's greedy decoding of the draft, each text alone.
        want = [
            list(mlx_lm_greedy(draft, t, k)) if k else [] for t, k in zip(texts, ks, strict=True)
        ]
        assert got == want
        # The texts grow (accepted tokens and a correction): the earlier text is a prefix hit.
        grown = [[*t, *g[:1], 5] for t, g in zip(texts, got, strict=True)]
        again = proposer.propose_batch(grown, [2, 2, 2])
        assert again == [list(mlx_lm_greedy(draft, t, 2)) for t in grown]
        engine = proposer.engine
        assert engine.stats.prefix_hit_tokens > 0
        assert engine.num_requests == 0  # every draft request was released
        # A text longer than the draft engine can hold gets no proposal; the others do.
        long = [1] * 5000
        assert proposer.propose_batch([long, texts[0]], [2, 2]) == [[], got[0][:2]]
    finally:
        proposer.close()


def test_the_draft_keeps_its_cache_per_text_and_trims_it() -> None:
    draft = build_zoo_model("llama")
    proposer = DraftModelProposer(draft, max_entries=2)
    text = PROMPTS[0][:20]
    first = proposer.propose(text, 4)
    assert first == list(mlx_lm_greedy(draft, text, 4))
    # The text grew by two accepted tokens and a correction: the kept cache is trimmed.
    grown = [*text, *first[:2], (first[2] + 1) % VOCAB]
    assert proposer.propose(grown, 3) == list(mlx_lm_greedy(draft, grown, 3))
    assert len(proposer._entries) == 1
    for prompt in PROMPTS:
        proposer.propose(prompt, 2)
    assert len(proposer._entries) == 2  # least recently used out


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    from kv_protocol import UnsupportedModelError

    small = build_zoo_model("llama", vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="draft must share"):
        draft_speculation(small, model("llama"))


class FixedProposer:
    """Always proposes the same tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.tokens[:k]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_sampled_speculation_keeps_the_model_s_distribution(arch: str) -> None:
    """Chi-square: the first two tokens' joint law equals the model's, a draft in between
    (on Qwen3-Next, verified in the shared step: a rejected draft puts the recurrent state
    back)."""
    import mlx.core as mx

    from kv_batching import SamplingParams

    vocab, n = 4, 1600
    tiny = build_zoo_model(arch, vocab_size=vocab, seed=3)
    prompt = [1, 2, 3, 0, 1, 2]

    def law(tokens: list[int]) -> list[float]:
        logits = tiny(mx.array([tokens]))[0, -1].astype(mx.float32)
        return cast(list[float], mx.softmax(logits / 0.9).tolist())

    first = law(prompt)
    expected = [first[a] * law([*prompt, a])[b] for a in range(vocab) for b in range(vocab)]
    # Token 2 is proposed after the first: kept with probability p(2), else redrawn without it.
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=FixedProposer([2]), num_tokens=1, max_batch=64
    )
    counts = [0] * (vocab * vocab)
    with build_engine(
        tiny, page_size=4, max_context=32, max_running=64, speculative=config
    ) as engine:
        ids = [
            engine.submit(prompt, 3, sampling=SamplingParams(temperature=0.9, seed=i))
            for i in range(n)
        ]
        out = engine.run()
        assert engine.stats.speculative_steps == n
        assert 0 < engine.stats.speculative_accepted < n
    for i in ids:
        a, b = out[i][:2]
        counts[a * vocab + b] += 1
    chi2 = sum((c - n * e) ** 2 / (n * e) for c, e in zip(counts, expected, strict=True))
    # 15 degrees of freedom: 37.7 is the 0.001 critical value.
    assert chi2 < 37.7, (chi2, counts, [round(n * e) for e in expected])
    # Seeded: the same seed gives the same tokens again.
    with build_engine(
        tiny, page_size=4, max_context=32, max_running=64, speculative=config
    ) as engine:
        again = engine.submit(prompt, 3, sampling=SamplingParams(temperature=0.9, seed=7))
        assert engine.run()[again] == out[ids[7]]


def test_beside_others_a_request_speculates_once_its_shadowed_record_pays() -> None:
    arch = "llama"
    want = [greedy(arch, tuple(p)) for p in PROMPTS[:2]]
    # Right proposals: shadowed first (nothing verified), then verified once the record pays.
    right = SpeculationConfig(proposer=OracleProposer(arch, right=8), num_tokens=4)
    got, stats = serve(arch, right, prompts=PROMPTS[:2])
    assert got == want
    assert stats.speculative_steps and stats.speculative_accepted == stats.speculative_proposed
    # Wrong proposals: their shadows fail, so nothing is verified while both decode.
    wrong = SpeculationConfig(proposer=FixedProposer([0, 0, 0, 0]), num_tokens=4)
    got, stats = serve(arch, wrong, prompts=PROMPTS[:2])
    assert got == want
    assert stats.speculative_steps == 0
    # Without shadows the first proposal of each request is verified beside the other.
    eager = replace(wrong, shadow=False, compare_rates=False)
    got, stats = serve(arch, eager, prompts=PROMPTS[:2])
    assert got == want and stats.speculative_steps >= 2


@given(
    proposal=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    emitted=st.lists(st.integers(0, 5), min_size=6, max_size=6),
)
def test_a_shadowed_proposal_scores_what_the_request_emits(
    proposal: list[int], emitted: list[int]
) -> None:
    config = SpeculationConfig(proposer=NgramProposer(), num_tokens=6)
    state = SpeculationState(6)
    assert not state.pays_at(2) and state.pays_at(2, shadow=False) and state.pays_at(1)
    state.shadow(proposal)
    for token in emitted:
        state.observe(token, config)
    kept = 0  # the oracle: the longest common prefix
    while kept < len(proposal) and proposal[kept] == emitted[kept]:
        kept += 1
    assert not state.shadowing
    assert (state.shadow_steps, state.shadow_accepted) == (1, kept)
    assert (state.steps, state.proposed, state.accepted) == (0, 0, 0)  # nothing verified
    assert state.pays_at(2) == (1 + kept >= 3)
    # Inside a shared step the share of accepted proposed tokens decides.
    assert state.pays_in_batch(1, 1.0)
    assert state.pays_in_batch(2, 0.5) == (kept / len(proposal) >= 0.5)


@given(
    proposal=st.lists(st.integers(0, 5), min_size=2, max_size=6),
    matched=st.integers(0, 5),
    verified=st.tuples(st.integers(1, 6), st.integers(0, 6)),
)
def test_a_shadow_being_emitted_counts_its_matched_tokens(
    proposal: list[int], matched: int, verified: tuple[int, int]
) -> None:
    """Mid-shadow, the tokens matched so far count as accepted; a verification closes it."""
    matched = min(matched, len(proposal) - 1)
    config = SpeculationConfig(proposer=NgramProposer(), num_tokens=6)
    state = SpeculationState(6)
    state.shadow(proposal)
    for token in proposal[:matched]:
        state.observe(token, config)
    assert state.shadowing  # the last proposed token is not emitted yet
    assert state.pays_in_batch(4, 1.0) == (matched > 0)
    assert state.pays_in_batch(4, 0.0) == (matched > 0)  # no record yet without a match
    proposed, accepted = verified[0], min(verified)
    state.record(proposed, accepted, config)
    assert not state.shadowing
    assert (state.shadow_steps, state.shadow_proposed, state.shadow_accepted) == (
        (1, matched, matched) if matched else (0, 0, 0)
    )
    assert (state.steps, state.proposed, state.accepted) == (1, proposed, accepted)
    share = (matched + accepted) / (matched + proposed)
    assert state.pays_in_batch(4, 0.5) == (share >= 0.5)


def test_min_acceptance_must_be_a_rate() -> None:
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="min_acceptance must be a number in"):
            SpeculationConfig(proposer=NgramProposer(), min_acceptance=bad)  # type: ignore[arg-type]
    assert not SpeculationState(4).pays_in_batch(3, 0.5)
    assert SpeculationState(4).pays_in_batch(3, 0.5, shadow=False)


@given(
    steps=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.booleans(),
            st.integers(0, 40),
            st.one_of(st.just(0.0), st.floats(1e-3, 2.0)),
        ),
        max_size=60,
    )
)
def test_step_rates_follow_the_measured_rates(steps: list[tuple[int, bool, int, float]]) -> None:
    rates = StepRates(explore_every=4, explore_max=16, smoothing=0.5)
    oracle: dict[tuple[int, bool], float] = {}  # the same smoothing, by hand
    since: dict[int, int] = {}  # decisions since the last exploration
    every: dict[int, int] = {}  # the interval: 4, doubled while explorations change nothing
    against: dict[int, bool] = {}  # the choice the last exploration went against
    for size, verified, tokens, seconds in steps:
        batch = {1: 1, 2: 2, 3: 2, 4: 4}[size]  # the size classes, by hand
        plain, spec = oracle.get((batch, False)), oracle.get((batch, True))
        if plain is None:
            want = False
        elif spec is None:
            want = True
        else:
            better = spec >= plain
            if batch in against:
                kept = against.pop(batch) == better
                every[batch] = min(2 * every.get(batch, 4), 16) if kept else 4
            since[batch] = since.get(batch, 0) + 1
            want = better
            if since[batch] == every.get(batch, 4):
                since[batch] = 0
                against[batch] = better
                want = not better
        assert rates.verify(size) == want
        assert rates.interval(size) == every.get(batch, 4)
        rates.record(size, verified, tokens, seconds)
        if tokens > 0 and seconds > 0:
            old = oracle.get((batch, verified))
            new = tokens / seconds
            oracle[(batch, verified)] = new if old is None else (old + new) / 2
        for (batch, kind), value in oracle.items():
            assert rates.rate(batch, kind) == pytest.approx(value)


class _SlowVerification(StepRates):
    """Rates as a machine where verifying steps emit fewer tokens a second than plain ones."""

    def record(self, batch: int, verified: bool, tokens: int, seconds: float) -> None:
        super().record(batch, verified, 1 if verified else 100, 1.0)


def _verifier(engine: Any) -> Any:
    """The engine's verifier (it speculates)."""
    verifier = engine._decode_phase.verifier
    assert verifier is not None
    return verifier


def test_speculation_beside_others_stops_where_plain_steps_are_faster() -> None:
    arch = "llama"
    want = [greedy(arch, tuple(p)) for p in PROMPTS]
    config = SpeculationConfig(proposer=OracleProposer(arch, right=8), num_tokens=4, shadow=False)
    engine = build_engine(model(arch), max_running=4, max_context=128, speculative=config)
    _verifier(engine).step_rates = _SlowVerification()
    ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
    engine.run()
    assert [tuple(engine.output(i).tokens) for i in ids] == want
    # Beside others: a plain step, one verifying step per batch size, then one in 16 at most
    # (fewer as explorations keep confirming plain steps).
    decode_steps = engine.stats.decode_steps
    assert 0 < engine.stats.speculative_steps <= 3 * (1 + decode_steps // 16) + 3
    # Where plain steps are slower the proposals are verified.
    engine = build_engine(model(arch), max_running=4, max_context=128, speculative=config)
    ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
    rates = _verifier(engine).step_rates = StepRates()
    for size in (1, 2, 3):
        rates.record(size, False, 1, 1.0)
        rates.record(size, True, 100, 1.0)
    engine.run()
    assert [tuple(engine.output(i).tokens) for i in ids] == want
    assert engine.stats.speculative_steps > 0


def test_compare_rates_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="compare_rates must be a bool"):
        SpeculationConfig(proposer=NgramProposer(), compare_rates=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_a_state_hybrid_s_next_turn_resumes_from_a_snapshot_inside_its_verified_output(
    arch: str,
) -> None:
    """A verification jumps over prefix boundaries; the state at the last one it passes is
    snapshotted (by the mixers alone) as a plain step's would be, so the next turn of the
    conversation reuses as many tokens as without speculation."""
    first = list(PROMPTS[0])
    output = list(greedy(arch, tuple(first)))
    turn = [*first, *output, 5, 6, 7]
    want = greedy(arch, tuple(turn))
    hits = []
    for speculative in (
        None,
        SpeculationConfig(
            shadow=False, compare_rates=False, proposer=OracleProposer(arch, right=8), num_tokens=5
        ),
    ):
        with build_engine(
            model(arch), speculative=speculative, page_size=8, max_context=160, max_running=2
        ) as engine:
            engine.submit(first, MAX_TOKENS)
            engine.run()
            before = engine.stats.prefix_hit_tokens
            rid = engine.submit(turn, MAX_TOKENS)
            engine.run()
            assert tuple(engine.output(rid).tokens) == want
            hits.append(engine.stats.prefix_hit_tokens - before)
            if speculative is not None:
                assert engine.stats.speculative_steps > 0
    assert hits[1] == hits[0] > len(first)
