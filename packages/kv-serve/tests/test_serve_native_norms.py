"""Native RMS norms against the models' own norms (mlx-lm's modules, ``mx.fast.rms_norm``).

The oracle is the unswapped model: for every architecture of the zoo a forward through the
swapped model must give the same logits bit for bit, with the same parameter paths; a norm
of another form must be left alone, and off the CPU kernel's domain the swapped module
computes ``mx.fast.rms_norm``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kv_metal_kernels import CpuRmsNorm, _graph_call
from kv_metal_kernels._cpu_library import CpuLibrary
from kv_serve._native_norms import NativeRMSNorm, attach_native_norms
from kv_testing import ZOO, build_zoo_model

KERNEL = CpuRmsNorm()
needs_kernel = pytest.mark.skipif(not KERNEL.available, reason=KERNEL.reason or "unavailable")


def logits(model: nn.Module, tokens: list[int]) -> np.ndarray:
    make = getattr(model, "make_cache", None)
    cache = make() if make is not None else None
    out = model(mx.array([tokens]), cache=cache)
    return np.array(out)


@needs_kernel
@pytest.mark.parametrize("arch", sorted(ZOO))
def test_a_swapped_model_computes_the_same_bits(arch: str) -> None:
    model = build_zoo_model(arch, seed=3)
    tokens = [(5 * i + 3) % 50 + 1 for i in range(11)]
    try:
        want = logits(model, tokens)
    except RuntimeError as err:  # a model whose own forward needs a GPU kernel
        pytest.skip(f"{arch}'s forward does not run here: {err}")
    paths = [str(path[0]) for path in tree_flatten(model.parameters())]
    swapped = attach_native_norms(model, KERNEL)
    assert swapped == sum(isinstance(m, NativeRMSNorm) for _, m in model.named_modules())
    assert [str(path[0]) for path in tree_flatten(model.parameters())] == paths
    assert np.array_equal(logits(model, tokens), want)
    assert attach_native_norms(model, KERNEL) == swapped  # idempotent


@needs_kernel
def test_gemma_and_llama_norms_are_swapped_in_both_forms() -> None:
    gemma = build_zoo_model("gemma3_text")
    assert attach_native_norms(gemma, KERNEL) > 0
    forms = {m.add_one for _, m in gemma.named_modules() if isinstance(m, NativeRMSNorm)}
    assert forms == {True}
    llama = build_zoo_model("llama")
    assert attach_native_norms(llama, KERNEL) > 0
    forms = {m.add_one for _, m in llama.named_modules() if isinstance(m, NativeRMSNorm)}
    assert forms == {False}


class OtherNorm(nn.Module):
    def __init__(self, dims: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.weight = mx.ones((dims,)) * 0.5
        self.eps = 1e-6

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 2.0 * self.weight, self.eps)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.plain = nn.RMSNorm(16)
        self.other = OtherNorm(16)
        self.layer = nn.LayerNorm(16)


@needs_kernel
def test_norms_of_other_forms_are_left_alone() -> None:
    holder = Holder()
    assert attach_native_norms(holder, KERNEL) == 1
    assert isinstance(holder.plain, NativeRMSNorm)
    assert isinstance(holder.other, OtherNorm) and isinstance(holder.layer, nn.LayerNorm)


@needs_kernel
def test_off_the_kernels_domain_it_is_mx_fast_rms_norm() -> None:
    weight = mx.random.normal((32,), key=mx.random.key(1))
    norm = NativeRMSNorm(weight, 1e-5, add_one=True, kernel=KERNEL)
    for dtype in (mx.bfloat16, mx.float16):
        x = mx.random.normal((3, 32), key=mx.random.key(2)).astype(dtype)
        assert np.array_equal(
            np.array(norm(x).astype(mx.float32)),
            np.array(mx.fast.rms_norm(x, 1.0 + weight, 1e-5).astype(mx.float32)),
        )


def test_without_the_graph_calls_nothing_is_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    off = _graph_call.GraphCalls(
        CpuLibrary(handle=None, path="", openmp="", reason=""), "KV_CPU_GRAPH=off"
    )
    monkeypatch.setattr(_graph_call, "_calls", off)
    unavailable = CpuRmsNorm()
    assert not unavailable.available and unavailable.reason == "KV_CPU_GRAPH=off"
    model = build_zoo_model("gemma3_text")
    assert attach_native_norms(model, unavailable) == 0
    with pytest.raises(RuntimeError, match="not available"):
        unavailable(mx.ones((1, 4)), mx.ones((4,)), 1e-6)


@needs_kernel
def test_an_engine_swaps_the_norms_while_it_runs_and_close_puts_them_back() -> None:
    from kv_serve import build_engine
    from kv_testing import mlx_lm_greedy

    model = build_zoo_model("gemma3_text")
    before = {name: id(m) for name, m in model.named_modules()}
    prompt = [(5 * i + 3) % 50 + 1 for i in range(9)]
    want = mlx_lm_greedy(model, prompt, 6)
    with build_engine(model, max_context=64) as engine:
        reports = {r.name: r for r in engine._core.runner.surgery.reports}
        held = sum(isinstance(m, NativeRMSNorm) for _, m in model.named_modules())
        assert reports["native norms"].installed == held > 0
        rid = engine.submit(prompt, 6)
        assert engine.run()[rid] == want
    assert {name: id(m) for name, m in model.named_modules()} == before
    assert not any(isinstance(m, NativeRMSNorm) for _, m in model.named_modules())
