"""RoPE + pool scatter: reference against independent oracles, native against reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_metal_kernels import (
    NATIVE_BACKENDS,
    NativeRopeScatter,
    ReferenceRopeScatter,
    backend_available,
)
from kv_metal_kernels._scatter import plan_scatter, scatter_token_rows
from kv_protocol import (
    KernelUnavailableError,
    RequestStateError,
    RopeConfig,
    ShapeMismatchError,
)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Tolerance of one rounding of the output dtype on values of magnitude ~4.
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class Case:
    q: mx.array
    k: mx.array
    v: mx.array
    positions: mx.array
    slots: mx.array
    k_pool: mx.array
    v_pool: mx.array
    rope: RopeConfig
    dtype_name: str


@st.composite
def cases(draw: st.DrawFn, max_tokens: int = 6) -> Case:
    hkv = draw(st.sampled_from([1, 2, 4, 8]))
    ratio = draw(st.sampled_from([r for r in (1, 2, 4, 8) if hkv * r <= 32]))
    hq = hkv * ratio
    d = draw(st.sampled_from([64, 80, 128, 256]))
    dims = draw(st.sampled_from(sorted({d, d // 2, 2, 2 * draw(st.integers(1, d // 2))})))
    rope = RopeConfig(
        dims=dims,
        traditional=draw(st.booleans()),
        base=draw(st.sampled_from([10000.0, 500000.0, 1234.5, 150.0])),
        scale=draw(st.sampled_from([1.0, 0.25, 0.5, 2.0])),
    )
    dtype_name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[dtype_name]
    t = draw(st.integers(1, max_tokens))
    num_slots = draw(st.integers(t, max(t, 24)))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    # Distinct in-range slots; some tokens skip (negative slot: rotate, do not write).
    slots = rng.permutation(num_slots)[:t].astype(np.int32)
    skip = rng.random(t) < 0.3
    slots[skip] = rng.choice([-1, -7], size=int(skip.sum()))
    positions = rng.integers(0, 2048, size=t).astype(np.int32)

    def arr(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return Case(
        q=arr(t, hq, d),
        k=arr(t, hkv, d),
        v=arr(t, hkv, d),
        positions=mx.array(positions),
        slots=mx.array(slots),
        k_pool=arr(hkv, num_slots, d),
        v_pool=arr(hkv, num_slots, d),
        rope=rope,
        dtype_name=dtype_name,
    )


def rope_oracle(x: mx.array, positions: mx.array, rope: RopeConfig) -> mx.array:
    """mx.fast.rope applied to each token alone at its (scalar) position."""
    rows = []
    for t in range(x.shape[0]):
        token = x[t][None, :, None, :]  # (1, H, L=1, D)
        rows.append(
            mx.fast.rope(
                token,
                rope.dims,
                traditional=rope.traditional,
                base=rope.base,
                scale=rope.scale,
                offset=int(positions[t]),
            )[0, :, 0, :]
        )
    return mx.stack(rows)


def rope_float64(x: np.ndarray, positions: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """The RoPE formula in float64 numpy, written from its definition."""
    out = x.astype(np.float64).copy()
    half = rope.dims // 2
    inv_freq = rope.base ** (-np.arange(half, dtype=np.float64) / half)
    theta = positions.astype(np.float64)[:, None] * rope.scale * inv_freq[None, :]  # (T, half)
    cos = np.cos(theta)[:, None, :]
    sin = np.sin(theta)[:, None, :]
    if rope.traditional:
        x1, x2 = out[..., 0 : rope.dims : 2].copy(), out[..., 1 : rope.dims : 2].copy()
        out[..., 0 : rope.dims : 2] = x1 * cos - x2 * sin
        out[..., 1 : rope.dims : 2] = x1 * sin + x2 * cos
    else:
        x1, x2 = out[..., :half].copy(), out[..., half : rope.dims].copy()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : rope.dims] = x1 * sin + x2 * cos
    return out


def scatter_oracle(pool: mx.array, slots: mx.array, rows: mx.array) -> np.ndarray:
    """Plain index assignment, token by token, skipping negative slots."""
    out = np.array(pool.astype(mx.float32))
    values = np.array(rows.astype(mx.float32))
    for t, slot in enumerate(np.array(slots).tolist()):
        if slot >= 0:
            out[:, slot, :] = values[t]
    return out


def f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def assert_close(got: mx.array, want: mx.array | np.ndarray, tol: float) -> None:
    want_np = want if isinstance(want, np.ndarray) else f32(want)
    np.testing.assert_allclose(f32(got), want_np, atol=tol * 4, rtol=tol)


@settings(max_examples=40)
@given(cases())
def test_reference_matches_per_token_rope_and_index_assignment(case: Case) -> None:
    q_rot, k_rot, k_new, v_new = ReferenceRopeScatter()(
        case.q,
        case.k,
        case.v,
        case.positions,
        case.slots,
        case.k_pool,
        case.v_pool,
        rope=case.rope,
    )
    tol = TOL[case.dtype_name]
    assert q_rot.dtype == case.q.dtype and k_new.dtype == case.k_pool.dtype
    assert_close(q_rot, rope_oracle(case.q, case.positions, case.rope), tol)
    assert_close(k_rot, rope_oracle(case.k, case.positions, case.rope), tol)
    # The pool write is an exact copy of the rotated rows (no arithmetic).
    np.testing.assert_array_equal(f32(k_new), scatter_oracle(case.k_pool, case.slots, k_rot))
    np.testing.assert_array_equal(f32(v_new), scatter_oracle(case.v_pool, case.slots, case.v))


@settings(max_examples=15)
@given(cases())
def test_reference_float32_matches_the_formula(case: Case) -> None:
    q = case.q.astype(mx.float32)
    k = case.k.astype(mx.float32)
    kp = case.k_pool.astype(mx.float32)
    vp = case.v_pool.astype(mx.float32)
    v = case.v.astype(mx.float32)
    q_rot, k_rot, _, _ = ReferenceRopeScatter()(
        q, k, v, case.positions, case.slots, kp, vp, rope=case.rope
    )
    positions = np.array(case.positions)
    # float32 angles at positions < 2048 carry ~2048 * scale * 2**-24 rad of error.
    tol = 3e-3 * max(case.rope.scale, 1.0)
    np.testing.assert_allclose(
        f32(q_rot), rope_float64(np.array(q), positions, case.rope), atol=tol
    )
    np.testing.assert_allclose(
        f32(k_rot), rope_float64(np.array(k), positions, case.rope), atol=tol
    )


def test_negative_slots_leave_the_pool_bit_identical() -> None:
    rng = np.random.default_rng(0)
    pool = mx.array(rng.standard_normal((2, 8, 64)).astype(np.float32)).astype(mx.bfloat16)
    before = np.array(pool.view(mx.uint16))
    k = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32)).astype(mx.bfloat16)
    pool = mx.where(mx.arange(8)[None, :, None] == 3, -0.0, pool).astype(mx.bfloat16)
    before = np.array(pool.view(mx.uint16))
    slots = mx.array([-1, -2, -100], dtype=mx.int32)
    positions = mx.array([5, 6, 7], dtype=mx.int32)
    _, _, k_new, v_new = ReferenceRopeScatter()(
        k, k, k, positions, slots, pool, pool, rope=RopeConfig(dims=64)
    )
    np.testing.assert_array_equal(np.array(k_new.view(mx.uint16)), before)
    np.testing.assert_array_equal(np.array(v_new.view(mx.uint16)), before)


def test_scatter_plan_and_rows() -> None:
    pool = mx.zeros((1, 4, 2))
    rows = mx.array([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    plan = plan_scatter(mx.array([-1, 0, -1], dtype=mx.int32), 4)
    assert plan.tokens == (1,) and plan.slots == (0,) and not plan.writes_all
    out = scatter_token_rows(pool, plan, rows)
    np.testing.assert_array_equal(np.array(out)[0, :, 0], [2.0, 0.0, 0.0, 0.0])
    out = scatter_token_rows(pool, plan_scatter([3, -1, 1], 4), rows)
    np.testing.assert_array_equal(np.array(out)[0, :, 0], [0.0, 3.0, 0.0, 1.0])
    assert plan_scatter([2, 0, 1], 4).writes_all
    assert scatter_token_rows(pool, plan_scatter([-1, -1, -1], 4), rows) is pool


@settings(max_examples=15)
@given(st.data())
def test_repeated_calls_accumulate(data: st.DataObject) -> None:
    first = data.draw(cases(max_tokens=4))
    kernel = ReferenceRopeScatter()
    k_pool, v_pool = first.k_pool, first.v_pool
    want_k = f32(k_pool)
    want_v = f32(v_pool)
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    num_slots = k_pool.shape[1]
    for step in range(3):
        t = first.q.shape[0]
        slots = rng.permutation(num_slots)[:t].astype(np.int32)
        slots[rng.random(t) < 0.25] = -1
        q = first.q * (step + 1)
        k = first.k * (step + 2)
        v = first.v * (step + 3)
        positions = first.positions + step
        _, k_rot, k_pool, v_pool = kernel(
            q, k, v, positions, mx.array(slots), k_pool, v_pool, rope=first.rope
        )
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want_k[:, slot] = f32(k_rot[i])
                want_v[:, slot] = f32(v[i])
    np.testing.assert_array_equal(f32(k_pool), want_k)
    np.testing.assert_array_equal(f32(v_pool), want_v)


def _good_args() -> dict[str, mx.array]:
    return {
        "q": mx.zeros((2, 4, 64)),
        "k": mx.zeros((2, 2, 64)),
        "v": mx.zeros((2, 2, 64)),
        "positions": mx.array([0, 1], dtype=mx.int32),
        "slots": mx.array([1, 2], dtype=mx.int32),
        "k_pool": mx.zeros((2, 8, 64)),
        "v_pool": mx.zeros((2, 8, 64)),
    }


BAD_INPUTS = [
    ("q", mx.zeros((2, 4, 1, 64)), "q must be 3-D"),
    ("k", mx.zeros((2, 64)), "k must be 3-D"),
    ("v", mx.zeros((2, 2, 32)), "v shape must match k shape"),
    ("q", mx.zeros((3, 4, 64)), "same token count"),
    ("q", mx.zeros((2, 3, 64)), "multiple of kv heads"),
    ("k_pool", mx.zeros((8, 2, 64)), "does not match k"),
    ("v_pool", mx.zeros((2, 9, 64)), "k_pool and v_pool must have the same shape"),
    ("positions", mx.array([0, 1], dtype=mx.int64), "positions must be int32"),
    ("slots", mx.array([0, 1, 2], dtype=mx.int32), "one entry per token"),
    ("q", mx.zeros((2, 4, 64), dtype=mx.float16), "share one dtype"),
    ("k_pool", mx.zeros((2, 8, 64), dtype=mx.float16), "pool dtypes must match"),
    ("q", mx.zeros((2, 4, 64), dtype=mx.int32), "float16, bfloat16 or float32"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_INPUTS)
def test_bad_inputs_raise_before_any_work(name: str, value: mx.array, message: str) -> None:
    args = _good_args()
    args[name] = value
    if name == "k_pool":
        args["v_pool"] = value
    with pytest.raises(ShapeMismatchError, match=message):
        ReferenceRopeScatter()(**args, rope=RopeConfig(dims=64))


def test_rotary_dims_must_fit_and_be_even() -> None:
    with pytest.raises(ShapeMismatchError, match="must be <= head_dim"):
        ReferenceRopeScatter()(**_good_args(), rope=RopeConfig(dims=128))
    with pytest.raises(ShapeMismatchError, match="must be even"):
        RopeConfig(dims=63)


def test_slot_past_the_end_and_duplicates_raise_before_any_work() -> None:
    args = _good_args()
    args["slots"] = mx.array([1, 8], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="slot 8 of token 1 is past the end"):
        ReferenceRopeScatter()(**args, rope=RopeConfig(dims=64))
    args["slots"] = mx.array([3, 3], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="same pool slot 3"):
        ReferenceRopeScatter()(**args, rope=RopeConfig(dims=64))
    args["slots"] = mx.array([-1, -1], dtype=mx.int32)
    ReferenceRopeScatter()(**args, rope=RopeConfig(dims=64))


def test_validate_mode_checks_positions() -> None:
    args = _good_args()
    args["positions"] = mx.array([0, -3], dtype=mx.int32)
    with pytest.raises(RequestStateError, match="positions must be >= 0"):
        ReferenceRopeScatter(validate=True)(**args, rope=RopeConfig(dims=64))


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_native_backend_unavailable_is_a_clear_error(backend: str) -> None:
    if backend_available(backend):
        pytest.skip(f"{backend} is available on this machine")
    with pytest.raises(KernelUnavailableError, match=f"{backend!r} is not available"):
        NativeRopeScatter(backend)


def _native_params() -> list[object]:
    return [
        pytest.param(
            b,
            marks=pytest.mark.skipif(
                not backend_available(b), reason=f"no {b} back-end in this MLX build / machine"
            ),
        )
        for b in NATIVE_BACKENDS
    ]


@pytest.mark.parametrize("backend", _native_params())
@settings(max_examples=40)
@given(case=cases(max_tokens=40))
def test_native_matches_reference(backend: str, case: Case) -> None:
    args = (case.q, case.k, case.v, case.positions, case.slots, case.k_pool, case.v_pool)
    want = ReferenceRopeScatter()(*args, rope=case.rope)
    got = NativeRopeScatter(backend)(*args, rope=case.rope)
    mx.eval(got, want)
    # GPU sin/cos of angles up to ~4000 rad differ by a few ulp of the angle.
    tol = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}[case.dtype_name]
    for g, w in zip(got[:2], want[:2], strict=True):
        assert g.dtype == w.dtype
        assert_close(g, w, tol)
    # Pools hold exactly the rows each backend rotated.
    np.testing.assert_array_equal(f32(got[2]), scatter_oracle(case.k_pool, case.slots, got[1]))
    np.testing.assert_array_equal(f32(got[3]), f32(want[3]))


@pytest.mark.parametrize("backend", _native_params())
def test_native_large_batch_and_positions(backend: str) -> None:
    rng = np.random.default_rng(1)
    t, hq, hkv, d = 64, 64, 8, 64
    q = mx.array(rng.standard_normal((t, hq, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((t, hkv, d)).astype(np.float32))
    pool = mx.zeros((hkv, 4096, d))
    positions = mx.array(rng.integers(0, 16384, t).astype(np.int32))
    slots = mx.array(rng.permutation(4096)[:t].astype(np.int32))
    rope = RopeConfig(dims=d, base=150000.0)
    want = ReferenceRopeScatter()(q, k, k, positions, slots, pool, pool, rope=rope)
    got = NativeRopeScatter(backend)(q, k, k, positions, slots, pool, pool, rope=rope)
    assert_close(got[0], want[0], 2e-3)
    assert_close(got[2], want[2], 2e-3)
    assert math.isfinite(float(mx.abs(got[0]).max()))


def test_pool_write_is_in_place_when_the_old_buffer_is_released() -> None:
    """A decode step must not copy the pool: peak memory grows by far less than a pool."""
    h, num_slots, d, t = 8, 16384, 64, 8
    pools = [mx.zeros((h, num_slots, d)), mx.zeros((h, num_slots, d))]
    q = mx.ones((t, 16, d))
    k = mx.ones((t, h, d))
    positions = mx.arange(t, dtype=mx.int32)
    slots = mx.array([5, -1, 9, 100, 2000, 7, -1, 16383], dtype=mx.int32)
    mx.eval(pools, q, k, positions, slots)
    kernel = ReferenceRopeScatter()
    pool_bytes = pools[0].nbytes
    for _ in range(2):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = kernel(q, k, k, positions, slots, pools[0], pools[1], rope=RopeConfig(dims=d))
        pools = [out[2], out[3]]
        del out
        mx.eval(pools)
        assert mx.get_peak_memory() - base < pool_bytes // 4
    np.testing.assert_array_equal(np.array(pools[1][:, 16383]), np.ones((h, d), np.float32))
