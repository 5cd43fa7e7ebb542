"""Bad index values never reach a gather or a kernel: refused with the pool's error types."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kv_metal_kernels._validate as validate_module
from kv_metal_kernels import (
    NATIVE_BACKENDS,
    NativePagedAttention,
    ReferencePagedAttention,
    ReferenceRopeScatter,
    backend_available,
    paged_decode_attention,
    select_kernels,
)
from kv_metal_kernels._scatter import plan_scatter
from kv_protocol import (
    KVCacheError,
    PagedDecodeAttention,
    RequestStateError,
    RopeConfig,
    ShapeMismatchError,
)

PAGE, HKV, HQ, D = 4, 2, 4, 16
NUM_PAGES = 8  # pages 0 .. 7 (page 0 is the null page)


def kernels() -> list[tuple[str, PagedDecodeAttention]]:
    found: list[tuple[str, PagedDecodeAttention]] = [
        ("select_kernels", select_kernels().attention),
        ("reference", ReferencePagedAttention()),
        ("reference-unbucketed", ReferencePagedAttention(buckets=0)),
    ]
    for backend in NATIVE_BACKENDS:
        if backend_available(backend):
            found.append((backend, NativePagedAttention(backend)))
    return found


KERNELS = kernels()


def args(
    page_table: list[list[int]] | None = None, seq_lens: list[int] | None = None
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    table = page_table if page_table is not None else [[1, 2, 3], [4, 5, 0]]
    lens = seq_lens if seq_lens is not None else [9, 5]
    b = len(table)
    return {
        "q": mx.array(rng.standard_normal((b, HQ, 1, D)).astype(np.float32)),
        "k_pool": mx.array(rng.standard_normal((HKV, NUM_PAGES * PAGE, D)).astype(np.float32)),
        "v_pool": mx.array(rng.standard_normal((HKV, NUM_PAGES * PAGE, D)).astype(np.float32)),
        "page_table": mx.array(table, dtype=mx.int32),
        "seq_lens": mx.array(lens, dtype=mx.int32),
        "page_size": PAGE,
        "scale": D**-0.5,
    }


BAD_VALUES = [
    ([[1, 2, 3], [4, 5, NUM_PAGES]], [9, 5], r"page_table entries must lie in 0 \.\. 7"),
    ([[1, 2, 3], [4, 5, -1]], [9, 5], r"page_table entries must lie in 0 \.\. 7"),
    ([[-(2**31), 2, 3], [4, 5, 0]], [9, 5], r"page_table entries must lie in 0 \.\. 7"),
    ([[1, 2, 3], [4, 5, 0]], [13, 5], "seq_len 13 needs more pages"),
    ([[1, 2, 3], [4, 5, 0]], [9, 0], "seq_lens must be >= 1"),
    ([[1, 2, 3], [4, 5, 0]], [-4, 5], "seq_lens must be >= 1"),
    ([[1, 2, 3], [4, 5, 0]], [9, 2**31 - 1], "needs more pages"),
]


@pytest.mark.parametrize(("name", "kernel"), KERNELS, ids=[n for n, _ in KERNELS])
@pytest.mark.parametrize(("table", "lens", "message"), BAD_VALUES)
@pytest.mark.parametrize("window", [None, 4])
def test_bad_page_ids_and_lengths_are_refused_by_default(
    name: str,
    kernel: PagedDecodeAttention,
    table: list[list[int]],
    lens: list[int],
    message: str,
    window: int | None,
) -> None:
    with pytest.raises(RequestStateError, match=message) as info:
        kernel(**args(table, lens), window=window)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVCacheError)


@pytest.mark.parametrize(("table", "lens", "message"), BAD_VALUES[:4])
def test_the_functional_form_checks_values_too(
    table: list[list[int]], lens: list[int], message: str
) -> None:
    with pytest.raises(RequestStateError, match=message):
        paged_decode_attention(**args(table, lens))


def test_a_huge_page_id_does_not_crash_the_process() -> None:
    # Before the check, this gather read far outside the pool and segfaulted (rc -11).
    code = textwrap.dedent(
        """
        import mlx.core as mx
        from kv_metal_kernels import select_kernels
        from kv_protocol import RequestStateError
        k = mx.zeros((2, 32, 16)); v = mx.zeros((2, 32, 16)); q = mx.zeros((2, 4, 1, 16))
        table = mx.array([[1, 2], [3, 100_000_000]], dtype=mx.int32)
        lens = mx.array([5, 8], dtype=mx.int32)
        try:
            out = select_kernels().attention(q, k, v, table, lens, page_size=4, scale=0.25)
            mx.eval(out)
            print("NOT REFUSED")
        except RequestStateError as err:
            print("REFUSED", err)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("REFUSED"), done.stdout
    assert "page_table entries must lie in 0 .. 7" in done.stdout


@pytest.mark.parametrize(("name", "kernel"), KERNELS, ids=[n for n, _ in KERNELS])
def test_valid_edges_are_accepted(name: str, kernel: PagedDecodeAttention) -> None:
    # Page 0 (the null page padding points to), the last page, and a length that fills
    # every column of the page table are all valid.
    out = kernel(**args([[1, 2, NUM_PAGES - 1], [0, 0, 0]], [3 * PAGE, 1]))
    assert out.shape == (2, HQ, 1, D)
    assert bool(mx.all(mx.isfinite(out)))


def count_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original: Callable[[list[mx.array]], list[tuple[int, int]]] = validate_module._value_ranges

    def wrapper(arrays: list[mx.array]) -> list[tuple[int, int]]:
        calls.append(len(arrays))
        return original(arrays)

    monkeypatch.setattr(validate_module, "_value_ranges", wrapper)
    return calls


def test_values_are_checked_once_per_array_object(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_checks(monkeypatch)
    kernel = ReferencePagedAttention()
    step = args()
    for _ in range(6):  # six layers of one sub-pool, one step
        kernel(**step)
    assert calls == [2]  # one fused reduction over seq_lens and the page table
    # A second sub-pool of the same step: a new page table, the same seq_lens object.
    other = {**step, "page_table": mx.array([[3, 2, 1], [5, 4, 0]], dtype=mx.int32)}
    for _ in range(6):
        kernel(**other)
    assert calls == [2, 1]
    # The next step: new arrays are checked afresh.
    kernel(**args())
    assert calls == [2, 1, 2]


def test_validate_mode_checks_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_checks(monkeypatch)
    kernel = ReferencePagedAttention(validate=True)
    step = args()
    for _ in range(3):
        kernel(**step)
    assert calls == [2, 2, 2]


def test_a_bad_array_is_refused_on_every_call_and_never_remembered() -> None:
    kernel = ReferencePagedAttention()
    bad = args([[1, 2, 3], [4, 5, NUM_PAGES]])
    for _ in range(3):
        with pytest.raises(RequestStateError):
            kernel(**bad)
    # The page table checked against an 8-page pool is checked again against a smaller one.
    good = args()
    kernel(**good)
    small = {
        **good,
        "k_pool": good["k_pool"][:, : 4 * PAGE],
        "v_pool": good["v_pool"][:, : 4 * PAGE],
    }
    with pytest.raises(RequestStateError, match=r"0 \.\. 3"):
        kernel(**small)
    # And seq_lens checked against a 3-column table is checked again against a 2-column one.
    narrow = {**good, "page_table": good["page_table"][:, :2]}
    with pytest.raises(RequestStateError, match="seq_len 9 needs more pages"):
        kernel(**narrow)


def test_an_empty_batch_needs_no_value_check() -> None:
    out = ReferencePagedAttention()(
        **{
            **args(),
            "q": mx.zeros((0, HQ, 1, D)),
            "page_table": mx.zeros((0, 1), dtype=mx.int32),
            "seq_lens": mx.zeros((0,), dtype=mx.int32),
        }
    )
    assert out.shape == (0, HQ, 1, D)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("scale", float("nan"), "scale must be a finite number"),
        ("scale", float("inf"), "scale must be a finite number"),
        ("scale", True, "scale must be a finite number"),
        ("scale", "0.25", "scale must be a finite number"),
        ("page_size", 4.0, "page_size must be an int >= 1"),
        ("page_size", True, "page_size must be an int >= 1"),
        ("window", 4.0, "window must be None or an int >= 1"),
        ("window", True, "window must be None or an int >= 1"),
        ("window", "4", "window must be None or an int >= 1"),
    ],
    ids=repr,
)
def test_bad_scalar_arguments_are_shape_mismatch_errors(
    name: str, value: object, message: str
) -> None:
    with pytest.raises(ShapeMismatchError, match=message):
        ReferencePagedAttention()(**{**args(), name: value})


def test_integer_types_are_accepted_for_scalar_arguments() -> None:
    out = ReferencePagedAttention()(
        **{**args(), "page_size": np.int64(PAGE), "scale": np.float32(0.25)},
        window=np.int32(4),  # type: ignore[arg-type]
    )
    assert out.shape == (2, HQ, 1, D)


@pytest.mark.parametrize("buckets", [1.0, True, -1, "4"], ids=repr)
def test_bad_bucket_counts_are_refused(buckets: object) -> None:
    with pytest.raises(ShapeMismatchError, match="buckets must be an int >= 0"):
        ReferencePagedAttention(buckets=buckets)  # type: ignore[arg-type]


# ---------------------------------------------------------------- scatter slots


def rope_args(slots: list[int], num_slots: int = 8) -> dict[str, mx.array]:
    t = len(slots)
    return {
        "q": mx.zeros((t, 4, 64)),
        "k": mx.zeros((t, 2, 64)),
        "v": mx.zeros((t, 2, 64)),
        "positions": mx.arange(t, dtype=mx.int32),
        "slots": mx.array(slots, dtype=mx.int32),
        "k_pool": mx.zeros((2, num_slots, 64)),
        "v_pool": mx.zeros((2, num_slots, 64)),
    }


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([1, 8], "past the end of the pool"),
        ([1, 2**31 - 1], "past the end of the pool"),
        ([3, 3], "same pool slot 3"),
        ([2, -1, 2], "same pool slot 2"),
    ],
)
def test_bad_slot_values_are_request_state_errors_like_the_pool(
    slots: list[int], message: str
) -> None:
    # HybridKVPool.set_kv raises RequestStateError for out-of-range and repeated slot
    # values (and ShapeMismatchError for a wrong rank or dtype); the kernels do the same.
    with pytest.raises(RequestStateError, match=message):
        ReferenceRopeScatter()(**rope_args(slots), rope=RopeConfig(dims=64))
    with pytest.raises(RequestStateError, match=message):
        plan_scatter(mx.array(slots, dtype=mx.int32), 8)


@pytest.mark.parametrize(
    ("name", "value"),
    [("slots", mx.array([[1, 2]], dtype=mx.int32)), ("slots", mx.array([1, 2], dtype=mx.int64))],
)
def test_slot_rank_and_dtype_stay_shape_mismatch_errors(name: str, value: mx.array) -> None:
    with pytest.raises(ShapeMismatchError):
        ReferenceRopeScatter()(**{**rope_args([1, 2]), name: value}, rope=RopeConfig(dims=64))


@pytest.mark.parametrize("bad", [1.0, 2.5, True, None, "1"], ids=repr)
def test_a_slot_sequence_with_a_non_int_is_refused(bad: object) -> None:
    with pytest.raises(RequestStateError, match="of token 1 is not an int"):
        plan_scatter([0, bad, 2], 8)  # type: ignore[list-item]


def test_negative_positions_are_request_state_errors_in_validate_mode() -> None:
    rope_in = {**rope_args([1, 2]), "positions": mx.array([0, -3], dtype=mx.int32)}
    with pytest.raises(RequestStateError, match="positions must be >= 0"):
        ReferenceRopeScatter(validate=True)(**rope_in, rope=RopeConfig(dims=64))
