"""KVQuantization, QuantizedKV and gather_slots against mx.quantize / mx.dequantize themselves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_protocol import (
    KVGeometry,
    KVQuantization,
    LayerKind,
    LayoutError,
    QuantizedKV,
    gather_slots,
    kv_quantization_choice,
    kv_quantization_for,
)


@pytest.mark.parametrize("bits", [0, 2, 3, 5, 16, 8.0, "8", None, True])
def test_unsupported_bit_widths_are_refused(bits: object) -> None:
    with pytest.raises(LayoutError, match=r"kv_bits must be one of \(4, 8\)"):
        KVQuantization(bits=bits)  # type: ignore[arg-type]


@pytest.mark.parametrize("group_size", [0, 16, 48, 256, 64.0])
def test_unsupported_group_sizes_are_refused(group_size: object) -> None:
    with pytest.raises(LayoutError, match=r"kv_group_size must be one of \(32, 64, 128\)"):
        KVQuantization(bits=8, group_size=group_size)  # type: ignore[arg-type]


def test_a_head_width_the_groups_do_not_tile_is_refused_with_a_hint() -> None:
    with pytest.raises(LayoutError, match="head_dim 80 is not a multiple of kv_group_size 64"):
        KVQuantization(bits=8, group_size=64).check_dim(80, "sub-pool 'full'")
    with pytest.raises(LayoutError, match="use kv_group_size 32"):
        KVQuantization(bits=8, group_size=128).check_dim(96, "x")
    with pytest.raises(LayoutError, match="leave this layer unquantized"):
        KVQuantization(bits=4, group_size=32).check_dim(16, "x")


@settings(max_examples=30)
@given(
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64, 128]),
    groups=st.integers(1, 4),
    heads=st.integers(1, 4),
    v_groups=st.integers(1, 4),
    dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]),
)
def test_stored_bytes_are_the_bytes_mx_quantize_produces(
    bits: int, group: int, groups: int, heads: int, v_groups: int, dtype: mx.Dtype
) -> None:
    quant = KVQuantization(bits=bits, group_size=group)
    d, dv = group * groups, group * v_groups
    geometry = KVGeometry(n_kv_heads=heads, head_dim=d, dtype=dtype, v_head_dim=dv)
    k = quant.quantize(mx.zeros((heads, 1, d), dtype=dtype))
    v = quant.quantize(mx.zeros((heads, 1, dv), dtype=dtype))
    assert quant.bytes_per_token(geometry) == k.nbytes + v.nbytes
    assert k.shape == (heads, 1, d) and k.dtype == dtype and k.ndim == 3


def test_quantized_fp16_rows_take_about_half_and_a_quarter_of_the_bytes() -> None:
    geometry = KVGeometry(n_kv_heads=8, head_dim=64, dtype=mx.float16)
    plain = geometry.bytes_per_token
    ratios = {
        (bits, group): plain / KVQuantization(bits=bits, group_size=group).bytes_per_token(geometry)
        for bits in (8, 4)
        for group in (32, 64)
    }
    assert ratios[(8, 32)] == pytest.approx(1.78, abs=0.01)
    assert ratios[(8, 64)] == pytest.approx(1.88, abs=0.01)
    assert ratios[(4, 32)] == pytest.approx(3.2, abs=0.01)
    assert ratios[(4, 64)] == pytest.approx(3.56, abs=0.01)


@settings(max_examples=30)
@given(
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**31 - 1),
    picks=st.lists(st.integers(0, 11), min_size=1, max_size=20),
)
def test_gather_then_dequantize_equals_mlx_dequantize_of_the_rows(
    bits: int, group: int, seed: int, picks: list[int]
) -> None:
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((2, 12, 64)).astype(np.float32) * 3)
    quant = KVQuantization(bits=bits, group_size=group)
    stored = quant.quantize(x)
    w, s, b = mx.quantize(x, group_size=group, bits=bits)
    oracle = mx.dequantize(w, s, b, group_size=group, bits=bits)
    slots = mx.array(picks, dtype=mx.int32)
    got = gather_slots(stored, slots)
    np.testing.assert_array_equal(np.array(got), np.array(oracle[:, slots]))
    np.testing.assert_array_equal(np.array(gather_slots(x, slots)), np.array(x[:, slots]))
    # The error is the rounding's: within one step (a group's scale) of the input.
    step = float(np.abs(np.array(s)).max())
    assert float(mx.abs(got - x[:, slots]).max()) <= step * 1.01


def test_zeros_buffers_have_the_stored_layout() -> None:
    buf = KVQuantization(bits=4, group_size=32).zeros((2, 48, 64), mx.bfloat16)
    assert isinstance(buf, QuantizedKV)
    assert buf.data.shape == (2, 48, 8) and buf.data.dtype == mx.uint32
    assert buf.scales.shape == buf.biases.shape == (2, 48, 2)
    assert buf.shape == (2, 48, 64) and buf.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(buf.dequantize().astype(mx.float32)), 0.0)


def test_quantization_by_sub_pool_name_or_layer_kind() -> None:
    q8, q4 = KVQuantization(bits=8), KVQuantization(bits=4)
    full, sliding = LayerKind.FULL, LayerKind.SLIDING
    assert kv_quantization_for(None, sub_pool="full", kind=full) is None
    assert kv_quantization_for(q8, sub_pool="sliding-w8", kind=sliding) is q8
    by_kind = {"sliding": q4}
    assert kv_quantization_for(by_kind, sub_pool="sliding-w8", kind=sliding) is q4
    assert kv_quantization_for(by_kind, sub_pool="full", kind=full) is None
    named = {"sliding-w8": q8, "sliding": q4}  # the sub-pool's own name wins
    assert kv_quantization_for(named, sub_pool="sliding-w8", kind=sliding) is q8
    assert kv_quantization_for(named, sub_pool="sliding-w16", kind=sliding) is q4
    with pytest.raises(LayoutError, match="must be a KVQuantization or None"):
        kv_quantization_for({"full": 8}, sub_pool="full", kind=full)  # type: ignore[dict-item]
    with pytest.raises(LayoutError, match="kv_quantization must be"):
        kv_quantization_for(8, sub_pool="full", kind=full)  # type: ignore[arg-type]


def test_the_flat_choice_of_a_command_line() -> None:
    assert kv_quantization_choice(None) is None
    assert kv_quantization_choice(8, 32) == KVQuantization(bits=8, group_size=32)
    assert kv_quantization_choice(4, layers="full") == {
        "full": KVQuantization(bits=4),
        "sliding": None,
    }
    assert kv_quantization_choice(8, layers="sliding") == {
        "sliding": KVQuantization(bits=8),
        "full": None,
    }
    with pytest.raises(LayoutError, match="must be one of"):
        kv_quantization_choice(8, layers="state")
    with pytest.raises(LayoutError, match="kv_bits"):
        kv_quantization_choice(6)
