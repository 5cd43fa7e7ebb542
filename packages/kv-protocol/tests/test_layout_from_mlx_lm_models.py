from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kv_protocol import (
    KVCacheError,
    LayerKind,
    UnsupportedModelError,
    layout_from_model,
)
from kv_testing import ARCHITECTURES, build_tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("num_layers", [4, 6])
def test_layout_matches_the_models_own_make_cache(arch: str, num_layers: int) -> None:
    model = build_tiny_model(arch, window=8 if num_layers == 4 else 12, num_layers=num_layers)
    layout = layout_from_model(model)
    caches = make_prompt_cache(model)
    assert layout.num_layers == len(caches)
    for spec, cache in zip(layout.specs, caches, strict=True):
        if isinstance(cache, RotatingKVCache):
            assert spec.kind is LayerKind.SLIDING
            assert spec.window == cache.max_size
        else:
            assert type(cache) is KVCache
            assert spec.kind is LayerKind.FULL
            assert spec.window is None
        assert spec.n_kv_heads == 2
        assert spec.head_dim == 16
        assert spec.dtype == mx.float32
    assert layout.full_layer_ids and layout.sliding_layer_ids


def test_plain_llama_without_windows_is_all_full() -> None:
    model = build_tiny_model("llama", layer_types=None, sliding_window=None)
    layout = layout_from_model(model)
    assert all(s.kind is LayerKind.FULL for s in layout.specs)
    assert all(isinstance(c, KVCache) for c in make_prompt_cache(model))


def test_per_layer_geometry_and_dtype_override() -> None:
    model = build_tiny_model("gpt_oss", dtype=mx.bfloat16)
    assert layout_from_model(model).specs[0].dtype == mx.bfloat16
    assert layout_from_model(model, dtype=mx.float16).specs[1].dtype == mx.float16


def test_a_sliding_window_mapped_to_no_layer_is_refused() -> None:
    model: Any = build_tiny_model("llama", layer_types=None, sliding_window=32)
    # mlx-lm's llama always sets per-layer `use_sliding`; drop it to model a config that
    # declares `sliding_window` without saying which layers it applies to.
    for layer in model.model.layers:
        del layer.use_sliding
    model.model.layer_types = None
    model.args.layer_types = None
    with pytest.raises(UnsupportedModelError, match="declares sliding_window=32") as info:
        layout_from_model(model)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVCacheError)


def test_a_model_without_layers_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="cannot find the decoder layers"):
        layout_from_model(object())


def test_an_unknown_layer_type_on_an_attention_layer_is_refused() -> None:
    model: Any = build_tiny_model("olmo3", window=8)
    types = ["sliding_attention", "chunked_attention", "full_attention", "x"]
    model.args.layer_types = model.model.layer_types = types
    with pytest.raises(UnsupportedModelError, match=r"layer 1 .* 'chunked_attention'"):
        layout_from_model(model)


def test_known_recurrent_layer_types_are_state_layers() -> None:
    model: Any = build_tiny_model("olmo3", window=8)
    types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    model.args.layer_types = model.model.layer_types = types
    # olmo3's own make_cache() knows no recurrent layers (it would give RotatingKVCache and
    # the layout refuses that disagreement): read the attributes alone, as for a model
    # without make_cache().
    attributes_only = SimpleNamespace(args=model.args, model=model.model)
    layout = layout_from_model(attributes_only)
    assert layout.state_layer_ids == (0, 2)
    assert layout.sliding_layer_ids == (1,)
    assert layout.full_layer_ids == (3,)
