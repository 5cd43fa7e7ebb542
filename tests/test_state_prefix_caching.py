"""Prefix reuse on models with recurrent STATE layers, through state snapshots.

The oracle is mlx-lm generating each prompt alone with the model's own caches (and, for a
restored state, ``kv_testing.mlx_lm_states``: the model's own caches run over that prefix).
Every architecture of the support table is also checked by
``tools.support_table.check_prefix_hits``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kv_batching import DecodeEngine, RequestStatus, is_patched
from kv_batching._state_snapshots import StateSnapshotCache
from kv_protocol import CacheStateError, RequestStateError
from kv_serve import build_engine
from kv_testing import build_zoo_model, mlx_lm_greedy, mlx_lm_states, states_close, zoo_config

VOCAB = 128
MAX_TOKENS = 8
#: A long first prompt; one sharing its start; the next turn of its conversation follows.
FIRST = [(7 * j + 1) % VOCAB for j in range(40)]
SHARED = [*FIRST[:26], 9, 9, 1]


@pytest.mark.parametrize(
    "arch", ["qwen3_next", "lfm2", "nemotron_h", "gear", "recurrent_gemma", "mamba2"]
)
def test_a_hit_resumes_from_the_snapshot_with_mlx_lm_tokens(arch: str) -> None:
    model = build_zoo_model(arch)
    answer = mlx_lm_greedy(model, FIRST, MAX_TOKENS)
    turn = [*FIRST, *answer, 3]
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in (SHARED, turn)]
    with build_engine(
        model, page_size=6, max_context=96, prefill_chunk=64, state_snapshot_interval=12
    ) as engine:
        assert engine.prefix_caching and engine.state_snapshot_interval == 12
        rid = engine.submit(FIRST, MAX_TOKENS)
        assert engine.run()[rid] == answer
        # Chunks end at the snapshot points: every 12 tokens and the prompt's last page
        # boundary (36 of 40), then the rest.
        assert list(engine.stats.prefill_chunk_tokens) == [12, 12, 12, 4]
        kept = engine.memory_report().state_snapshots
        assert kept is not None
        # 12, 24, 36 from prefill; 42, the last boundary its decode passed, when it finished.
        assert (kept.snapshots, kept.stored, kept.hits) == (4, 4, 0)
        per = engine.memory_report().state_bytes_per_request
        assert per is not None and kept.bytes == 4 * per
        ids = [engine.submit(p, MAX_TOKENS) for p in (SHARED, turn)]
        out = engine.run()
        assert [out[i] for i in ids] == want
        after = engine.memory_report().state_snapshots
        assert after is not None and after.hits == 2
        assert after.hit_tokens == engine.stats.prefix_hit_tokens == 24 + 42
        assert engine.memory_report().state_bytes_in_use == 0


def test_restored_state_is_the_state_of_exactly_that_prefix() -> None:
    model = build_zoo_model("qwen3_next")
    with build_engine(
        model, page_size=4, max_context=96, prefill_chunk=64, state_snapshot_interval=8
    ) as engine:
        engine.submit(FIRST, 2)
        engine.run()
        rid = engine.submit(SHARED, 2)
        engine.step()  # admitted with its hit, prefilled past it: check the copy it took
        policy = engine._snapshots
        assert policy is not None
        snapshots = policy.cache
        request = engine._core.requests.get(rid)
        assert request.hashes is not None
        snapshot = snapshots.get(request.hashes.prefix_hash(24))
        assert snapshot is not None and snapshot.position == 24
        assert states_close(snapshot.caches(), mlx_lm_states(model, SHARED[:24]))
        assert not states_close(snapshot.caches(), mlx_lm_states(model, SHARED[:16]))
        engine.run()
        assert engine.stats.prefix_hit_tokens == 24


def test_default_interval_is_a_multiple_of_the_page_size_up_to_256() -> None:
    model = build_zoo_model("lfm2")
    for page_size, interval in ((6, 252), (16, 256), (48, 240), (300, 300)):
        with build_engine(model, page_size=page_size, max_context=600) as engine:
            assert engine.state_snapshot_interval == interval


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state_snapshot_interval": 0}, "state_snapshot_interval must be an int >= 1"),
        ({"state_snapshot_interval": -12}, "state_snapshot_interval must be an int >= 1"),
        ({"state_snapshot_interval": 9}, "is not a multiple of the pool's prefix boundary of 6"),
        ({"state_snapshot_interval": 12.0}, "state_snapshot_interval"),
        ({"state_snapshot_interval": True}, "state_snapshot_interval"),
        ({"state_cache_bytes": -1}, "state_cache_bytes must be an int >= 0"),
        ({"state_cache_bytes": "1GB"}, "state_cache_bytes"),
    ],
)
def test_bad_snapshot_settings_are_refused_before_anything_is_built(
    kwargs: dict[str, Any], message: str
) -> None:
    model = build_zoo_model("gear")  # full, sliding and state layers: some are patched
    with pytest.raises(RequestStateError, match=message):
        build_engine(model, page_size=6, max_context=64, **kwargs)
    assert not is_patched(model)
    with build_engine(model, page_size=6, max_context=64) as engine:
        assert engine.state_snapshot_interval == 252


def test_no_budget_keeps_no_snapshot_and_reuses_nothing() -> None:
    model = build_zoo_model("lfm2")
    want = mlx_lm_greedy(model, SHARED, MAX_TOKENS)
    with build_engine(
        model, page_size=6, max_context=96, state_snapshot_interval=12, state_cache_bytes=0
    ) as engine:
        engine.submit(FIRST, MAX_TOKENS)
        engine.run()
        rid = engine.submit(SHARED, MAX_TOKENS)
        assert engine.run()[rid] == want
        kept = engine.memory_report().state_snapshots
        assert kept is not None and (kept.snapshots, kept.bytes, kept.hits) == (0, 0, 0)
        assert engine.stats.prefix_hit_tokens == 0


def test_budget_evicts_least_recently_used_and_bytes_stay_under_it() -> None:
    model = build_zoo_model("qwen3_next")
    with build_engine(model, page_size=4, max_context=96, state_snapshot_interval=8) as probe:
        probe.submit(FIRST, 1)
        probe.run()
        per = probe.memory_report().state_bytes_per_request
    assert per
    with build_engine(
        model, page_size=4, max_context=96, state_snapshot_interval=8, state_cache_bytes=3 * per
    ) as engine:
        engine.submit(FIRST, 1)
        engine.run()
        kept = engine.memory_report().state_snapshots
        assert kept is not None
        # 8, 16, 24, 32 and 40 (the prompt's end) were taken; the three newest stay.
        assert kept.snapshots == 3 and kept.bytes == 3 * per and kept.evictions == 2
        policy, cache = engine._snapshots, engine.pool.prefix_cache
        assert policy is not None and cache is not None
        snapshots = policy.cache
        hashes = cache.hash_tokens(FIRST)
        held = [p for p in range(8, 41, 8) if hashes.prefix_hash(p) in snapshots]
        assert held == [24, 32, 40]
        # Sharing 26 tokens resumes at 24, still kept.
        rid = engine.submit(SHARED, MAX_TOKENS)
        assert engine.run()[rid] == mlx_lm_greedy(model, SHARED, MAX_TOKENS)
        assert engine.stats.prefix_hit_tokens == 24
        # Sharing 18 would resume at 16, which went first: no hit.
        early = [*FIRST[:18], 5, 5]
        rid = engine.submit(early, MAX_TOKENS)
        assert engine.run()[rid] == mlx_lm_greedy(model, early, MAX_TOKENS)
        assert engine.stats.prefix_hit_tokens == 24
        after = engine.memory_report().state_snapshots
        assert after is not None and after.bytes <= 3 * per and after.snapshots == 3


def test_a_snapshot_goes_when_the_pool_evicts_its_page() -> None:
    model = build_zoo_model("nemotron_h")
    with build_engine(model, page_size=4, max_context=96, state_snapshot_interval=8) as engine:
        engine.submit(FIRST, 2)
        engine.run()
        kept = engine.memory_report().state_snapshots
        assert kept is not None and kept.snapshots == 5
        cache = engine.pool.prefix_cache
        assert cache is not None
        assert cache.drop_cached() > 0  # type: ignore[attr-defined]
        gone = engine.memory_report().state_snapshots
        assert gone is not None and (gone.snapshots, gone.bytes, gone.dropped) == (0, 0, 5)
        rid = engine.submit(SHARED, MAX_TOKENS)
        assert engine.run()[rid] == mlx_lm_greedy(model, SHARED, MAX_TOKENS)
        assert engine.stats.prefix_hit_tokens == 0


def test_a_snapshot_is_kept_only_where_every_sub_pool_holds_its_page() -> None:
    # Two requests decode the same text; the first registers the blocks, finishes, and its
    # pages are evicted. The second's pending snapshot at 12 has no page left to sit on.
    model = build_zoo_model("gear")  # full, sliding and state layers
    prompt = FIRST[:9]
    with build_engine(
        model, page_size=4, max_context=64, prefill_chunk=8, state_snapshot_interval=8
    ) as engine:
        first = engine.submit(prompt, 5)
        engine.step()
        second = engine.submit(prompt, 7)
        for _ in range(16):
            engine.step()
            if engine.output(first).status is RequestStatus.FINISHED:
                break
        assert list(engine.output(first).tokens) == mlx_lm_greedy(model, prompt, 5)
        assert engine.output(second).status is RequestStatus.RUNNING
        cache = engine.pool.prefix_cache
        assert cache is not None
        cache.drop_cached()  # type: ignore[attr-defined]
        assert engine.run()[second] == mlx_lm_greedy(model, prompt, 7)
        policy = engine._snapshots
        assert policy is not None
        hashes = cache.hash_tokens([*prompt, *mlx_lm_greedy(model, prompt, 7)])
        kept = {
            hashes.prefix_hash(n): n for n in (4, 8, 12) if hashes.prefix_hash(n) in policy.cache
        }
        assert sorted(kept.values()) == [8]  # 8 sat on the pages the second request reused
        assert all(cache.holds_prefix(hashes, n) for n in kept.values())


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "jamba"])
def test_a_preempted_request_resumes_from_its_last_snapshot(arch: str) -> None:
    model = build_zoo_model(arch)
    prompts = [[(5 * i + 3 * j + 2) % VOCAB for j in range(n)] for i, n in enumerate((9, 17, 30))]
    want = [mlx_lm_greedy(model, p, 24) for p in prompts]
    prefilled = []
    for caching in (False, True):
        with build_engine(
            model,
            num_pages=24,
            page_size=4,
            max_running=3,
            prefill_chunk=8,
            prefix_caching=caching,
            state_snapshot_interval=8 if caching else None,
        ) as engine:
            ids = [engine.submit(p, 24) for p in prompts]
            out = engine.run()
            assert [out[i] for i in ids] == want
            assert engine.stats.preemptions > 0
            prefilled.append(engine.stats.prefill_tokens)
            if caching:
                kept = engine.memory_report().state_snapshots
                assert kept is not None and kept.hits > 0
                assert engine.stats.prefix_hit_tokens == kept.hit_tokens > 0
    # Re-admitted requests prefilled from their snapshots, not their whole text again.
    assert prefilled[1] < prefilled[0]


def test_restore_undoes_decode_steps_and_decoding_goes_on_as_before() -> None:
    model = build_zoo_model("qwen3_next")
    want = mlx_lm_greedy(model, FIRST, 20)
    with build_engine(
        model, page_size=4, max_context=96, state_snapshot_interval=8, step_snapshots=True
    ) as engine:
        rid = engine.submit(FIRST, 20)
        while len(engine.output(rid).tokens) < 7:
            engine.step()
        length = len(FIRST) + 7 - 1
        engine.restore(rid, length - 1)  # the step snapshot: undo the last decode step
        assert list(engine.output(rid).tokens) == want[:6]
        with pytest.raises(RequestStateError, match="no state snapshot at position"):
            engine.restore(rid, length - 3)  # no snapshot there (and nothing changes)
        assert list(engine.output(rid).tokens) == want[:6]
        while len(engine.output(rid).tokens) < 12:
            engine.step()
        # 48 is a boundary its decode passed (kept at once: a multiple of the interval).
        engine.restore(rid, 48)
        assert list(engine.output(rid).tokens) == want[: 48 - len(FIRST) + 1]
        engine.run()
        assert list(engine.output(rid).tokens) == want
        with pytest.raises(RequestStateError, match="is finished"):
            engine.restore(rid, 48)


def test_restore_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    model = build_zoo_model("lfm2")
    with build_engine(model, page_size=4, max_context=96, step_snapshots=True) as engine:
        rid = engine.submit(FIRST, 10)
        for _ in range(4):
            engine.step()
        before = engine.output(rid).tokens
        length = len(FIRST) + len(before) - 1
        for bad in (len(FIRST) - 1, length + 1):
            with pytest.raises(RequestStateError, match="can be restored to positions"):
                engine.restore(rid, bad)
        with pytest.raises(RequestStateError, match="position"):
            engine.restore(rid, "3")  # type: ignore[arg-type]
        assert engine.output(rid).tokens == before
        assert engine.pool.seq_len(rid) == length  # type: ignore[attr-defined]


def test_restore_trims_the_pages_of_an_attention_model_too() -> None:
    model = build_zoo_model("gemma3_text")  # sliding window 8: the pool must still hold it
    want = mlx_lm_greedy(model, FIRST, 12)
    with build_engine(model, page_size=4, max_context=96) as engine:
        rid = engine.submit(FIRST, 12)
        while len(engine.output(rid).tokens) < 6:
            engine.step()
        engine.restore(rid, len(FIRST) + 4)
        assert list(engine.output(rid).tokens) == want[:5]
        with pytest.raises(CacheStateError):
            engine.restore(rid, len(FIRST))  # its window's pages before that are gone
        assert list(engine.output(rid).tokens) == want[:5]
        engine.run()
        assert list(engine.output(rid).tokens) == want


def wide_heads_model() -> Any:
    """A tiny qwen3_next with 32-wide attention heads (quantized pages need groups of 32)."""
    import mlx_lm.models.qwen3_next as module
    from mlx.utils import tree_map

    config = zoo_config("qwen3_next")
    config["head_dim"] = 32
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    mx.eval(model.parameters())
    return model


def test_quantized_pages_and_state_snapshots_compose() -> None:
    model = wide_heads_model()
    answer_whole: list[list[int]] = []
    for caching in (False, True):
        with build_engine(
            model,
            page_size=6,
            max_context=96,
            prefill_chunk=12,
            kv_bits=8,
            kv_group_size=32,
            prefix_caching=caching,
            state_snapshot_interval=12 if caching else None,
        ) as engine:
            first = engine.submit(FIRST, MAX_TOKENS)
            engine.run()
            rid = engine.submit(SHARED, MAX_TOKENS)
            out = engine.run()
            answer_whole.append([*engine.output(first).tokens, *out[rid]])
            if caching:
                assert engine.stats.prefix_hit_tokens == 24
                kept = engine.memory_report().state_snapshots
                assert kept is not None and kept.hits == 1
                assert engine.memory_report().pool.sub_pools[0].kv_bits == 8
    # The pages are quantized either way; resuming from a snapshot changes no token.
    assert answer_whole[0] == answer_whole[1]


class Interrupt(BaseException):
    """Raised inside a prefill chunk (re-raised by the engine, everything as before)."""


def test_an_interrupted_chunk_puts_the_snapshot_back_and_the_text_is_unchanged() -> None:
    model = build_zoo_model("lfm2")
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in (FIRST, SHARED)]
    calls = 0
    for at in range(1, 12):
        with build_engine(
            model, page_size=4, max_context=96, prefill_chunk=64, state_snapshot_interval=8
        ) as engine:
            real = engine._core.make_prefill_cache
            count = {"n": 0}

            def faulty(*args: Any, _real: Any = real, _count: Any = count, _at: int = at) -> Any:
                _count["n"] += 1
                if _count["n"] == _at * 2:  # two attention layers: a fault mid-chunk
                    raise Interrupt
                return _real(*args)

            engine._core.make_prefill_cache = faulty  # type: ignore[method-assign]
            ids = [engine.submit(FIRST, MAX_TOKENS)]
            interrupted = 0
            while engine.has_work or len(ids) < 2:
                if not engine.has_work:
                    ids.append(engine.submit(SHARED, MAX_TOKENS))
                try:
                    engine.step()
                except Interrupt:
                    interrupted += 1
            calls = max(calls, count["n"])
            assert [list(engine.output(i).tokens) for i in ids] == want, at
            assert interrupted == (1 if count["n"] >= at * 2 else 0)
    assert calls >= 8


def test_engine_without_state_layers_takes_no_snapshots() -> None:
    model = build_zoo_model("gemma3_text")
    with build_engine(model, page_size=4, max_context=64, state_snapshot_interval=8) as engine:
        assert isinstance(engine, DecodeEngine)
        assert engine.state_snapshot_interval is None
        assert engine.memory_report().state_snapshots is None


def test_snapshot_cache_refuses_what_exceeds_its_budget() -> None:
    cache = StateSnapshotCache(10)
    with pytest.raises(RequestStateError, match="state_cache_bytes must be an int >= 0"):
        StateSnapshotCache(-1)
    assert cache.stats().budget_bytes == 10 and len(cache) == 0
