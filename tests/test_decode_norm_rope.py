"""A decode step's query/key norms and RoPE through ``kv_metal_kernels.CpuNormRope``.

On the CPU the engine hands each wrapped layer's projected query and key rows to the kernel
set's ``norm_rope`` where the layer's RoPE turns whole heads in halves and its q/k norms are
per head and state their function (``kv_protocol.RmsNormForm``: kv-serve's native norms) or
absent. Tokens must stay mlx-lm's, with the kernel serving exactly those layers, and a layer
it cannot serve (other norms, no native norms) keeps MLX's operations.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kv_batching import ChangeReport
from kv_batching._attention_spec import NormMode
from kv_batching._patching import wrapped_attention
from kv_metal_kernels import CpuNormRope
from kv_serve import build_engine
from kv_serve._native_norms import NativeNorms
from kv_testing import build_tiny_model, build_zoo_model, mlx_lm_greedy

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu or not CpuNormRope().available,
    reason="the norm + RoPE node is the CPU's",
)

PROMPTS = [[5, 9, 3, 7, 11, 2, 8, 4, 6, 10, 12][:n] for n in (3, 11, 6)]


def _served_in_one_step(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int, int, list[list[int]]]:
    """(kernel calls served in one decode step, layers eligible, wrapped, requests' tokens)."""
    served: list[int] = []
    real = CpuNormRope.__call__

    def counted(self: CpuNormRope, *args: Any, **kwargs: Any) -> mx.array | None:
        out = real(self, *args, **kwargs)
        served.append(out is not None)
        return out

    with build_engine(model, max_running=4, prefix_caching=False) as engine:
        ids = [engine.submit(p, 12) for p in PROMPTS]
        while engine.num_queued or engine.num_running < len(PROMPTS):
            engine.step()
        monkeypatch.setattr(CpuNormRope, "__call__", counted)
        engine.step()
        monkeypatch.setattr(CpuNormRope, "__call__", real)
        eligible = 0
        wrappers = wrapped_attention(model)
        for wrapper in wrappers:
            spec = wrapper.spec
            rope = spec.rope_config
            norms = [getattr(wrapper.inner, n, None) for n in ("q_norm", "k_norm")]
            if (
                rope is not None
                and not rope.traditional
                and rope.dims == spec.head_dim
                and NormMode.FLAT not in (spec.q_norm, spec.k_norm)
                and all(n is None or hasattr(n, "add_one") for n in norms)
            ):
                eligible += 1
        engine.run()
        return sum(served), eligible, len(wrappers), [list(engine.output(i).tokens) for i in ids]


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3", "llama", "olmo3"])
def test_the_kernel_serves_every_eligible_layer_and_tokens_stay_mlx_lms(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if arch == "qwen3":
        model = build_zoo_model(arch)
    else:
        overrides: dict[str, Any] = {"sliding_window_pattern": 2} if arch == "gemma3_text" else {}
        model = build_tiny_model(arch, num_layers=4, window=8, **overrides)
    want = [mlx_lm_greedy(model, p, 12) for p in PROMPTS]
    served, eligible, wrapped, got = _served_in_one_step(model, monkeypatch)
    assert got == want
    assert served == 2 * eligible
    if arch in ("gemma3_text", "qwen3", "llama"):
        # per-head norms (Gemma's scale by 1 + weight) or none, RoPE of whole heads
        assert eligible == wrapped > 0


def test_norms_that_do_not_state_their_function_keep_mlx_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def keep_the_norms(self: NativeNorms, model: object) -> ChangeReport:
        return ChangeReport(name=self.name, installed=0, reason="kept by the test")

    monkeypatch.setattr(NativeNorms, "install", keep_the_norms)
    model = build_tiny_model("gemma3_text", num_layers=4, window=8, sliding_window_pattern=2)
    want = [mlx_lm_greedy(model, p, 12) for p in PROMPTS]
    served, eligible, wrapped, got = _served_in_one_step(model, monkeypatch)
    assert got == want
    assert served == eligible == 0 < wrapped
