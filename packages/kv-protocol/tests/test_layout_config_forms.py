"""layout_from_model on every configuration form real models use, and on the forms it refuses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import exaone4, gemma3_text
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kv_protocol import (
    KVCacheError,
    LayerKind,
    UnsupportedModelError,
    layout_from_model,
)

N_KV, HEAD_DIM, HIDDEN = 2, 16, 64


def fake_attention(*, n_kv: Any = N_KV, head_dim: Any = HEAD_DIM, **attrs: Any) -> Any:
    """A duck-typed attention module: q/k/v projections with weights, head counts."""
    out = N_KV * HEAD_DIM

    def proj(rows: int) -> SimpleNamespace:
        return SimpleNamespace(weight=mx.zeros((rows, HIDDEN)))

    fields: dict[str, Any] = {
        "q_proj": proj(4 * HEAD_DIM),
        "k_proj": proj(out),
        "v_proj": proj(out),
    }
    if n_kv is not None:
        fields["n_kv_heads"] = n_kv
    if head_dim is not None:
        fields["head_dim"] = head_dim
    fields.update(attrs)
    return SimpleNamespace(**fields)


def fake_model(num_layers: int, *, attention: dict[str, Any] | None = None, **args: Any) -> Any:
    """A model whose only configuration is ``args`` (an mlx-lm ``ModelArgs`` stand-in)."""
    layers = [
        SimpleNamespace(self_attn=fake_attention(**(attention or {}))) for _ in range(num_layers)
    ]
    return SimpleNamespace(args=SimpleNamespace(**args), model=SimpleNamespace(layers=layers))


def kinds(model: Any) -> list[LayerKind]:
    return [spec.kind for spec in layout_from_model(model).specs]


def assert_matches_make_cache(model: Any, window: int, caches: list[Any] | None = None) -> None:
    layout = layout_from_model(model)
    if caches is None:
        caches = make_prompt_cache(model)
    assert len(caches) == layout.num_layers
    for spec, cache in zip(layout.specs, caches, strict=True):
        if isinstance(cache, RotatingKVCache):
            assert (spec.kind, spec.window) == (LayerKind.SLIDING, window)
        else:
            assert type(cache) is KVCache
            assert (spec.kind, spec.window) == (LayerKind.FULL, None)


# ---------------------------------------------------------------- integer patterns


@pytest.mark.parametrize("pattern", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("num_layers", [1, 5, 12, 13])
def test_an_int_pattern_makes_every_nth_layer_global_as_mlx_lm_does(
    pattern: int, num_layers: int
) -> None:
    model = fake_model(num_layers, sliding_window=8, sliding_window_pattern=pattern)
    # mlx-lm's gemma3_text / cohere2 / plamo3: layer i is global iff (i + 1) % pattern == 0.
    expected = [
        LayerKind.FULL if (i + 1) % pattern == 0 else LayerKind.SLIDING for i in range(num_layers)
    ]
    assert kinds(model) == expected
    for spec in layout_from_model(model).specs:
        assert spec.window == (8 if spec.kind is LayerKind.SLIDING else None)


def test_a_numpy_int_pattern_and_window_are_read_as_ints() -> None:
    model = fake_model(4, sliding_window=np.int64(8), sliding_window_pattern=np.int32(2))
    layout = layout_from_model(model)
    assert layout.sliding_layer_ids == (0, 2)
    assert layout.full_layer_ids == (1, 3)
    assert type(layout.specs[0].window) is int


def test_real_gemma3_pattern_without_per_layer_flags_matches_make_cache() -> None:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=HIDDEN,
        num_hidden_layers=7,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=N_KV,
        head_dim=HEAD_DIM,
        vocab_size=64,
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16,
    )
    model: Any = gemma3_text.Model(args)
    caches = make_prompt_cache(model)
    assert_matches_make_cache(model, 8, caches)
    # The same model read from its pattern alone (no is_sliding flags) gives the same layout.
    for layer in model.model.layers:
        del layer.self_attn.is_sliding
    assert_matches_make_cache(model, 8, caches)


# ---------------------------------------------------------------- string patterns


@pytest.mark.parametrize(
    ("pattern", "num_layers"),
    [("LLLG", 8), ("LLLG", 10), ("LG", 5), ("G", 3), ("L", 3), ("GLL", 7), ("LLLLLG", 4)],
)
def test_a_string_pattern_names_local_and_global_layers_as_mlx_lm_does(
    pattern: str, num_layers: int
) -> None:
    model = fake_model(num_layers, sliding_window=16, sliding_window_pattern=pattern)
    # mlx-lm's exaone4: layer i is local iff pattern[i % len(pattern)] == "L".
    expected = [
        LayerKind.SLIDING if pattern[i % len(pattern)] == "L" else LayerKind.FULL
        for i in range(num_layers)
    ]
    assert kinds(model) == expected


def make_exaone4(pattern: str | None, num_layers: int = 6) -> Any:
    args = exaone4.ModelArgs(
        model_type="exaone4",
        hidden_size=HIDDEN,
        num_hidden_layers=num_layers,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
        num_key_value_heads=N_KV,
        max_position_embeddings=512,
        rope_theta=10000.0,
        head_dim=HEAD_DIM,
        tie_word_embeddings=True,
        rope_scaling={},
        sliding_window=8,
        sliding_window_pattern=pattern,
    )
    return exaone4.Model(args)


@pytest.mark.parametrize("pattern", ["LLLG", "LG", "GLLL"])
def test_real_exaone4_string_pattern_matches_make_cache(pattern: str) -> None:
    model = make_exaone4(pattern)
    caches = make_prompt_cache(model)
    assert_matches_make_cache(model, 8, caches)
    assert layout_from_model(model).full_layer_ids
    # Read from the string pattern alone (without the attention modules' is_local flags).
    for layer in model.model.layers:
        del layer.self_attn.is_local
    assert_matches_make_cache(model, 8, caches)


def test_real_exaone4_without_a_pattern_is_all_full_like_make_cache() -> None:
    # mlx-lm's exaone4 ignores sliding_window when no pattern is given; so does the layout
    # (the attention modules' is_local flags say so).
    model = make_exaone4(None)
    assert_matches_make_cache(model, 8)
    assert not layout_from_model(model).sliding_layer_ids


# ---------------------------------------------------------------- refused patterns


@pytest.mark.parametrize(
    "pattern",
    [0, -1, -4, 6.0, 2.5, True, False, "", "LLXG", "llg", "6", "L G", [1, 0], {"L": 1}],
    ids=repr,
)
def test_a_pattern_it_cannot_read_is_refused_naming_the_field_and_value(pattern: Any) -> None:
    model = fake_model(6, sliding_window=8, sliding_window_pattern=pattern)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    assert f"sliding_window_pattern={pattern!r}" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVCacheError)


# ---------------------------------------------------------------- windows and head counts


@pytest.mark.parametrize("window", [8.0, 7.9, True, 0, -8, "8", [8]], ids=repr)
def test_a_model_window_that_is_not_an_int_is_refused(window: Any) -> None:
    model = fake_model(4, sliding_window=window, sliding_window_pattern=2)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    assert "sliding_window" in str(info.value)
    assert repr(window) in str(info.value)


@pytest.mark.parametrize("window", [8.0, True, -1, 0], ids=repr)
def test_an_attention_module_window_that_is_not_an_int_is_refused(window: Any) -> None:
    model = fake_model(
        4,
        attention={"window_size": window},
        sliding_window=8,
        sliding_window_pattern=2,
    )
    with pytest.raises(UnsupportedModelError, match="layer 0: window_size") as info:
        layout_from_model(model)
    assert repr(window) in str(info.value)


@pytest.mark.parametrize(
    ("attention", "field"),
    [
        ({"n_kv": 2.0}, "n_kv_heads"),
        ({"n_kv": True}, "n_kv_heads"),
        ({"n_kv": 0}, "n_kv_heads"),
        ({"n_kv": "2"}, "n_kv_heads"),
        ({"head_dim": 16.0}, "head_dim"),
        ({"head_dim": 15.9}, "head_dim"),
        ({"head_dim": False}, "head_dim"),
        ({"head_dim": -16}, "head_dim"),
    ],
    ids=repr,
)
def test_a_head_count_or_head_dim_that_is_not_an_int_is_refused(
    attention: dict[str, Any], field: str
) -> None:
    model = fake_model(2, attention=attention)
    value = next(iter(attention.values()))
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    assert f"layer 0: {field}" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("heads", [2.0, True, 0, -2], ids=repr)
def test_a_config_kv_head_count_that_is_not_an_int_is_refused(heads: Any) -> None:
    model = fake_model(2, attention={"n_kv": None}, num_key_value_heads=heads)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads") as info:
        layout_from_model(model)
    assert repr(heads) in str(info.value)


def test_the_config_kv_head_count_is_used_when_the_module_has_none() -> None:
    model = fake_model(2, attention={"n_kv": None}, num_key_value_heads=np.int64(N_KV))
    spec = layout_from_model(model).specs[0]
    assert (spec.n_kv_heads, spec.head_dim) == (N_KV, HEAD_DIM)
    assert type(spec.n_kv_heads) is int


# ---------------------------------------------------------------- layer_types and flags


def test_layer_types_as_a_list_or_tuple_are_read() -> None:
    names = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]
    for types in (names, tuple(names)):
        model = fake_model(4, sliding_window=8, layer_types=types)
        assert kinds(model) == [
            LayerKind.SLIDING,
            LayerKind.FULL,
            LayerKind.STATE,
            LayerKind.SLIDING,
        ]


@pytest.mark.parametrize(
    ("types", "field"),
    [
        ("full_attention", "layer_types"),
        ({"0": "full_attention"}, "layer_types"),
        (5, "layer_types"),
        (["full_attention", None, "full_attention"], "layer_types[1]"),
        (["full_attention", "full_attention", 2], "layer_types[2]"),
    ],
    ids=repr,
)
def test_layer_types_that_are_not_a_list_of_names_are_refused(types: Any, field: str) -> None:
    model = fake_model(3, sliding_window=8, layer_types=types)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    bad = types[int(field[-2])] if field.endswith("]") else types
    assert f"{field}={bad!r}" in str(info.value)


@pytest.mark.parametrize("flag", ["yes", 2, 1.0, [True]], ids=repr)
def test_a_sliding_flag_that_is_not_a_bool_is_refused(flag: Any) -> None:
    model = fake_model(2, attention={"is_sliding": flag}, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="layer 0: is_sliding") as info:
        layout_from_model(model)
    assert repr(flag) in str(info.value)


def test_sliding_flags_take_precedence_over_the_pattern() -> None:
    model = fake_model(4, sliding_window=8, sliding_window_pattern=2)
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.is_sliding = index == 0
    assert kinds(model) == [LayerKind.SLIDING, LayerKind.FULL, LayerKind.FULL, LayerKind.FULL]
