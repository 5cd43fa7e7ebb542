"""A decode step rotates its queries and keys from one table of the step's angles.

On MLX's CPU backend ``mx.fast.rope`` is composed of operations (cosines and sines included)
on every call; the engine takes the step's cosines and sines once per RoPE of the model and
applies them in every layer. Tokens stay mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu, reason="the table is the CPU route"
)


@pytest.mark.parametrize(("arch", "ropes"), [("gemma3_text", 2), ("gpt_oss", 1)])
def test_one_rope_call_per_rope_of_the_model_a_step(
    arch: str, ropes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides: dict[str, Any] = {"sliding_window_pattern": 2} if arch == "gemma3_text" else {}
    model = build_tiny_model(arch, num_layers=4, window=8, **overrides)
    prompts = [[5, 9, 3, 7, 11, 2, 8, 4, 6, 10, 12][:n] for n in (3, 11, 6)]
    want = [mlx_lm_greedy(model, p, 12) for p in prompts]
    with build_engine(model, max_running=4, prefix_caching=False) as engine:
        ids = [engine.submit(p, 12) for p in prompts]
        while engine.num_queued or engine.num_running < len(prompts):
            engine.step()
        calls: list[int] = []
        real = mx.fast.rope

        def counted(*args: Any, **kwargs: Any) -> mx.array:
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(mx.fast, "rope", counted)
        engine.step()
        monkeypatch.setattr(mx.fast, "rope", real)
        assert engine.decode_plan.routes and len(calls) == ropes
        engine.run()
        assert [list(engine.output(i).tokens) for i in ids] == want
