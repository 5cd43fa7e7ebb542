"""Kernel selection, the KernelSet, and describing mlx-lm rope modules."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from kv_metal_kernels import (
    ATTENTION_ENV,
    CPU_KERNELS_ENV,
    FUSED_ROPE_ENV,
    CpuPagedAttention,
    KernelSet,
    ReferencePagedAttention,
    ReferenceRopeScatter,
    backend_available,
    native_backend,
    rope_config_from_module,
    select_kernels,
)
from kv_metal_kernels import _cpu_library as cpu_library
from kv_metal_kernels import _select as select_module
from kv_protocol import KernelSet as KernelSetProtocol
from kv_protocol import (
    KernelUnavailableError,
    RopeConfig,
    RopeScatterKernel,
    attention_module,
    find_layers,
)
from kv_testing import build_tiny_model

ROPE = RopeConfig(dims=64, base=10000.0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FUSED_ROPE_ENV, raising=False)
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    select_module._logged.clear()


def _cpu_kernel_builds() -> bool:
    return mx.default_device().type == mx.cpu and CpuPagedAttention().library.handle is not None


def test_default_is_unfused_rope_and_the_cpu_kernel_or_reference_attention() -> None:
    kernels = select_kernels(ROPE)
    assert kernels.rope is None
    expected = CpuPagedAttention if _cpu_kernel_builds() else ReferencePagedAttention
    assert type(kernels.attention) is expected
    assert isinstance(kernels, KernelSetProtocol)
    with pytest.raises(AttributeError):
        kernels.rope = ReferenceRopeScatter()  # type: ignore[misc]


def test_env_reference_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FUSED_ROPE_ENV, "reference")
    kernels = select_kernels(ROPE)
    assert isinstance(kernels.rope, RopeScatterKernel)
    assert kernels.rope.name == "reference"
    monkeypatch.setenv(FUSED_ROPE_ENV, "auto")
    kernels = select_kernels(ROPE)
    assert kernels.rope is not None
    assert kernels.rope.name == (native_backend() or "reference")
    # An explicit argument wins over the environment.
    assert select_kernels(ROPE, fused_rope="off").rope is None


def test_attention_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    cpu_or_reference = "cpu" if _cpu_kernel_builds() else "reference"
    assert select_kernels().attention.name == (native_backend() or cpu_or_reference)
    monkeypatch.setenv(ATTENTION_ENV, "reference")
    assert select_kernels().attention.name == "reference"
    monkeypatch.setenv(ATTENTION_ENV, "cpu")
    if CpuPagedAttention().library.handle is not None:
        assert select_kernels().attention.name == "cpu"


def test_cpu_kernels_off_leaves_the_reference_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_KERNELS_ENV, "off")
    monkeypatch.setattr(cpu_library, "_built", {})  # built again, under the setting
    assert select_kernels().attention.name == "reference"
    with pytest.raises(KernelUnavailableError, match="cpu paged attention kernel is not available"):
        select_kernels(attention="cpu")


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_missing_backend_is_a_clear_error(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend_available(backend):
        pytest.skip(f"{backend} exists on this machine")
    with pytest.raises(KernelUnavailableError, match=f"{backend!r} is not available: it needs"):
        select_kernels(ROPE, fused_rope=backend)
    with pytest.raises(KernelUnavailableError, match=f"{backend!r} is not available"):
        select_kernels(attention=backend)
    monkeypatch.setenv(FUSED_ROPE_ENV, backend)
    with pytest.raises(KernelUnavailableError, match="is not available"):
        select_kernels(ROPE)


def test_unknown_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FUSED_ROPE_ENV, "triton")
    with pytest.raises(KernelUnavailableError, match="environment variable KV_FUSED_ROPE"):
        select_kernels(ROPE)
    with pytest.raises(KernelUnavailableError, match="expected one of"):
        select_kernels(ROPE, fused_rope="fast")


def test_unsupported_rope_falls_back_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    yarn = initialize_rope(
        64,
        base=150000.0,
        traditional=False,
        scaling_config={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        max_position_embeddings=131072,
    )
    config, reason = rope_config_from_module(yarn)
    assert config is None and "YarnRoPE" in reason and "_freqs" in reason
    with caplog.at_level(logging.INFO, logger="kv_metal_kernels"):
        for _ in range(3):
            kernels = select_kernels(config, fused_rope="reference", rope_unsupported_reason=reason)
            assert kernels.rope is None
    lines = [r.getMessage() for r in caplog.records if r.name == "kv_metal_kernels"]
    assert len(lines) == 1
    assert "disabled" in lines[0] and "YarnRoPE" in lines[0]


def test_rope_config_from_plain_and_scaled_modules() -> None:
    config, reason = rope_config_from_module(nn.RoPE(32, traditional=True, base=500.0, scale=0.25))
    assert reason == ""
    assert config == RopeConfig(dims=32, traditional=True, base=500.0, scale=0.25)
    linear = initialize_rope(64, 10000.0, False, {"rope_type": "linear", "factor": 4.0})
    assert rope_config_from_module(linear)[0] == RopeConfig(dims=64, scale=0.25)
    llama3 = initialize_rope(
        64,
        500000.0,
        False,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    )
    assert rope_config_from_module(llama3)[0] is None
    dynamic = initialize_rope(64, 10000.0, False, {"rope_type": "dynamic", "factor": 2.0}, 4096)
    config, reason = rope_config_from_module(dynamic)
    assert config is None and "DynamicNTKScalingRoPE" in reason
    assert rope_config_from_module(None)[0] is None

    class Custom(nn.RoPE):
        def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
            return x

    assert rope_config_from_module(Custom(16))[0] is None


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "cohere2", "olmo3"])
def test_fused_reference_matches_the_models_own_rope(arch: str) -> None:
    """The config read off a real mlx-lm attention module rotates exactly as the module does."""
    model = build_tiny_model(arch)
    kernels = select_kernels(fused_rope="reference")  # rope=None -> unfused
    assert kernels.rope is None
    rng = np.random.default_rng(0)
    checked = 0
    for layer in find_layers(model):
        attn = attention_module(layer)
        if attn is None or getattr(attn, "rope", None) is None:
            continue
        config, reason = rope_config_from_module(attn.rope)
        assert config is not None, reason
        kernel = select_kernels(config, fused_rope="reference").rope
        assert kernel is not None
        t, h, d = 5, 2, 16
        q = mx.array(rng.standard_normal((t, 4, d)).astype(np.float32))
        k = mx.array(rng.standard_normal((t, h, d)).astype(np.float32))
        positions = mx.array([0, 3, 17, 100, 511], dtype=mx.int32)
        pool = mx.zeros((h, 8, d))
        q_rot, k_rot, _, _ = kernel(
            q, k, k, positions, mx.full((t,), -1, mx.int32), pool, pool, rope=config
        )
        for i in range(t):
            offset = int(positions[i])
            want_q = attn.rope(q[i][None, :, None, :], offset=offset)[0, :, 0]
            want_k = attn.rope(k[i][None, :, None, :], offset=offset)[0, :, 0]
            np.testing.assert_allclose(np.array(q_rot[i]), np.array(want_q), atol=1e-6)
            np.testing.assert_allclose(np.array(k_rot[i]), np.array(want_k), atol=1e-6)
        checked += 1
    assert checked > 0


def test_kernel_set_is_frozen_dataclass() -> None:
    kernels = KernelSet(attention=ReferencePagedAttention(), rope=ReferenceRopeScatter())
    assert isinstance(kernels, KernelSetProtocol)
    assert kernels.rope is not None and kernels.rope.supports(ROPE)


def test_static_protocol_conformance() -> None:
    # These assignments are checked by mypy --strict against the kv_protocol Protocols.
    kernel_set: KernelSetProtocol = select_kernels(ROPE, fused_rope="reference")
    rope_kernel: RopeScatterKernel = ReferenceRopeScatter()
    assert kernel_set.rope is not None and rope_kernel.name == kernel_set.rope.name
