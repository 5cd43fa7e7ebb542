"""Recurrent mixers on a verification step's ragged rows (``kv_batching._ragged_state``).

Oracles: plain-Python index arithmetic for the regrouping, and each request's rows run alone
through the mixer's own (unswapped) call from its own state for the swapped mixers of real
mlx-lm architectures (tiny random weights).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_batching._cache_nesting import CacheNesting
from kv_batching._ragged_state import (
    RAGGED_ROWS_ATTRIBUTE,
    RaggedRows,
    RaggedStateMixers,
    install_ragged_state_mixers,
)
from kv_batching._state_cache import StackedStateCache, model_state_caches
from kv_protocol import layout_from_model
from kv_testing import build_zoo_model

counts_lists = st.lists(st.integers(1, 5), min_size=1, max_size=5)


@given(counts_lists, st.integers(1, 3))
def test_ragged_rows_regroup_each_request_s_rows_in_order(counts: list[int], width: int) -> None:
    rows = RaggedRows.from_counts(counts)
    total = sum(counts)
    x = mx.arange(total * width, dtype=mx.float32).reshape(total, 1, width)
    cells = rows.gather(x)
    assert cells.shape == (len(counts), max(counts), width)
    first = 0
    for b, n in enumerate(counts):
        for cell in range(max(counts)):
            source = first + min(cell, n - 1)
            assert cells[b, cell].tolist() == x[source, 0].tolist()
            assert bool(rows.mask[b, cell]) == (cell < n)
        first += n
    assert rows.lengths.tolist() == counts
    assert mx.array_equal(rows.scatter(cells), x)


def test_ragged_rows_need_a_row_per_request() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        RaggedRows.from_counts([2, 0])
    with pytest.raises(ValueError, match="at least one row"):
        RaggedRows.from_counts([])


def _install(arch: str) -> tuple[Any, RaggedStateMixers | None, list[int], Any]:
    model = build_zoo_model(arch)
    layout = layout_from_model(model)
    factory = model_state_caches(model, layout)
    mixers = install_ragged_state_mixers(
        model,
        CacheNesting.from_model(model),
        layout.num_layers,
        layout.state_layer_ids,
        factory,
    )
    return model, mixers, list(layout.state_layer_ids), factory


@pytest.mark.parametrize(
    ("arch", "mode"),
    [
        ("qwen3_next", "padded"),  # gated delta net, conv state taken at each row's end
        ("lfm2", "padded"),  # short convolution
        ("granitemoehybrid", "padded"),  # Mamba 2 with lengths
        ("nemotron_h", "grouped"),  # its SSM state moves over padding: probe refuses
        ("mamba", "grouped"),  # called without a mask
    ],
)
def test_each_state_mixer_runs_ragged_rows_like_its_requests_alone(arch: str, mode: str) -> None:
    _, mixers, state_ids, factory = _install(arch)
    assert mixers is not None
    try:
        assert mixers.modes == [mode] * len(state_ids)
        _check_mixers_against_requests_alone(mixers, state_ids, factory)
    finally:
        mixers.uninstall()


@settings(max_examples=10, deadline=None)
@given(counts=counts_lists, seed=st.integers(0, 2**16))
def test_gated_delta_rows_equal_requests_alone(counts: list[int], seed: int) -> None:
    _, mixers, state_ids, factory = _install_cached("qwen3_next")
    _check_mixers_against_requests_alone(mixers, state_ids, factory, counts, seed)


_INSTALLED: dict[str, tuple[Any, RaggedStateMixers, list[int], Any]] = {}


def _install_cached(arch: str) -> tuple[Any, RaggedStateMixers, list[int], Any]:
    if arch not in _INSTALLED:
        model, mixers, ids, factory = _install(arch)
        assert mixers is not None
        _INSTALLED[arch] = (model, mixers, ids, factory)
    return _INSTALLED[arch]


def _check_mixers_against_requests_alone(
    mixers: RaggedStateMixers,
    state_ids: list[int],
    factory: Any,
    counts: list[int] | None = None,
    seed: int = 0,
) -> None:
    """One step's rows through every swapped mixer equal each request run alone; replaying
    the first ``(n + 1) // 2`` of a request's rows from its state before the step equals
    running just those alone."""
    counts = counts or [4, 1, 2]
    kept = [(n + 1) // 2 for n in counts]
    steps: list[StackedStateCache] = []
    befores: list[list[Any]] = [[] for _ in counts]
    replay_want: list[list[list[Any]]] = [[] for _ in counts]
    for k, (module, original) in enumerate(mixers._modules):
        hidden = _input_width(module)
        key = mx.random.key(seed)
        prefix = mx.random.normal((len(counts), 3, hidden), key=key)
        tokens = mx.random.normal((len(counts), max(counts), hidden), key=key + 1)
        starts = []
        for b in range(len(counts)):
            cache = factory()[k]
            original.__call__(module, prefix[b : b + 1], *_rest(original, cache))
            starts.append(cache)
        rows = [copy.copy(s) for s in starts]
        for row, start in zip(rows, starts, strict=True):
            row.cache = list(start.cache)
        stacked = StackedStateCache(state_ids[k], rows)
        setattr(stacked.view, RAGGED_ROWS_ATTRIBUTE, RaggedRows.from_counts(counts))
        flat = mx.concatenate([tokens[b, :n] for b, n in enumerate(counts)])[:, None]
        out = module(*_args(original, flat, stacked.view))
        mx.eval(out, stacked.view.cache)
        stacked.split()
        steps.append(stacked)
        first = 0
        for b, n in enumerate(counts):
            before = copy.copy(starts[b])
            before.cache = list(starts[b].cache)
            befores[b].append(before)
            part = copy.copy(starts[b])
            part.cache = list(starts[b].cache)
            original.__call__(module, tokens[b : b + 1, : kept[b]], *_rest(original, part))
            replay_want[b].append(part.cache)
            alone = copy.copy(starts[b])
            alone.cache = list(starts[b].cache)
            want = original.__call__(module, tokens[b : b + 1, :n], *_rest(original, alone))
            assert mx.allclose(out[first : first + n, 0], want[0], atol=1e-5, rtol=1e-4)
            for got, expected in zip(stacked.rows[b].cache, alone.cache, strict=True):
                assert got is not None and expected is not None
                assert mx.allclose(got, expected, atol=1e-5, rtol=1e-4)
            first += n
    firsts = [sum(counts[:b]) for b in range(len(counts))]
    replayed = mixers.replay(steps, firsts, kept, befores)
    for b in range(len(counts)):
        for cache, want_slots in zip(replayed[b], replay_want[b], strict=True):
            for got, expected in zip(cache.cache, want_slots, strict=True):
                assert mx.allclose(got, expected, atol=1e-5, rtol=1e-4)


def _names(original: type) -> list[str]:
    import inspect

    return list(inspect.signature(original.__call__).parameters)[1:]


def _rest(original: type, cache: Any) -> list[Any]:
    return [None if name == "mask" else cache for name in _names(original)[1:]]


def _args(original: type, x: mx.array, cache: Any) -> list[Any]:
    return [x, *_rest(original, cache)]


def _input_width(module: Any) -> int:
    for name in ("in_proj", "in_proj_qkvz", "in_proj_x", "conv", "qkv_proj", "in_proj_qkv"):
        linear = getattr(module, name, None)
        weight = getattr(linear, "weight", None)
        if isinstance(weight, mx.array) and weight.ndim == 2:
            return int(weight.shape[1])
    raise AssertionError(f"no input projection on {type(module).__name__}")


@pytest.mark.parametrize("arch", ["rwkv7", "bailing_hybrid"])
def test_mixers_called_with_more_than_input_mask_and_cache_are_refused(arch: str) -> None:
    model, mixers, _, _ = _install(arch)
    assert mixers is None
    assert all("rows]" not in type(m).__qualname__ for _, m in model.named_modules())


def test_uninstall_puts_the_mixers_classes_back() -> None:
    model, mixers, state_ids, _ = _install("qwen3_next")
    assert mixers is not None
    swapped = [type(m) for _, m in model.named_modules() if "rows]" in type(m).__qualname__]
    assert len(swapped) == len(state_ids)
    tokens = mx.array([[3, 1, 4, 1, 5]])
    mixers.uninstall()
    assert all("rows]" not in type(m).__qualname__ for _, m in model.named_modules())
    fresh = build_zoo_model("qwen3_next")
    assert mx.array_equal(model(tokens), fresh(tokens))


def test_two_installs_on_one_model_keep_the_mixers_until_the_last_lets_go() -> None:
    model, first, state_ids, factory = _install("lfm2")
    layout = layout_from_model(model)
    second = install_ragged_state_mixers(
        model, CacheNesting.from_model(model), layout.num_layers, state_ids, factory
    )
    assert first is not None and second is not None
    first.uninstall()
    assert second.installed and not first.installed
    second.uninstall()
    assert not second.installed
    assert all("rows]" not in type(m).__qualname__ for _, m in model.named_modules())


class _ToyMixer(nn.Module):
    """A recurrent mixer called as ``(x, mask, cache)``: a running sum from its state."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.proj = nn.Linear(8, 8)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        state = cache[0] if cache[0] is not None else mx.zeros((x.shape[0], 1, 8))
        out = mx.cumsum(self.proj(x), axis=1) + state
        cache[0] = out[:, -1:]
        return out


class _ToyShift(nn.Module):
    """A token shift that keeps its own slot in the same cache (as RWKV's channel mixing)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        previous = cache[1] if cache[1] is not None else mx.zeros((x.shape[0], 1, 8))
        cache[1] = x[:, -1:]
        return x + mx.concatenate([previous, x[:, :-1]], axis=1)


class _ToyLayer(nn.Module):
    def __init__(self, shift: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.mixer = _ToyMixer()
        self.shift = _ToyShift() if shift else None

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        x = self.mixer(x, None, cache)
        return x if self.shift is None else self.shift(x, cache)


class _ToyModel(nn.Module):
    def __init__(self, shift: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.embed_tokens = nn.Embedding(4, 8)
        self.layers = [_ToyLayer(shift)]

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        x: mx.array = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache or [None], strict=True):
            x = layer(x, c)
        return x

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import ArraysCache

        return [ArraysCache(2)]


@pytest.mark.parametrize("shift", [False, True])
def test_a_cache_two_modules_touch_has_no_mixer_to_swap(shift: bool) -> None:
    model = _ToyModel(shift)
    mixers = install_ragged_state_mixers(
        model, CacheNesting.from_model(model), 1, [0], lambda: model.make_cache()
    )
    if shift:
        assert mixers is None  # the shift would see the step's flat rows
    else:
        # It sums every row it is given, padding included (no mask, no lengths): the probe
        # leaves it one call per group of requests with as many rows.
        assert mixers is not None and mixers.modes == ["grouped"]
        mixers.uninstall()
    assert type(model.layers[0].mixer) is _ToyMixer
