"""layout_from_model reads the model's own make_cache(), cross-checked with its attributes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import exaone4
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kv_protocol import KVCacheError, LayerKind, UnsupportedModelError, layout_from_model

HIDDEN = 64


def attention(n_kv: int = 2, head_dim: int = 16, v_dim: int | None = None, **attrs: Any) -> Any:
    """A duck-typed attention module with q/k/v projection weights and head counts."""

    def proj(rows: int) -> SimpleNamespace:
        return SimpleNamespace(weight=mx.zeros((rows, HIDDEN)))

    return SimpleNamespace(
        q_proj=proj(4 * head_dim),
        k_proj=proj(n_kv * head_dim),
        v_proj=proj(n_kv * (v_dim or head_dim)),
        n_kv_heads=n_kv,
        head_dim=head_dim,
        **attrs,
    )


def state_layer() -> Any:
    """A recurrent layer: a mixer with no q/k/v projections."""
    return SimpleNamespace(mixer=SimpleNamespace(in_proj=SimpleNamespace()))


class FakeModel:
    """A model with decoder layers, optional ``args`` and a ``make_cache`` returning ``caches``."""

    def __init__(self, layers: list[Any], caches: Any, **args: Any) -> None:
        self.model = SimpleNamespace(layers=layers)
        self.args = SimpleNamespace(**args)
        self._caches = caches

    def make_cache(self) -> Any:
        if isinstance(self._caches, Exception):
            raise self._caches
        return self._caches


# (kind, window) per layer: what make_cache says.
KIND = st.one_of(
    st.just(("full", None)),
    st.tuples(st.just("sliding"), st.integers(1, 4096)),
    st.just(("state", None)),
)


def build(kinds: list[tuple[str, int | None]]) -> tuple[FakeModel, list[Any]]:
    layers: list[Any] = []
    caches: list[Any] = []
    for i, (kind, window) in enumerate(kinds):
        if kind == "state":
            layers.append(state_layer())
            caches.append(ArraysCache(size=2))
            continue
        layers.append(
            SimpleNamespace(self_attn=attention(n_kv=1 + i % 3, head_dim=8 * (1 + i % 2)))
        )
        caches.append(KVCache() if kind == "full" else RotatingKVCache(max_size=window))
    return FakeModel(layers, caches), caches


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(KIND, min_size=1, max_size=12))
def test_the_layout_is_what_make_cache_says_layer_by_layer(
    kinds: list[tuple[str, int | None]],
) -> None:
    model, caches = build(kinds)
    layout = layout_from_model(model)
    assert layout.num_layers == len(caches)
    for i, (spec, cache) in enumerate(zip(layout.specs, caches, strict=True)):
        assert spec.layer_id == i
        if isinstance(cache, RotatingKVCache):
            assert (spec.kind, spec.window) == (LayerKind.SLIDING, cache.max_size)
        elif isinstance(cache, ArraysCache):
            assert (spec.kind, spec.n_kv_heads, spec.head_dim) == (LayerKind.STATE, None, None)
        else:
            assert (spec.kind, spec.window) == (LayerKind.FULL, None)
        if spec.kind is not LayerKind.STATE:
            # Geometry still comes from the modules.
            assert (spec.n_kv_heads, spec.head_dim) == (1 + i % 3, 8 * (1 + i % 2))


@settings(max_examples=40, deadline=None)
@given(st.lists(KIND, min_size=2, max_size=8), st.data())
def test_a_declared_layer_type_that_disagrees_is_refused_naming_both(
    kinds: list[tuple[str, int | None]], data: st.DataObject
) -> None:
    # One model-wide window, as a config's ``sliding_window`` declares.
    kinds = [(k, 8 if k == "sliding" else None) for k, _ in kinds]
    model, caches = build(kinds)
    declared = ["full_attention" if k == "full" else "sliding_attention" for k, _ in kinds]
    attention_ids = [i for i, (k, _) in enumerate(kinds) if k != "state"]
    if not attention_ids:
        return
    flip = data.draw(st.sampled_from(attention_ids))
    declared[flip] = "full_attention" if kinds[flip][0] == "sliding" else "sliding_attention"
    model.args = SimpleNamespace(layer_types=declared, sliding_window=8)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    text = str(info.value)
    assert f"layer {flip}:" in text
    assert type(caches[flip]).__name__ in text
    assert "attributes say" in text


def test_a_window_that_disagrees_with_rotating_max_size_is_refused() -> None:
    layers = [SimpleNamespace(self_attn=attention(is_sliding=True, sliding_window=16))]
    model = FakeModel(layers, [RotatingKVCache(max_size=8)])
    with pytest.raises(UnsupportedModelError, match=r"SLIDING\(window=8\).*SLIDING\(window=16\)"):
        layout_from_model(model)


def test_agreeing_declarations_are_accepted() -> None:
    layers = [
        SimpleNamespace(self_attn=attention(is_sliding=True, sliding_window=8)),
        SimpleNamespace(self_attn=attention(is_sliding=False)),
    ]
    layout = layout_from_model(FakeModel(layers, [RotatingKVCache(max_size=8), KVCache()]))
    assert layout.sliding_layer_ids == (0,)
    assert layout.full_layer_ids == (1,)


@pytest.mark.parametrize(
    ("cache", "named"),
    [
        (ChunkedKVCache(chunk_size=8), "ChunkedKVCache"),
        (RotatingKVCache(max_size=8, keep=4), "keep=4"),
        (QuantizedKVCache(group_size=32, bits=8), "QuantizedKVCache"),
        (object(), "object"),
    ],
    ids=["chunked", "keep", "quantized", "foreign"],
)
def test_a_cache_kind_that_is_not_served_is_refused_naming_layer_and_type(
    cache: Any, named: str
) -> None:
    layers = [SimpleNamespace(self_attn=attention()) for _ in range(2)]
    model = FakeModel(layers, [KVCache(), cache])
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_model(model)
    assert "layer 1:" in str(info.value)
    assert named in str(info.value)
    assert isinstance(info.value, ValueError)


class ProbingModel(FakeModel):
    """A FakeModel whose forward writes one token of K/V of given widths into its caches."""

    def __init__(self, layers: list[Any], caches: Any, kv: list[tuple[int, int, int]]) -> None:
        super().__init__(layers, caches)
        self.kv = kv  # (kv_heads, k_dim, v_dim) per flat attention cache, in order

    def make_cache(self) -> Any:
        # Fresh caches on every call, as mlx-lm models do.
        def fresh(cache: Any) -> Any:
            if isinstance(cache, CacheList):
                return CacheList(*(fresh(c) for c in cache.caches))
            if isinstance(cache, RotatingKVCache):
                return RotatingKVCache(max_size=cache.max_size)
            return type(cache)(size=2) if isinstance(cache, ArraysCache) else type(cache)()

        return [fresh(c) for c in self._caches]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        geometries = iter(self.kv)

        def write(c: Any) -> None:
            if isinstance(c, CacheList):
                for sub in c.caches:
                    write(sub)
            elif hasattr(c, "update_and_fetch"):
                heads, k_dim, v_dim = next(geometries)
                c.update_and_fetch(
                    mx.zeros((1, heads, 1, k_dim), dtype=mx.float16),
                    mx.zeros((1, heads, 1, v_dim), dtype=mx.float16),
                )

        for c in cache:
            write(c)
        return mx.zeros((1, 1, 4))


def test_caches_that_are_not_one_per_layer_become_flat_layer_ids_with_observed_geometry() -> None:
    # Two decoder layers; three caches (a layer run twice on its own cache, say).
    layers = [SimpleNamespace(self_attn=attention()) for _ in range(2)]
    caches = [KVCache(), KVCache(), RotatingKVCache(max_size=4)]
    model = ProbingModel(layers, caches, [(2, 16, 16), (2, 16, 16), (1, 8, 8)])
    layout = layout_from_model(model)
    assert layout.num_layers == 3
    assert layout.full_layer_ids == (0, 1)
    assert layout.sliding_layer_ids == (2,)
    assert (layout.spec(2).window, layout.spec(2).n_kv_heads, layout.spec(2).head_dim) == (4, 1, 8)
    assert layout.spec(0).dtype == mx.float16  # what the model wrote


def test_a_cache_list_is_flattened_into_one_layer_id_per_cache() -> None:
    layers = [SimpleNamespace(conv=object()) for _ in range(2)]
    caches = [CacheList(ArraysCache(size=2), KVCache()), CacheList(ArraysCache(size=2), KVCache())]
    model = ProbingModel(layers, caches, [(2, 32, 8), (2, 32, 8)])
    layout = layout_from_model(model)
    assert [s.kind for s in layout.specs] == [LayerKind.STATE, LayerKind.FULL] * 2
    spec = layout.spec(3)
    assert (spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (2, 32, 8)
    assert spec.geometry.bytes_per_token == 2 * (32 + 8) * 2


def test_caches_that_cannot_be_observed_are_refused_with_the_reason() -> None:
    layers = [SimpleNamespace(self_attn=attention()) for _ in range(2)]
    model = FakeModel(layers, [KVCache(), KVCache(), RotatingKVCache(max_size=4)])
    with pytest.raises(UnsupportedModelError, match=r"cache 0 of FakeModel\.make_cache"):
        layout_from_model(model)
    with pytest.raises(UnsupportedModelError, match="probe forward failed"):
        layout_from_model(model)


def test_latent_attention_geometry_is_observed_from_the_probe() -> None:
    # No q/k/v module: the cached "keys" (a compressed KV) and "values" (a RoPE key) decide.
    layers = [SimpleNamespace(self_attn=SimpleNamespace(kv_a_proj=object()))]
    model = ProbingModel(layers, [KVCache()], [(1, 24, 8)])
    spec = layout_from_model(model).spec(0)
    assert (spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (1, 24, 8)


def test_make_cache_returning_something_else_than_a_list_is_refused() -> None:
    model = FakeModel([SimpleNamespace(self_attn=attention())], KVCache())
    with pytest.raises(UnsupportedModelError, match=r"returned KVCache, expected a list"):
        layout_from_model(model)


def test_a_kv_cache_on_a_layer_without_readable_attention_is_refused() -> None:
    model = FakeModel([state_layer()], [KVCache()])
    with pytest.raises(UnsupportedModelError, match=r"layer 0: .*KVCache.*mixer"):
        layout_from_model(model)


def test_fused_qkv_geometry_comes_from_declared_head_counts() -> None:
    fused = SimpleNamespace(qkv_proj=SimpleNamespace(), num_key_value_heads=3, head_dim=32)
    model = FakeModel([SimpleNamespace(mixer=fused)], [RotatingKVCache(max_size=5)])
    spec = layout_from_model(model).specs[0]
    assert (spec.kind, spec.window, spec.n_kv_heads, spec.head_dim) == (
        LayerKind.SLIDING,
        5,
        3,
        32,
    )


def test_values_narrower_than_keys_are_read_from_v_proj() -> None:
    model = FakeModel([SimpleNamespace(self_attn=attention(v_dim=8))], [KVCache()])
    spec = layout_from_model(model).spec(0)
    assert (spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (2, 16, 8)
    same = FakeModel([SimpleNamespace(self_attn=attention(v_dim=16))], [KVCache()])
    assert layout_from_model(same).spec(0).v_head_dim is None  # as wide as K


def test_a_v_proj_that_does_not_split_into_the_heads_is_refused() -> None:
    attn = attention()
    attn.v_proj = SimpleNamespace(weight=mx.zeros((33, HIDDEN)))
    with pytest.raises(UnsupportedModelError, match="v_proj produces 33 features"):
        layout_from_model(FakeModel([SimpleNamespace(self_attn=attn)], [KVCache()]))


def test_a_broken_make_cache_leaves_the_attributes_to_decide() -> None:
    layers = [SimpleNamespace(self_attn=attention(is_sliding=i == 0)) for i in range(2)]
    model = FakeModel(layers, AttributeError("no use_sliding"), sliding_window=8)
    layout = layout_from_model(model)
    assert layout.sliding_layer_ids == (0,)
    # ... and if they cannot either, the error says both.
    model = FakeModel([state_layer()], RuntimeError("boom"), sliding_window=8)
    with pytest.raises(UnsupportedModelError, match=r"declares sliding_window=8.*boom"):
        layout_from_model(model)


@pytest.mark.parametrize("pattern", ["LLLG", "LG", "GLLL", "LLLLLG"])
def test_real_exaone4_string_pattern_through_make_cache(pattern: str) -> None:
    args = exaone4.ModelArgs(
        model_type="exaone4",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        head_dim=16,
        tie_word_embeddings=False,
        rope_scaling=None,  # type: ignore[arg-type]  # mlx-lm's own default for no scaling
        sliding_window=8,
        sliding_window_pattern=pattern,
    )
    model = exaone4.Model(args)
    layout = layout_from_model(model)
    for spec, cache in zip(layout.specs, model.make_cache(), strict=True):
        sliding = isinstance(cache, RotatingKVCache)
        assert spec.kind is (LayerKind.SLIDING if sliding else LayerKind.FULL)
        assert spec.window == (8 if sliding else None)


ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 9),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.one_of(st.integers(-1, 3), st.text(max_size=3), st.none()), max_size=5),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=ODD,
    window=ODD,
    layer_types=ODD,
    flag=ODD,
    heads=ODD,
    k_shape=st.sampled_from([(), (32,), (32, HIDDEN), (0, HIDDEN)]),
    cache_kinds=st.lists(st.sampled_from(["full", "rot", "arr", "none"]), min_size=1, max_size=4),
)
def test_unforeseen_configurations_are_a_clear_refusal_never_a_crash(
    pattern: Any,
    window: Any,
    layer_types: Any,
    flag: Any,
    heads: Any,
    k_shape: tuple[int, ...],
    cache_kinds: list[str],
) -> None:
    layers = [
        SimpleNamespace(self_attn=attention(is_sliding=flag, sliding_window=window))
        for _ in cache_kinds
    ]
    for layer in layers:
        layer.self_attn.n_kv_heads = heads
        layer.self_attn.k_proj.weight = mx.zeros(k_shape)
    made: dict[str, Callable[[], Any]] = {
        "full": lambda: KVCache(),
        "rot": lambda: RotatingKVCache(max_size=window if isinstance(window, int) else 4),
        "arr": lambda: ArraysCache(size=2),
        "none": lambda: None,
    }
    caches = [made[k]() for k in cache_kinds]
    model = FakeModel(
        layers,
        caches,
        sliding_window_pattern=pattern,
        sliding_window=window,
        layer_types=layer_types,
    )
    for candidate in (model, SimpleNamespace(args=model.args, model=model.model)):
        try:
            layout_from_model(candidate)
        except KVCacheError as exc:
            assert str(exc)
        except Exception as exc:  # pragma: no cover - this is the failure being tested
            pytest.fail(f"layout_from_model crashed with {type(exc).__name__}: {exc}")


def test_kv_protocol_does_not_import_mlx_lm() -> None:
    code = "import sys, kv_protocol; sys.exit('mlx_lm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
