"""Every change to a model goes through one registry and is undone through it.

The oracle is the model itself: after :meth:`ModelSurgery.undo` (and after an engine's
``close``) every module of the model is the very object it was before, and a module's output
outside the engine's forwards is mlx-lm's own, bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from batching_fakes import FakeKernels, fake_prefill_cache

from kv_batching import (
    ChangeReport,
    DecodeEngine,
    EngagedChange,
    ModelChange,
    ModelSurgery,
)
from kv_batching._cache_nesting import CacheNesting
from kv_batching._fast_mlp import FAST_MLP_MIN_WIDTH, FastGatedMLP, FastMLPs
from kv_batching._patching import AttentionWrappers, wrapped_attention
from kv_batching._ragged_state import RaggedStateMixers
from kv_batching._state_cache import model_state_caches
from kv_protocol import UnsupportedModelError, layout_from_model
from kv_testing import ReferenceKVPool, build_tiny_model, build_zoo_model, mlx_lm_greedy


def modules_of(model: nn.Module) -> dict[str, tuple[int, type]]:
    """Every module by path: its identity and its class."""
    return {name: (id(m), type(m)) for name, m in model.named_modules()}


class Recorded:
    """A change that swaps nothing and records what it was asked to do."""

    name = "recorded"

    def __init__(self, log: list[str], installed: int = 1) -> None:
        self.log = log
        self.count = installed

    def install(self, model: nn.Module) -> ChangeReport:
        self.log.append("install")
        reason = None if self.count else "nothing to change"
        return ChangeReport(name=self.name, installed=self.count, reason=reason)

    def uninstall(self, model: nn.Module) -> int:
        self.log.append("uninstall")
        return self.count

    def engage(self, *, prefill: bool) -> None:
        self.log.append(f"engage prefill={prefill}")

    def disengage(self) -> None:
        self.log.append("disengage")


def test_the_engines_changes_are_each_a_model_change() -> None:
    layout = layout_from_model(build_tiny_model("llama", num_layers=2))
    for change in (AttentionWrappers(layout), FastMLPs()):
        assert isinstance(change, ModelChange) and isinstance(change, EngagedChange)
    assert isinstance(Recorded([]), EngagedChange)


def test_undo_puts_back_every_module_last_change_first() -> None:
    model = build_tiny_model(
        "gemma3_text", num_layers=2, window=4, sliding_window_pattern=2, intermediate_size=1024
    )
    before = modules_of(model)
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(0))
    mlp = model.layers[0].mlp
    want = mlp(x)
    surgery = ModelSurgery(model)
    attention = surgery.install(AttentionWrappers(layout_from_model(model)))
    mlps = surgery.install(FastMLPs(min_width=FAST_MLP_MIN_WIDTH))
    assert (attention.installed, mlps.installed, mlps.reason) == (2, 2, None)
    assert surgery.reports == (attention, mlps)
    assert len(wrapped_attention(model)) == 2
    swapped = model.layers[0].mlp
    assert isinstance(swapped, FastGatedMLP) and surgery.find(FastMLPs) is not None
    # Outside the engine's forwards the swapped MLP is mlx-lm's own call, bit for bit.
    assert mx.array_equal(swapped(x), want)
    with surgery.engaged():
        assert swapped.engaged
        engaged = swapped(x)
    assert not swapped.engaged
    assert mx.allclose(engaged, want, rtol=2e-5, atol=2e-5) and not mx.array_equal(engaged, want)
    assert surgery.undo() == 4
    assert modules_of(model) == before and surgery.reports == ()


def test_a_change_that_installs_nothing_is_not_kept_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = build_tiny_model("llama", num_layers=2)  # narrow MLPs: not worth swapping
    surgery = ModelSurgery(model)
    with caplog.at_level("INFO"):
        report = surgery.install(FastMLPs())
    assert report.installed == 0 and "narrower than" in str(report.reason)
    assert surgery.find(FastMLPs) is None and surgery.reports == ()
    assert "fast MLPs: 0 modules (layer 0: gate narrower than" in caplog.text


def test_engaged_changes_are_engaged_around_a_block_even_when_it_raises() -> None:
    log: list[str] = []
    surgery = ModelSurgery(build_tiny_model("llama", num_layers=2))
    surgery.install(Recorded(log))
    surgery.install(Recorded(log, installed=0))  # refused: never engaged
    with pytest.raises(RuntimeError), surgery.engaged(prefill=True):
        raise RuntimeError("a forward failed")
    assert log == ["install", "install", "engage prefill=True", "disengage"]
    assert surgery.uninstall(Recorded) == 1 and log[-1] == "uninstall"
    assert surgery.undo() == 0


def _pool(model: Any) -> ReferenceKVPool:
    return ReferenceKVPool(layout_from_model(model), num_pages=64, page_size=2)


def test_an_engine_installs_a_callers_changes_first_and_close_undoes_everything() -> None:
    model = build_tiny_model("gpt_oss", window=4, num_layers=4, vocab_size=64)
    before = modules_of(model)
    want = mlx_lm_greedy(model, [1, 2, 3], 6)
    log: list[str] = []
    engine = DecodeEngine(
        model, _pool(model), FakeKernels(), fake_prefill_cache, changes=[Recorded(log)]
    )
    surgery = engine._core.runner.surgery
    assert [r.name for r in surgery.reports][:2] == ["recorded", "attention"]
    rid = engine.submit([1, 2, 3], 6)
    assert engine.run()[rid] == want
    assert "engage prefill=True" in log and "engage prefill=False" in log
    engine.close()
    assert log[-1] == "uninstall" and surgery.reports == ()
    assert modules_of(model) == before


def test_a_model_refused_while_building_is_left_as_it_was() -> None:
    model = build_tiny_model("gpt_oss", window=4, num_layers=4, vocab_size=64)
    before = modules_of(model)
    log: list[str] = []

    class Broken(Recorded):
        name = "broken"

        def install(self, model: nn.Module) -> ChangeReport:
            raise UnsupportedModelError("this change refuses the model")

    with pytest.raises(UnsupportedModelError, match="refuses the model"):
        DecodeEngine(
            model,
            _pool(model),
            FakeKernels(),
            fake_prefill_cache,
            changes=[Recorded(log), Broken(log)],
        )
    assert log == ["install", "uninstall"]
    assert modules_of(model) == before


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "nemotron_h"])
def test_the_mixer_trace_leaves_only_the_mixers_swapped(arch: str) -> None:
    # The trace records module calls by swapping every class for one forward: all go back,
    # and only the mixers the probe accepted keep a class of their own until uninstalled.
    model = build_zoo_model(arch)
    layout = layout_from_model(model)
    before = modules_of(model)
    surgery = ModelSurgery(model)
    report = surgery.install(
        RaggedStateMixers(
            CacheNesting.from_model(model),
            layout.num_layers,
            layout.state_layer_ids,
            model_state_caches(model, layout),
        )
    )
    assert report.installed == len(layout.state_layer_ids) and report.reason is None
    after = modules_of(model)
    swapped = [name for name in before if after[name][1] is not before[name][1]]
    assert len(swapped) == report.installed
    assert all(after[name][0] == before[name][0] for name in before)  # the same objects
    assert surgery.undo() == report.installed
    assert modules_of(model) == before
