from __future__ import annotations

import pytest

import kv_protocol
from kv_protocol import (
    CacheStateError,
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
}


@pytest.mark.parametrize(("error", "builtin"), list(EXPECTED_BUILTIN.items()))
def test_each_error_is_catchable_both_ways(
    error: type[KVCacheError], builtin: type[Exception]
) -> None:
    with pytest.raises(KVCacheError):
        raise error("boom")
    with pytest.raises(builtin):
        raise error("boom")


def test_pool_exhausted_names_sub_pool_and_counts() -> None:
    err = PoolExhaustedError(sub_pool="sliding-w128", pages_requested=5, pages_free=2)
    assert isinstance(err, MemoryError)
    assert isinstance(err, KVCacheError)
    assert "'sliding-w128'" in str(err)
    assert "5 pages requested, 2 free" in str(err)
    assert (err.sub_pool, err.pages_requested, err.pages_free) == ("sliding-w128", 5, 2)


def test_unknown_request_message_is_not_quoted() -> None:
    assert str(UnknownRequestError("request 7 is not known")) == "request 7 is not known"


def test_every_exported_error_derives_from_the_base() -> None:
    errors = [
        obj
        for name in kv_protocol.__all__
        if isinstance(obj := getattr(kv_protocol, name), type) and issubclass(obj, Exception)
    ]
    assert len(errors) == 12
    assert all(issubclass(e, KVCacheError) for e in errors)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"dims": 7}, "even"), ({"dims": 0}, ">= 2"), ({"dims": 8, "base": 0.0}, "base")],
)
def test_rope_config_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ShapeMismatchError, match=message):
        RopeConfig(**kwargs)  # type: ignore[arg-type]
