from __future__ import annotations

import mlx.core as mx
import pytest

from kv_testing import ARCHITECTURES, build_tiny_model, tiny_model_config


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_builds_and_runs(arch: str) -> None:
    model = build_tiny_model(arch, window=4, num_layers=4, vocab_size=64)
    logits = model(mx.array([[3, 1, 4, 1, 5]]))
    assert logits.shape == (1, 5, 64)
    assert bool(mx.all(mx.isfinite(logits)).item())
    assert len(model.layers) == 4


def test_the_seed_decides_the_weights() -> None:
    tokens = mx.array([[1, 2, 3]])
    same = [build_tiny_model("olmo3", seed=7)(tokens) for _ in range(2)]
    other = build_tiny_model("olmo3", seed=8)(tokens)
    assert mx.array_equal(same[0], same[1])
    assert not mx.array_equal(same[0], other)


def test_dtype_and_overrides_are_applied() -> None:
    model = build_tiny_model("llama", dtype=mx.bfloat16, hidden_size=32)
    assert model.args.hidden_size == 32
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    config = tiny_model_config("gpt_oss", window=5, num_layers=3)
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["sliding_window"] == 5


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        tiny_model_config("mamba")
