"""Quantized weights: ``load_model(weights_bits=)`` / ``--weights-bits``, and quantized mlx-lm dirs.

The oracle is mlx-lm generating on the same quantized model with its own caches: the engine's
greedy tokens must equal them. A directory saved quantized (``"quantization"`` in its
config, as ``mlx_lm.convert -q`` writes) loads unchanged and gives the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kv_protocol import UnsupportedModelError
from kv_serve import build_engine, cli_main, load_model
from kv_testing import mlx_lm_greedy, save_tiny_model_dir

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 41, 8, 3, 19, 23, 4], [11, 12, 13]]


def quantized_layers(model: nn.Module) -> int:
    return sum(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules()
    )


def engine_tokens(model: nn.Module) -> list[list[int]]:
    with build_engine(model, page_size=4, max_context=64) as engine:
        ids = [engine.submit(p, 8) for p in PROMPTS]
        out = engine.run()
    return [out[i] for i in ids]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_decode_as_mlx_lm_does(tmp_path: Path, bits: int) -> None:
    directory = save_tiny_model_dir(tmp_path / "m", "gpt_oss", head_dim=64, hidden_size=128)
    model, _ = load_model(directory, weights_bits=bits, weights_group_size=32)
    assert quantized_layers(model) > 0
    want = [mlx_lm_greedy(model, p, 8) for p in PROMPTS]
    assert engine_tokens(model) == want
    plain, _ = load_model(directory)
    assert quantized_layers(plain) == 0
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    flat_plain = cast(list[tuple[str, mx.array]], tree_flatten(plain.parameters()))
    assert sum(v.nbytes for _, v in flat) < sum(v.nbytes for _, v in flat_plain)


def test_a_quantized_mlx_lm_directory_loads_unchanged(tmp_path: Path) -> None:
    directory = save_tiny_model_dir(tmp_path / "m", "llama", head_dim=64, hidden_size=128)
    model, _ = load_model(directory, weights_bits=8, weights_group_size=64)
    saved = tmp_path / "q"
    saved.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (saved / name).write_bytes((directory / name).read_bytes())
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 8}
    (saved / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(saved / "model.safetensors"), dict(tree_flatten(model.parameters())))
    again, _ = load_model(saved)
    assert quantized_layers(again) == quantized_layers(model) > 0
    assert engine_tokens(again) == [mlx_lm_greedy(model, p, 8) for p in PROMPTS]


def test_bad_weight_settings_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = save_tiny_model_dir(tmp_path / "m", "llama", num_layers=2)
    with pytest.raises(UnsupportedModelError, match="weights_bits must be one of"):
        load_model(directory, weights_bits=3)
    with pytest.raises(UnsupportedModelError, match="weights_group_size must be one of"):
        load_model(directory, weights_bits=8, weights_group_size=48)
    argv = ["generate", "--model", str(directory), "--prompt", "Hi", "--weights-group-size", "32"]
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2
    assert "--weights-group-size needs --weights-bits" in capsys.readouterr().err
