"""Prefix caching in the engine: reused K/V never change the tokens.

The oracle is mlx-lm generating each prompt alone. Prompts share a system prefix (at a page
boundary and not), run one after another (hits on finished requests' cached pages) and
together (hits on pages a running request holds), on full-only, sliding-window and mixed
models, with a pool small enough to evict cached pages mid-workload.
"""

from __future__ import annotations

import pytest

from kv_serve import build_engine
from kv_testing import build_tiny_model, build_zoo_model, mlx_lm_greedy

VOCAB = 128  # the smallest vocabulary of the models used
MAX_TOKENS = 6


def prompts(system: int, questions: int, seed: int = 0) -> list[list[int]]:
    shared = [(13 * i + 7 + seed) % VOCAB for i in range(system)]
    return [shared + [(31 * q + 5 * j + 3) % VOCAB for j in range(3 + q)] for q in range(questions)]


def models() -> dict[str, object]:
    return {
        "full": build_zoo_model("llama_full"),
        "sliding": build_tiny_model("gemma3_text", window=8),
        "mixed": build_tiny_model("gpt_oss", window=8),
    }


@pytest.mark.parametrize("kind", ["full", "sliding", "mixed"])
@pytest.mark.parametrize(("system", "page_size"), [(24, 4), (21, 4), (30, 6)])
def test_hits_do_not_change_tokens(kind: str, system: int, page_size: int) -> None:
    model = models()[kind]
    batch = prompts(system, 4)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in batch]  # type: ignore[arg-type]
    with build_engine(model, page_size=page_size, max_context=96, prefill_chunk=8) as engine:  # type: ignore[call-overload]
        assert engine.prefix_caching
        # One after another: later requests hit the finished first one's cached pages.
        first = engine.submit(batch[0], MAX_TOKENS)
        engine.run()
        ids = [first] + [engine.submit(p, MAX_TOKENS) for p in batch[1:]]
        out = engine.run()
        assert [out[i] for i in ids] == want
        hit = engine.stats.prefix_hit_tokens
        # Every later request reuses the whole-page part of the shared prefix.
        usable = (system // page_size) * page_size
        assert hit >= 3 * usable > 0
        assert all(n == 0 for n in (engine.memory_report().pages_used or {}).values())


def test_sliding_models_hit_as_often_as_full_ones() -> None:
    hits = {}
    for kind, model in models().items():
        batch = prompts(40, 3, seed=1)
        with build_engine(model, page_size=4, max_context=96, prefill_chunk=16) as engine:  # type: ignore[call-overload]
            for p in batch:
                engine.submit(p, MAX_TOKENS)
                engine.run()
            hits[kind] = engine.stats.prefix_hit_tokens
    assert hits["sliding"] == hits["full"] == hits["mixed"] == 2 * 40


def test_eviction_under_pressure_keeps_tokens_right() -> None:
    model = build_tiny_model("gpt_oss", window=8)
    batch = prompts(16, 3, seed=2) + prompts(20, 3, seed=3) + prompts(16, 2, seed=2)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in batch]
    with build_engine(model, num_pages=24, page_size=4, max_running=2, prefill_chunk=8) as engine:
        ids = [engine.submit(p, MAX_TOKENS) for p in batch]
        out = engine.run()
        assert [out[i] for i in ids] == want
        stats = engine.memory_report().prefix_cache
        assert stats is not None and stats.evictions > 0
        assert stats.hit_tokens == engine.stats.prefix_hit_tokens > 0


def test_opt_out_prefills_whole_prompts() -> None:
    model = build_tiny_model("gpt_oss", window=8)
    batch = prompts(24, 3)
    with build_engine(model, page_size=4, max_context=96, prefix_caching=False) as engine:
        assert not engine.prefix_caching
        for p in batch:
            engine.submit(p, MAX_TOKENS)
            engine.run()
        assert engine.stats.prefix_hit_tokens == 0
    state_model = build_zoo_model("lfm2")
    with build_engine(state_model, page_size=4, max_context=96, prefix_caching=False) as engine:
        assert not engine.prefix_caching and engine.state_snapshot_interval is None
        assert engine.memory_report().state_snapshots is None


def test_memory_report_and_metrics_show_the_cache() -> None:
    model = build_tiny_model("gpt_oss", window=8)
    batch = prompts(24, 3)
    with build_engine(model, page_size=4, max_context=96) as engine:
        for p in batch:
            engine.submit(p, MAX_TOKENS)
            engine.run()
        report = engine.memory_report()
        cache = report.prefix_cache
        assert cache is not None
        assert cache.hit_tokens == engine.stats.prefix_hit_tokens == 2 * 24
        assert cache.queries == 3 and 0 < cache.hit_rate < 1
        # Nothing runs: every page of the finished requests is cached, none is in use.
        assert cache.cached_pages > 0 and report.pool_bytes_used == 0


@pytest.mark.parametrize("kind", ["full", "sliding", "mixed"])
def test_each_output_reports_the_prompt_tokens_its_hit_skipped(kind: str) -> None:
    model = models()[kind]
    first, second = prompts(22, 2)
    with build_engine(model, page_size=4, max_context=96, prefill_chunk=8) as engine:  # type: ignore[call-overload]
        cold = engine.submit(first, MAX_TOKENS)
        engine.run()
        assert engine.output(cold).cached_tokens == 0
        hits_before = engine.stats.prefix_hit_tokens
        warm = engine.submit(second, MAX_TOKENS)
        again = engine.submit(first, MAX_TOKENS)
        engine.run()
        warm_hit = engine.output(warm).cached_tokens
        again_hit = engine.output(again).cached_tokens
        # The shared 22-token system prefix holds five whole 4-token pages; the repeated
        # prompt all its whole pages but the one its last token is in.
        assert warm_hit == 20
        assert again_hit == 4 * ((len(first) - 1) // 4)
        assert engine.stats.prefix_hit_tokens - hits_before == warm_hit + again_hit
        want = mlx_lm_greedy(model, first, MAX_TOKENS)  # type: ignore[arg-type]
        assert list(engine.output(again).tokens) == want == list(engine.output(cold).tokens)
