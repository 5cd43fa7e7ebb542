"""An unknown kernel backend name is a ValueError as well as a KernelUnavailableError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from kv_metal_kernels import (
    ATTENTION_ENV,
    FUSED_ROPE_ENV,
    NativePagedAttention,
    NativeRopeScatter,
    paged_decode_attention,
    select_kernels,
)
from kv_metal_kernels._native import require_backend
from kv_protocol import KernelUnavailableError, KVCacheError, UnknownBackendError


def _paged(backend: Any) -> object:
    return paged_decode_attention(
        mx.zeros((1, 2, 1, 8)),
        mx.zeros((2, 8, 8)),
        mx.zeros((2, 8, 8)),
        mx.ones((1, 2), dtype=mx.int32),
        mx.array([3], dtype=mx.int32),
        page_size=4,
        scale=1.0,
        backend=backend,
    )


CALLS: list[tuple[str, Callable[[], object]]] = [
    ("select_kernels(fused_rope='bogus')", lambda: select_kernels(fused_rope="bogus")),
    ("select_kernels(attention='bogus')", lambda: select_kernels(attention="bogus")),
    ("select_kernels(fused_rope=1)", lambda: select_kernels(fused_rope=1)),  # type: ignore[arg-type]
    ("select_kernels(attention=['auto'])", lambda: select_kernels(attention=["auto"])),  # type: ignore[arg-type]
    ("paged_decode_attention(backend='bogus')", lambda: _paged("bogus")),
    ("paged_decode_attention(backend=3)", lambda: _paged(3)),
    ("NativePagedAttention('bogus')", lambda: NativePagedAttention("bogus")),
    ("NativeRopeScatter('reference')", lambda: NativeRopeScatter("reference")),
    ("require_backend('vulkan')", lambda: require_backend("vulkan")),
]


@pytest.mark.parametrize(("what", "call"), CALLS, ids=[w for w, _ in CALLS])
def test_unknown_backend_names_are_value_errors(what: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    err = info.value
    assert isinstance(err, UnknownBackendError), what
    assert isinstance(err, KernelUnavailableError)
    assert isinstance(err, RuntimeError)
    assert isinstance(err, KVCacheError)
    assert "unknown" in str(err) and "backend" in str(err)


@pytest.mark.parametrize(
    ("env", "kwargs"),
    [(FUSED_ROPE_ENV, {}), (ATTENTION_ENV, {}), (FUSED_ROPE_ENV, {"attention": "reference"})],
)
def test_unknown_backend_names_from_the_environment_are_value_errors(
    monkeypatch: pytest.MonkeyPatch, env: str, kwargs: dict[str, Any]
) -> None:
    monkeypatch.setenv(env, "bogus")
    with pytest.raises(ValueError, match=f"'bogus' from environment variable {env}") as info:
        select_kernels(**kwargs)
    assert isinstance(info.value, UnknownBackendError)


def test_the_argument_is_named_in_the_message() -> None:
    with pytest.raises(UnknownBackendError, match="from argument fused_rope; expected one of"):
        select_kernels(fused_rope="bogus")
    with pytest.raises(UnknownBackendError, match="from argument attention"):
        select_kernels(attention="bogus")


@pytest.mark.parametrize("name", [" Reference ", "REFERENCE", "auto", "off"])
def test_known_names_still_work_in_any_case(name: str) -> None:
    kernels = select_kernels(fused_rope=name, attention=name if name != "off" else None)
    assert kernels.attention.name in ("reference", "cpu", "metal", "cuda")
