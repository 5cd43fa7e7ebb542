from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from batching_fakes import (
    CountingPrefillAttention,
    FakeKernels,
    FakeRope,
    fake_prefill_cache,
)
from hypothesis import given
from hypothesis import strategies as st

from kv_batching import DecodeEngine, RequestStatus
from kv_batching._patching import wrapped_attention
from kv_batching._sampling import sample_top_p
from kv_protocol import (
    CacheLayout,
    LayerKind,
    LayerSpec,
    LayoutError,
    RequestStateError,
    UnknownRequestError,
    UnsupportedModelError,
    layout_from_model,
)
from kv_testing import ReferenceKVPool, build_tiny_model, mlx_lm_greedy

PROMPTS = [[(5 * i + 3 * j + 1) % 64 for j in range(n)] for i, n in enumerate((1, 4, 7, 10, 12))]
MAX_TOKENS = 10


@cache
def model() -> Any:
    return build_tiny_model("gpt_oss", window=4, num_layers=4, vocab_size=64)


@cache
def references() -> list[list[int]]:
    return [mlx_lm_greedy(model(), p, MAX_TOKENS) for p in PROMPTS]


def engine(
    *, num_pages: int = 64, page_size: int = 2, rope: Any = None, **kwargs: Any
) -> DecodeEngine:
    pool = ReferenceKVPool(layout_from_model(model()), num_pages=num_pages, page_size=page_size)
    return DecodeEngine(model(), pool, FakeKernels(rope=rope), fake_prefill_cache, **kwargs)


def pool_of(e: DecodeEngine) -> ReferenceKVPool:
    assert isinstance(e.pool, ReferenceKVPool)
    return e.pool


def all_free(e: DecodeEngine) -> bool:
    pool = pool_of(e)
    return all(n == pool.subs[name].num_pages - 1 for name, n in pool.free_pages().items())


@pytest.mark.parametrize("rope", [None, FakeRope()], ids=["unfused", "fused"])
def test_engine_equals_mlx_lm_with_staggered_arrivals(rope: Any) -> None:
    e = engine(rope=rope, prefill_chunk=5)
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS[:2]]
    e.step()
    ids += [e.submit(p, MAX_TOKENS) for p in PROMPTS[2:]]
    out = e.run()
    assert [out[i] for i in ids] == references()
    assert all_free(e)
    assert e.stats.decode_tokens + len(PROMPTS) == len(PROMPTS) * MAX_TOKENS
    assert e.stats.prefill_tokens == sum(len(p) for p in PROMPTS)
    assert all(e.output(i).finish_reason == "length" for i in ids)


def test_prefill_through_the_kernel_sets_prefill_attention() -> None:
    """Chunked prefill through the wrappers' kernel: mlx-lm's tokens, wrappers reset after."""
    counting = CountingPrefillAttention()
    pool = ReferenceKVPool(layout_from_model(model()), num_pages=64, page_size=2)
    kernels = FakeKernels(prefill_attention=counting)
    with DecodeEngine(model(), pool, kernels, fake_prefill_cache, prefill_chunk=5) as e:
        ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
        out = e.run()
        assert [out[i] for i in ids] == references()
        assert counting.calls >= 4 * sum(-(-len(p) // 5) for p in PROMPTS)
        assert all(w.prefill_attention is None for w in wrapped_attention(model()))


def test_stream_yields_every_token_in_order() -> None:
    e = engine()
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
    seen: dict[int, list[int]] = {}
    for rid, token in e.stream():
        seen.setdefault(rid, []).append(token)
    assert [seen[i] for i in ids] == references()


def test_tight_pool_queues_and_preempts_but_never_fails() -> None:
    # 11 usable pages of 2 tokens: one request (<= 22 tokens) fits alone, five do not.
    e = engine(num_pages=12, page_size=2, prefill_chunk=4)
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
    out = e.run()
    assert [out[i] for i in ids] == references()
    assert e.stats.preemptions > 0
    assert max(e.stats.queue_length) > 0
    assert all(e.output(i).finish_reason == "length" for i in ids)
    assert all_free(e)
    peaks = e.stats.peak_pages_used
    assert peaks["full"] <= 11


def test_max_running_caps_the_batch() -> None:
    e = engine(max_running=2)
    ids = [e.submit(p, MAX_TOKENS) for p in PROMPTS]
    out = e.run()
    assert [out[i] for i in ids] == references()
    assert max(e.stats.running) <= 2
    assert max(e.stats.decode_batch_sizes) == 2


def test_request_too_long_for_the_whole_pool_finishes_with_pool_exhausted() -> None:
    e = engine(num_pages=4, page_size=2)
    big = e.submit(list(range(20)), 4)
    small = e.submit([1, 2], 3)
    out = e.run()
    assert e.output(big).finish_reason == "pool_exhausted"
    assert e.output(small).finish_reason == "length" and len(out[small]) == 3
    assert all_free(e)


def test_abort_in_every_state_frees_pages() -> None:
    e = engine(max_running=1, prefill_chunk=2)
    running = e.submit(PROMPTS[1], MAX_TOKENS)
    queued = e.submit(PROMPTS[2], MAX_TOKENS)
    e.step()  # prefills part of `running`
    assert e.output(running).status is RequestStatus.PREFILLING
    assert e.abort(running)
    for _ in range(4):  # 7 prompt tokens in chunks of 2
        assert e.output(queued).status is not RequestStatus.RUNNING
        e.step()
    assert e.output(queued).status is RequestStatus.RUNNING
    assert e.abort(queued)
    assert not e.abort(queued)
    later = e.submit(PROMPTS[0], MAX_TOKENS)
    assert e.abort(later)
    assert not e.has_work and all_free(e)
    assert e.stats.aborted == 3
    assert e.output(queued).finish_reason == "aborted"
    assert e.output(queued).tokens == tuple(references()[2][: len(e.output(queued).tokens)])
    with pytest.raises(UnknownRequestError, match="never submitted"):
        e.abort(99)


def test_stop_tokens_end_a_request_including_the_stop_token() -> None:
    ref = references()[3]
    e = engine()
    rid = e.submit(PROMPTS[3], MAX_TOKENS, stop_tokens={ref[4]})
    out = e.run()
    first = ref.index(ref[4])
    assert out[rid] == ref[: first + 1]
    assert e.output(rid).finish_reason == "stop"


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([], 3), {}, "at least one token"),
        (([1, -2], 3), {}, r"prompt_tokens\[1\] must be an int in 0\.\."),
        (([1], 0), {}, "max_tokens"),
        (([1], 2), {"temperature": -1.0}, "temperature"),
        (([1], 2), {"top_p": 0.0}, "top_p"),
    ],
)
def test_submit_validates(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    e = engine()
    with pytest.raises(RequestStateError, match=match):
        e.submit(*args, **kwargs)
    assert not e.has_work


def test_sampling_is_seeded_and_tiny_top_p_is_greedy() -> None:
    def run(seed: int, **kwargs: Any) -> list[list[int]]:
        e = engine(seed=seed)
        ids = [e.submit(p, MAX_TOKENS, **kwargs) for p in PROMPTS]
        out = e.run()
        return [out[i] for i in ids]

    assert run(0, temperature=1.0, top_p=1e-6) == references()
    assert run(3, temperature=1.5) == run(3, temperature=1.5)
    # A mixed batch: greedy rows stay greedy next to sampled ones.
    e = engine(seed=1)
    greedy = e.submit(PROMPTS[4], MAX_TOKENS)
    e.submit(PROMPTS[3], MAX_TOKENS, temperature=2.0)
    assert e.run()[greedy] == references()[4]


@given(
    logits=st.lists(st.floats(-4, 4), min_size=6, max_size=6),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
)
def test_sample_top_p_stays_in_the_nucleus(logits: list[float], top_p: float, seed: int) -> None:
    row = mx.array([logits])
    token = int(sample_top_p(row, [1.0], [top_p], mx.random.key(seed))[0])
    top = max(logits)
    weights = [math.exp(v - top) for v in logits]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(6), key=lambda i: -probs[i])
    nucleus: list[int] = []
    mass = 0.0
    for i in order:
        if mass >= top_p - 1e-6 and nucleus:
            break
        nucleus.append(i)
        mass += probs[i]
    tied = {i for i in range(6) if any(abs(probs[i] - probs[j]) < 1e-6 for j in nucleus)}
    assert token in set(nucleus) | tied


def test_models_with_state_layers_and_mismatched_pools_are_refused() -> None:
    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.mixer = nn.Linear(4, 4)

    class StateModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.layers = [Recurrent()]

    layout = CacheLayout([LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4)])
    with pytest.raises(LayoutError, match="layer 0: the model has state"):
        DecodeEngine(StateModel(), ReferenceKVPool(layout), FakeKernels(), fake_prefill_cache)
    # A recurrent layer's state comes from the model's make_cache(); without one, refused.
    state_layout = layout_from_model(StateModel())
    with pytest.raises(UnsupportedModelError, match=r"STATE layers \[0\] but no make_cache"):
        DecodeEngine(StateModel(), ReferenceKVPool(state_layout), FakeKernels(), fake_prefill_cache)
    other = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=64)
    with pytest.raises(LayoutError, match="window"):
        DecodeEngine(
            other,
            ReferenceKVPool(layout_from_model(model())),
            FakeKernels(),
            fake_prefill_cache,
        )
    with pytest.raises(RequestStateError, match="max_running"):
        engine(max_running=0)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 6), st.just(0)),
    ),
    max_size=14,
)


@given(ops=operations, num_pages=st.integers(12, 30), max_running=st.integers(1, 4))
def test_random_workloads_keep_every_invariant(
    ops: list[tuple[str, int, int]], num_pages: int, max_running: int
) -> None:
    e = engine(num_pages=num_pages, page_size=2, max_running=max_running, prefill_chunk=3)
    submitted: list[tuple[int, int, int]] = []
    aborted: set[int] = set()
    for op, a, b in ops:
        if op == "submit":
            submitted.append((e.submit(PROMPTS[a], b), a, b))
        elif op == "step":
            for _ in range(a):
                e.step()
                assert e.num_running <= max_running
        elif submitted:
            rid = submitted[a % len(submitted)][0]
            if e.abort(rid):
                aborted.add(rid)
    e.run()
    assert not e.has_work and all_free(e)
    for rid, prompt_index, max_tokens in submitted:
        out = e.output(rid)
        want = references()[prompt_index][:max_tokens]
        if rid in aborted:
            assert out.finish_reason == "aborted"
            assert list(out.tokens) == want[: len(out.tokens)]
        else:
            assert out.finish_reason == "length"
            assert list(out.tokens) == want
