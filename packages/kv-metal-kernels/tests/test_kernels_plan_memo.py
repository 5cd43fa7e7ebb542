"""Per-step host plans are computed once per input array object and never change results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_metal_kernels._paged_reference as paged_reference
import kv_metal_kernels._scatter as scatter_module
from kv_metal_kernels import ReferencePagedAttention, ReferenceRopeScatter
from kv_protocol import RequestStateError, RopeConfig

PAGE = 4
HKV, RATIO, D = 2, 2, 64
ROPE = RopeConfig(dims=D)


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Replace ``module.name`` by a wrapper that records each call; returns the log."""
    calls: list[int] = []
    original: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


class Layers:
    """Random pools and a page table (one page-table object, as in one sub-pool)."""

    def __init__(self, seed: int, b: int, max_len: int, n_layers: int) -> None:
        rng = np.random.default_rng(seed)
        self.max_pages = -(-max_len // PAGE) + 1
        num_pages = 1 + b * self.max_pages
        perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
        self.page_table = mx.array(perm.reshape(b, self.max_pages))
        shape = (HKV, num_pages * PAGE, D)
        self.pools = [
            (
                mx.array(rng.standard_normal(shape).astype(np.float32)),
                mx.array(rng.standard_normal(shape).astype(np.float32)),
            )
            for _ in range(n_layers)
        ]
        self.qs = [
            mx.array(rng.standard_normal((b, HKV * RATIO, 1, D)).astype(np.float32))
            for _ in range(n_layers)
        ]
        self.num_slots = num_pages * PAGE

    def attend(
        self,
        kernel: ReferencePagedAttention,
        layer: int,
        seq_lens: mx.array,
        window: int | None,
    ) -> np.ndarray:
        k_pool, v_pool = self.pools[layer]
        out = kernel(
            self.qs[layer],
            k_pool,
            v_pool,
            self.page_table,
            seq_lens,
            page_size=PAGE,
            scale=D**-0.5,
            window=window,
        )
        return np.array(out)


RAGGED = [5, 300, 17, 290, 33, 250, 9, 260, 120, 8, 270, 40]


def test_attention_plans_once_per_seq_lens_object(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch, paged_reference, "_plan_buckets")
    layers = Layers(0, len(RAGGED), max(RAGGED), n_layers=1)
    kernel = ReferencePagedAttention()
    seq_lens = mx.array(RAGGED, dtype=mx.int32)
    want = layers.attend(ReferencePagedAttention(), 0, mx.array(RAGGED, dtype=mx.int32), None)
    calls.clear()
    for _ in range(12):
        np.testing.assert_array_equal(layers.attend(kernel, 0, seq_lens, None), want)
    assert len(calls) == 1
    plan = paged_reference._plan_buckets(
        seq_lens, PAGE, layers.max_pages, None, 4, row_work=HKV * RATIO * D
    )
    assert plan.inverse is not None and len(plan.groups) >= 2  # really bucketed
    calls.clear()
    calls.append(1)
    for _ in range(3):
        layers.attend(kernel, 0, seq_lens, 32)  # a sliding layer of the same step
    assert len(calls) == 2
    layers.attend(kernel, 0, seq_lens, None)
    assert len(calls) == 2
    # The next step: a new array object with the same values is planned afresh.
    next_lens = mx.array(RAGGED, dtype=mx.int32)
    for _ in range(12):
        layers.attend(kernel, 0, next_lens, None)
    assert len(calls) == 3


def test_bucket_groups_build_their_pages_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucketed step's layers share each group's pages and mask (one build per group)."""
    calls = counting(monkeypatch, paged_reference, "_visible_pages")
    layers = Layers(1, len(RAGGED), max(RAGGED), n_layers=4)
    seq_lens = mx.array(RAGGED, dtype=mx.int32)
    want = [layers.attend(ReferencePagedAttention(buckets=0), i, seq_lens, None) for i in range(4)]
    kernel = ReferencePagedAttention()
    plan = paged_reference._plan_buckets(
        seq_lens, PAGE, layers.max_pages, None, 4, row_work=HKV * RATIO * D
    )
    assert plan.inverse is not None
    calls.clear()
    for layer in range(4):
        np.testing.assert_allclose(
            layers.attend(kernel, layer, seq_lens, None), want[layer], atol=1e-6
        )
    assert len(calls) == len(plan.groups)


def test_attention_without_buckets_never_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch, paged_reference, "_plan_buckets")
    layers = Layers(1, 3, 20, n_layers=1)
    seq_lens = mx.array([3, 20, 9], dtype=mx.int32)
    layers.attend(ReferencePagedAttention(buckets=0), 0, seq_lens, None)
    assert calls == []


def test_attention_memo_is_bounded_and_replans_evicted_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = counting(monkeypatch, paged_reference, "_plan_buckets")
    # max_len 28 (not 20): seq_lens 9 + 19 = 28 must fit the page table, or it is refused.
    layers = Layers(2, 3, 28, n_layers=1)
    kernel = ReferencePagedAttention()
    arrays = [mx.array([3, 20, 9 + i], dtype=mx.int32) for i in range(20)]
    for arr in arrays:
        layers.attend(kernel, 0, arr, None)
    assert len(calls) == 20
    layers.attend(kernel, 0, arrays[-1], None)
    assert len(calls) == 20
    layers.attend(kernel, 0, arrays[0], None)
    assert len(calls) == 21


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(1, 60), min_size=2, max_size=7),
            st.none() | st.integers(1, 24),
            st.booleans(),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_attention_with_memo_equals_fresh_kernels_bit_for_bit(
    seed: int, steps: list[tuple[list[int], int | None, bool]]
) -> None:
    """Several steps of 3 layers on one kernel object == a new kernel (empty memo) per call."""
    b = max(len(lens) for lens, _, _ in steps)
    layers = Layers(seed, b, 60, n_layers=3)
    kernel = ReferencePagedAttention()
    previous: mx.array | None = None
    for lens, window, reuse_previous in steps:
        lens = (lens * b)[:b]
        if reuse_previous and previous is not None:
            seq_lens = previous  # the same object again, e.g. the next sub-pool's layers
        else:
            seq_lens = mx.array(lens, dtype=mx.int32)
        previous = seq_lens
        for layer in range(3):
            for win in (None, window):
                got = layers.attend(kernel, layer, seq_lens, win)
                fresh_lens = mx.array(np.array(seq_lens))
                want = layers.attend(ReferencePagedAttention(), layer, fresh_lens, win)
                np.testing.assert_array_equal(got, want)


def rope_args(seed: int, t: int, slots: mx.array, num_slots: int) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    return {
        "q": normal(t, HKV * RATIO, D),
        "k": normal(t, HKV, D),
        "v": normal(t, HKV, D),
        "positions": mx.array(rng.integers(0, 500, t).astype(np.int32)),
        "slots": slots,
        "k_pool": normal(HKV, num_slots, D),
        "v_pool": normal(HKV, num_slots, D),
    }


def test_rope_plans_once_per_slots_object(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch, scatter_module, "plan_scatter")
    kernel = ReferenceRopeScatter()
    slots = mx.array([5, -1, 2, 9], dtype=mx.int32)
    for layer in range(12):
        kernel(**rope_args(layer, 4, slots, 16), rope=ROPE)
    assert len(calls) == 1
    # Another sub-pool of the same step (a different pool size) is its own plan.
    for layer in range(3):
        kernel(**rope_args(layer, 4, slots, 12), rope=ROPE)
    assert len(calls) == 2
    # The next step: a new array object with the same values is planned afresh.
    next_slots = mx.array([5, -1, 2, 9], dtype=mx.int32)
    for layer in range(12):
        kernel(**rope_args(layer, 4, next_slots, 16), rope=ROPE)
    assert len(calls) == 3


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_steps=st.integers(1, 4), t=st.integers(1, 6))
def test_rope_with_memo_equals_fresh_kernels_bit_for_bit(seed: int, n_steps: int, t: int) -> None:
    rng = np.random.default_rng(seed)
    kernel = ReferenceRopeScatter()
    num_slots = 16
    for step in range(n_steps):
        raw = rng.permutation(num_slots)[:t].astype(np.int32)
        raw[rng.random(t) < 0.3] = -1
        slots = mx.array(raw)
        for layer in range(3):
            args = rope_args(seed + 7 * step + layer, t, slots, num_slots)
            got = kernel(**args, rope=ROPE)
            want = ReferenceRopeScatter()(**{**args, "slots": mx.array(raw)}, rope=ROPE)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.array(g), np.array(w))


@pytest.mark.parametrize(
    ("bad", "message"),
    [([5, -1, 2, 16], "past the end of the pool"), ([5, -1, 5, 9], "same pool slot 5")],
)
def test_rope_checks_every_new_slots_array(bad: list[int], message: str) -> None:
    kernel = ReferenceRopeScatter()
    good = mx.array([5, -1, 2, 9], dtype=mx.int32)
    for layer in range(3):
        kernel(**rope_args(layer, 4, good, 16), rope=ROPE)
    with pytest.raises(RequestStateError, match=message):
        kernel(**rope_args(0, 4, mx.array(bad, dtype=mx.int32), 16), rope=ROPE)
    # Still raises on every call: a bad array is never stored as planned.
    with pytest.raises(RequestStateError, match=message):
        kernel(**rope_args(1, 4, mx.array(bad, dtype=mx.int32), 16), rope=ROPE)
    # The validated array against a smaller pool is checked again, too.
    with pytest.raises(RequestStateError, match="past the end of the pool"):
        kernel(**rope_args(2, 4, good, 9), rope=ROPE)
    # And a new array with the good values still works after the failures.
    kernel(**rope_args(3, 4, mx.array([5, -1, 2, 9], dtype=mx.int32), 16), rope=ROPE)


def test_buckets_are_chosen_by_the_keys_they_save_against_the_calls_they_add() -> None:
    """Short ragged rows stay one call; long ragged rows split; the plan never reads more."""
    row_work = 8 * 64
    short = mx.array([117, 150, 180, 200, 230, 260, 300, 334] * 2, dtype=mx.int32)
    plan = paged_reference._plan_buckets(short, 16, 64, None, 4, row_work=row_work)
    assert plan.inverse is None  # 3 more calls cost more than the ~1.5k keys they save
    long = mx.array([100, 3600, 200, 3000, 400, 2500, 800, 1800] * 2, dtype=mx.int32)
    plan = paged_reference._plan_buckets(long, 16, 256, None, 4, row_work=row_work)
    assert plan.inverse is not None and len(plan.groups) >= 2
    rows = sorted(int(r) for g in plan.groups for r in np.array(g.rows).tolist())
    assert rows == list(range(16))
    area = sum(len(np.array(g.rows)) * g.n_cols for g in plan.groups)
    assert area <= 0.75 * 16 * plan.n_all
