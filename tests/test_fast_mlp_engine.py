"""The engine with vectorised MLP activations keeps mlx-lm's greedy tokens.

Zoo models of Gemma 3 (tanh GELU) and Llama (SiLU) with a gate wide enough to be swapped:
the engine's tokens (prefill chunks, batched decode, a speculative verification) equal mlx-lm
generating each prompt alone with the model's own MLPs; the model is mlx-lm's again after
``close()``; ``fast_activations=False`` swaps nothing.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map

from kv_batching._fast_mlp import FAST_MLP_MIN_WIDTH, FastGatedMLP
from kv_protocol import RequestStateError, find_layers
from kv_serve import build_engine
from kv_testing import ZOO, mlx_lm_greedy, zoo_config

VOCAB = 128
PROMPTS = [
    [(7 * j + 1) % VOCAB for j in range(30)] * 2,
    [(3 * j + 5) % VOCAB for j in range(9)],
    [(11 * j + 2) % VOCAB for j in range(23)],
]


def _wide_model(name: str) -> nn.Module:
    config = zoo_config(name)
    config["intermediate_size"] = FAST_MLP_MIN_WIDTH
    module = importlib.import_module(f"mlx_lm.models.{ZOO[name].module}")
    mx.random.seed(11)
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    # Narrower weights than the zoo's, so the 1024-wide MLP keeps activations in range.
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    ("name", "activation"), [("gemma3_text", "gelu_approx"), ("llama", "silu")]
)
def test_engine_tokens_equal_mlx_lm_with_swapped_mlps(name: str, activation: str) -> None:
    model = _wide_model(name)
    originals = [layer.mlp for layer in find_layers(model)]
    want = [mlx_lm_greedy(model, p, 12) for p in PROMPTS]
    engine = build_engine(
        model, max_running=4, max_context=128, prefill_chunk=16, speculative="ngram"
    )
    mlps = [layer.mlp for layer in find_layers(model)]
    assert all(isinstance(m, FastGatedMLP) and m.activation == activation for m in mlps)
    ids = [engine.submit(p, max_tokens=12) for p in PROMPTS]
    engine.run()
    got = [list(engine.output(i).tokens) for i in ids]
    assert got == want
    assert engine.stats.decode_steps > 0 and engine.stats.prefill_chunks > len(PROMPTS)
    # Called by anyone else while the engine holds it, the model is mlx-lm's own.
    assert mlx_lm_greedy(model, PROMPTS[1], 12) == want[1]
    engine.close()
    assert [layer.mlp for layer in find_layers(model)] == originals


def test_fast_activations_off_and_bad_values() -> None:
    model = _wide_model("llama")
    originals = [layer.mlp for layer in find_layers(model)]
    engine = build_engine(model, max_running=2, max_context=64, fast_activations=False)
    assert [layer.mlp for layer in find_layers(model)] == originals
    engine.close()
    with pytest.raises(RequestStateError, match="fast_activations must be a bool"):
        build_engine(model, max_running=2, max_context=64, fast_activations="yes")  # type: ignore[arg-type]
    assert [layer.mlp for layer in find_layers(model)] == originals
