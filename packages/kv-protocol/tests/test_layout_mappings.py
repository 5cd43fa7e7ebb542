from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_protocol import (
    CacheLayout,
    KVCacheError,
    LayerKind,
    LayerKindError,
    LayerSpec,
    LayoutError,
)

KIND_STRATEGY = st.sampled_from(list(LayerKind))


def make_spec(layer_id: int, kind: LayerKind, window: int = 16) -> LayerSpec:
    if kind is LayerKind.STATE:
        return LayerSpec(layer_id=layer_id, kind=kind)
    return LayerSpec(
        layer_id=layer_id,
        kind=kind,
        window=window if kind is LayerKind.SLIDING else None,
        n_kv_heads=2,
        head_dim=16,
    )


def layout_of(kinds: list[LayerKind]) -> CacheLayout:
    return CacheLayout([make_spec(i, k) for i, k in enumerate(kinds)])


@given(st.lists(KIND_STRATEGY, min_size=1, max_size=40), st.randoms())
def test_mappings_are_dense_disjoint_ordered_and_invertible(
    kinds: list[LayerKind], rnd: object
) -> None:
    specs = [make_spec(i, k) for i, k in enumerate(kinds)]
    shuffled = list(specs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    layout = CacheLayout(shuffled)
    # Plain-Python oracle of what each id list must be.
    full = [i for i, k in enumerate(kinds) if k is LayerKind.FULL]
    sliding = [i for i, k in enumerate(kinds) if k is LayerKind.SLIDING]
    state = [i for i, k in enumerate(kinds) if k is LayerKind.STATE]
    attention = sorted(full + sliding)
    assert list(layout.full_layer_ids) == full
    assert list(layout.sliding_layer_ids) == sliding
    assert list(layout.state_layer_ids) == state
    assert list(layout.attention_layer_ids) == attention
    for mapping, ids in (
        (layout.full_attention_layer_id_mapping, full),
        (layout.sliding_layer_id_mapping, sliding),
        (layout.attention_index_by_layer, attention),
    ):
        # dense: values are exactly 0..n-1; ordered: increasing with the global id
        assert list(mapping.keys()) == ids
        assert list(mapping.values()) == list(range(len(ids)))
        inverse = {v: k for k, v in mapping.items()}
        assert len(inverse) == len(mapping)
    assert set(full).isdisjoint(sliding)
    assert set(full) | set(sliding) | set(state) == set(range(len(kinds)))
    for layer_id in range(len(kinds)):
        kind = kinds[layer_id]
        if kind is LayerKind.FULL:
            assert layout.full_layer_ids[layout.full_pool_index(layer_id)] == layer_id
        else:
            with pytest.raises(ValueError, match="not in full attention layers"):
                layout.full_pool_index(layer_id)
        if kind is LayerKind.SLIDING:
            assert layout.sliding_layer_ids[layout.sliding_pool_index(layer_id)] == layer_id
        else:
            with pytest.raises(ValueError, match="not in sliding window layers"):
                layout.sliding_pool_index(layer_id)
        if kind is LayerKind.STATE:
            with pytest.raises(ValueError, match="not in attention layers"):
                layout.attention_index(layer_id)
        else:
            assert layout.attention_layer_ids[layout.attention_index(layer_id)] == layer_id


def test_full_pool_index_error_text_is_exact_for_every_wrong_id() -> None:
    layout = layout_of([LayerKind.SLIDING, LayerKind.FULL, LayerKind.STATE, LayerKind.FULL])
    for layer_id in (0, 2, 4, 99, -1):
        with pytest.raises(ValueError) as info:
            layout.full_pool_index(layer_id)
        assert str(info.value) == (
            f"{layer_id=} not in full attention layers: "
            f"{layout.full_attention_layer_id_mapping.keys()}"
        )
        assert str(info.value) == f"layer_id={layer_id} not in full attention layers: " + (
            "dict_keys([1, 3])"
        )
        assert isinstance(info.value, KVCacheError)
        assert isinstance(info.value, LayerKindError)
    for layer_id in (1, 2, 3, 7, -2):
        with pytest.raises(ValueError) as info:
            layout.sliding_pool_index(layer_id)
        assert str(info.value) == (
            f"layer_id={layer_id} not in sliding window layers: dict_keys([0])"
        )
    with pytest.raises(ValueError) as info:
        layout.attention_index(2)
    assert str(info.value) == "layer_id=2 not in attention layers: dict_keys([0, 1, 3])"


def test_mappings_are_read_only() -> None:
    layout = layout_of([LayerKind.FULL, LayerKind.SLIDING])
    with pytest.raises(TypeError):
        layout.full_attention_layer_id_mapping[5] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        layout.full_layer_ids = (1,)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 0, 1], "unique; duplicated: [0]"),
        ([0, 2], "contiguous from 0; missing: [1]"),
        ([1, 2], "contiguous from 0; missing: [0]"),
    ],
)
def test_layer_ids_must_be_unique_and_contiguous(ids: list[int], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        CacheLayout([make_spec(i, LayerKind.FULL) for i in ids])


def test_empty_layout_is_rejected() -> None:
    with pytest.raises(LayoutError, match="at least one layer"):
        CacheLayout([])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": LayerKind.SLIDING, "n_kv_heads": 2, "head_dim": 8}, "window"),
        ({"kind": LayerKind.SLIDING, "window": 0, "n_kv_heads": 2, "head_dim": 8}, "window"),
        ({"kind": LayerKind.FULL, "window": 4, "n_kv_heads": 2, "head_dim": 8}, "window"),
        ({"kind": LayerKind.STATE, "window": 4}, "window"),
        ({"kind": LayerKind.FULL, "n_kv_heads": 0, "head_dim": 8}, "n_kv_heads"),
        ({"kind": LayerKind.FULL, "n_kv_heads": 2, "head_dim": -1}, "head_dim"),
        ({"kind": LayerKind.FULL, "head_dim": 8}, "n_kv_heads"),
        ({"kind": LayerKind.FULL, "n_kv_heads": 2}, "head_dim"),
        ({"kind": "full", "n_kv_heads": 2, "head_dim": 8}, "kind"),
        ({"kind": LayerKind.FULL, "n_kv_heads": 2, "head_dim": 8, "dtype": "f32"}, "dtype"),
    ],
)
def test_layer_spec_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        LayerSpec(layer_id=0, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, LayoutError)


def test_negative_layer_id_is_rejected() -> None:
    with pytest.raises(LayoutError, match="layer_id must be an int >= 0"):
        LayerSpec(layer_id=-1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=8)


def test_geometry_and_bytes() -> None:
    spec = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=8, head_dim=64, dtype=mx.bfloat16)
    assert spec.geometry.bytes_per_token == 2 * 8 * 64 * 2
    with pytest.raises(LayerKindError):
        _ = LayerSpec(layer_id=0, kind=LayerKind.STATE).geometry
    layout = layout_of([LayerKind.FULL, LayerKind.SLIDING, LayerKind.STATE])
    assert layout.full_kv_bytes_per_token() == 2 * (2 * 2 * 16 * 4)
    assert layout.window(1) == 16
    assert layout.window(0) is None
    assert "2 full" not in layout.describe()
    assert "1 full, 1 sliding, 1 state" in layout.describe()
    with pytest.raises(LayerKindError, match="not in layers"):
        layout.spec(3)


def test_value_heads_narrower_than_key_heads() -> None:
    spec = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=64, v_head_dim=16)
    assert spec.geometry.value_dim == 16
    assert spec.geometry.bytes_per_token == 2 * (64 + 16) * 4
    same = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=64, v_head_dim=64)
    assert same.v_head_dim is None  # stored as "as wide as K", so equal specs compare equal
    assert same == LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=64)
    assert same.geometry.value_dim == 64
    with pytest.raises(LayoutError, match="v_head_dim must be None for STATE layer 0"):
        LayerSpec(layer_id=0, kind=LayerKind.STATE, v_head_dim=8)
    with pytest.raises(LayoutError, match="v_head_dim of layer 0"):
        LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=64, v_head_dim=0)
    assert "x 64 (V 16)" in CacheLayout([spec]).describe()


NON_INT_IDS: list[object] = [1.0, 3.0, 1.5, True, False, None, "1", [1], (1,), {1: 1}, float("nan")]


@pytest.mark.parametrize("bad", NON_INT_IDS, ids=repr)
def test_lookups_refuse_non_int_ids_with_the_exact_text(bad: object) -> None:
    # 1.0 == 1 and hash(1.0) == hash(1): a plain dict lookup would answer for layer 1.
    layout = layout_of([LayerKind.SLIDING, LayerKind.FULL, LayerKind.STATE, LayerKind.FULL])
    lookups = (
        (layout.full_pool_index, "not in full attention layers", "dict_keys([1, 3])"),
        (layout.sliding_pool_index, "not in sliding window layers", "dict_keys([0])"),
        (layout.attention_index, "not in attention layers", "dict_keys([0, 1, 3])"),
    )
    for lookup, what, keys in lookups:
        with pytest.raises(ValueError) as info:
            lookup(bad)  # type: ignore[arg-type]
        assert isinstance(info.value, LayerKindError)
        layer_id = bad
        assert str(info.value) == f"{layer_id=} {what}: {keys}"
    with pytest.raises(LayerKindError, match="is not a layer id of this layout"):
        layout.spec(bad)  # type: ignore[arg-type]
    with pytest.raises(LayerKindError):
        layout.kind(bad)  # type: ignore[arg-type]


def test_lookups_accept_integer_types_such_as_numpy_ints() -> None:
    layout = layout_of([LayerKind.SLIDING, LayerKind.FULL, LayerKind.FULL])
    assert layout.full_pool_index(np.int64(2)) == 1  # type: ignore[arg-type]
    assert layout.sliding_pool_index(np.int32(0)) == 0  # type: ignore[arg-type]
    assert layout.attention_index(np.int16(2)) == 2  # type: ignore[arg-type]
    assert layout.spec(np.int64(1)).layer_id == 1  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("layer_id", 1.0),
        ("layer_id", True),
        ("layer_id", "0"),
        ("window", 8.0),
        ("window", 7.5),
        ("window", True),
        ("window", "8"),
        ("n_kv_heads", 8.0),
        ("n_kv_heads", True),
        ("head_dim", 64.0),
        ("head_dim", [64]),
    ],
    ids=repr,
)
def test_layer_spec_refuses_floats_bools_and_strings(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {
        "layer_id": 0,
        "kind": LayerKind.SLIDING,
        "window": 8,
        "n_kv_heads": 2,
        "head_dim": 64,
    }
    kwargs[field] = bad
    with pytest.raises(LayoutError) as info:
        LayerSpec(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)
    assert repr(bad) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_layer_spec_stores_integer_types_as_plain_ints() -> None:
    spec = LayerSpec(
        layer_id=np.int64(3),  # type: ignore[arg-type]
        kind=LayerKind.SLIDING,
        window=np.int32(8),  # type: ignore[arg-type]
        n_kv_heads=np.int64(2),  # type: ignore[arg-type]
        head_dim=np.int64(16),  # type: ignore[arg-type]
    )
    values = (spec.layer_id, spec.window, spec.n_kv_heads, spec.head_dim)
    assert values == (3, 8, 2, 16)
    assert all(type(v) is int for v in values)
    assert f"sliding-w{spec.window}" == "sliding-w8"


@pytest.mark.parametrize(
    "bad",
    [None, 5, 2.0, "ab", b"ab", [None], [make_spec(0, LayerKind.FULL), "x"], [1, 2]],
    ids=repr,
)
def test_cache_layout_refuses_what_is_not_an_iterable_of_specs(bad: object) -> None:
    with pytest.raises(LayoutError, match="CacheLayout takes") as info:
        CacheLayout(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, KVCacheError)


def test_cache_layout_refuses_a_single_spec_and_accepts_any_iterable() -> None:
    spec = make_spec(0, LayerKind.FULL)
    with pytest.raises(LayoutError, match="iterable of LayerSpec"):
        CacheLayout(spec)  # type: ignore[arg-type]
    layout = CacheLayout(make_spec(i, LayerKind.FULL) for i in range(3))
    assert layout.full_layer_ids == (0, 1, 2)
