from __future__ import annotations

import pytest

import kv_protocol
from kv_protocol import (
    CacheStateError,
    FusedRopeConfigError,
    InvalidPageError,
    KernelUnavailableError,
    KVCacheError,
    LayerKindError,
    LayoutError,
    PoolExhaustedError,
    RequestStateError,
    RopeConfig,
    ShapeMismatchError,
    TransferTimeoutError,
    UnknownBackendError,
    UnknownRequestError,
    UnsupportedModelError,
)

EXPECTED_BUILTIN = {
    LayoutError: ValueError,
    LayerKindError: ValueError,
    ShapeMismatchError: ValueError,
    UnsupportedModelError: ValueError,
    InvalidPageError: ValueError,
    RequestStateError: ValueError,
    CacheStateError: RuntimeError,
    KernelUnavailableError: RuntimeError,
    UnknownRequestError: KeyError,
    TransferTimeoutError: TimeoutError,
    UnknownBackendError: ValueError,
    FusedRopeConfigError: ValueError,
    PoolExhaustedError: MemoryError,
}

#: Errors that are also a second builtin (or a more specific project error).
ALSO_DERIVES: dict[type[KVCacheError], tuple[type[Exception], ...]] = {
    UnknownBackendError: (KernelUnavailableError, RuntimeError),
}


def _make(error: type[KVCacheError]) -> KVCacheError:
    if error is PoolExhaustedError:
        return PoolExhaustedError(sub_pool="full", pages_requested=2, pages_free=1)
    return error("boom")


@pytest.mark.parametrize(("error", "builtin"), list(EXPECTED_BUILTIN.items()))
def test_each_error_is_catchable_both_ways(
    error: type[KVCacheError], builtin: type[Exception]
) -> None:
    with pytest.raises(KVCacheError):
        raise _make(error)
    with pytest.raises(builtin):
        raise _make(error)
    for also in ALSO_DERIVES.get(error, ()):
        with pytest.raises(also):
            raise _make(error)


def test_pool_exhausted_names_sub_pool_and_counts() -> None:
    err = PoolExhaustedError(sub_pool="sliding-w128", pages_requested=5, pages_free=2)
    assert isinstance(err, MemoryError)
    assert isinstance(err, KVCacheError)
    assert "'sliding-w128'" in str(err)
    assert "5 pages requested, 2 free" in str(err)
    assert (err.sub_pool, err.pages_requested, err.pages_free) == ("sliding-w128", 5, 2)


def test_unknown_request_message_is_not_quoted() -> None:
    assert str(UnknownRequestError("request 7 is not known")) == "request 7 is not known"


def test_every_exported_error_derives_from_the_base_and_a_builtin() -> None:
    errors = {
        obj
        for name in kv_protocol.__all__
        if isinstance(obj := getattr(kv_protocol, name), type) and issubclass(obj, Exception)
    }
    assert KVCacheError in errors
    concrete = errors - {KVCacheError}
    # Every exported concrete error is listed above (a new one must be added there) ...
    assert concrete == set(EXPECTED_BUILTIN)
    assert len(concrete) == 13
    for error in concrete:
        # ... derives from the base and from the builtin callers expect ...
        assert issubclass(error, KVCacheError), error
        assert issubclass(error, EXPECTED_BUILTIN[error]), error
        # ... and that builtin is not Exception itself.
        assert EXPECTED_BUILTIN[error] is not Exception


def test_unknown_backend_is_a_value_error_and_a_kernel_unavailable_error() -> None:
    err = UnknownBackendError("unknown kernel backend 'bogus'")
    assert isinstance(err, ValueError)
    assert isinstance(err, RuntimeError)
    assert isinstance(err, KernelUnavailableError)
    assert not issubclass(KernelUnavailableError, ValueError)


def test_fused_rope_config_error_keeps_the_design_text() -> None:
    text = (
        "BatchedDecodeContext requires full_kv_pool_index_by_layer when the fused AOT RoPE "
        "+ pool-scatter kernel is active"
    )
    with pytest.raises(ValueError) as info:
        raise FusedRopeConfigError(text)
    assert str(info.value) == text
    assert isinstance(info.value, KVCacheError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"dims": 7}, "even"), ({"dims": 0}, ">= 2"), ({"dims": 8, "base": 0.0}, "base")],
)
def test_rope_config_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ShapeMismatchError, match=message):
        RopeConfig(**kwargs)  # type: ignore[arg-type]
