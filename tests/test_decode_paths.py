"""The two decode paths: the universal pool cache on unmodified attention, the patched fast
path, per-layer choice at build time, and models that neither path serves refused then.

The oracle is mlx-lm generating each prompt alone with its own caches.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kv_batching import DecodeEngine, is_patched
from kv_protocol import UnsupportedModelError, find_layers
from kv_serve import build_engine
from kv_testing import ARCHITECTURES, build_tiny_model, mlx_lm_greedy

VOCAB = 96
WINDOW = 8
#: Staggered prompts: shorter than, equal to and well past the window.
PROMPTS = [[(5 * i + 3 * j + 2) % VOCAB for j in range(n)] for i, n in enumerate((1, 7, 8, 19, 33))]
MAX_TOKENS = 14


def _serve(engine: DecodeEngine) -> list[list[int]]:
    ids = [engine.submit(p, MAX_TOKENS) for p in PROMPTS]
    out = engine.run()
    assert all(n == 0 for n in (engine.memory_report().pages_used or {}).values())
    return [out[i] for i in ids]


@pytest.mark.parametrize("page_size", [16, 6])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_universal_path_equals_mlx_lm(arch: str, page_size: int) -> None:
    model = build_tiny_model(arch, window=WINDOW, num_layers=4, vocab_size=VOCAB)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    engine = build_engine(
        model,
        max_running=4,
        max_context=64,
        page_size=page_size,
        prefill_chunk=16,
        decode_path="universal",
    )
    assert set(engine.decode_plan.paths.values()) == {"universal"}
    assert not is_patched(model)  # the universal path leaves every module as it was
    assert _serve(engine) == want


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_auto_takes_the_fast_path_where_the_probe_accepts(arch: str) -> None:
    model = build_tiny_model(arch, window=WINDOW, num_layers=4, vocab_size=VOCAB)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    with build_engine(model, max_running=4, max_context=64, page_size=4) as engine:
        assert set(engine.decode_plan.paths.values()) == {"fast"}
        assert is_patched(model)
        assert _serve(engine) == want
    assert not is_patched(model)  # close() put the original modules back


class _Delegating(nn.Module):
    """Attribute reads it does not define fall through to the wrapped attention, so the
    layout still sees its heads and projections."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(dict.get(self, "inner"), name)


class _ScaledAttention(_Delegating):
    """An attention the fast path cannot describe: it takes an extra positional argument
    and scales its output per position (so the wrapper's probe refuses it), but it follows
    mlx-lm's cache protocol."""

    def __call__(
        self, x: mx.array, mask: Any = None, cache: Any = None, extra: float = 1.0
    ) -> mx.array:
        out: mx.array = self.inner(x, mask=mask, cache=cache)
        return out * 0.5 * extra


def _wrap_layers(model: nn.Module, layers: list[int], cls: type[_Delegating]) -> None:
    for layer_id in layers:
        layer: Any = find_layers(model)[layer_id]
        layer.self_attn = cls(layer.self_attn)


def test_an_attention_the_probe_refuses_takes_the_universal_path() -> None:
    model = build_tiny_model("llama", window=WINDOW, num_layers=4, vocab_size=VOCAB)
    _wrap_layers(model, [1, 2], _ScaledAttention)
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    engine = build_engine(model, max_running=4, max_context=64, page_size=4)
    assert engine.decode_plan.paths == {0: "fast", 1: "universal", 2: "universal", 3: "fast"}
    assert "1" in str(sorted(engine.decode_plan.reasons))
    assert _serve(engine) == want


class _CachelessAttention(_Delegating):
    """An attention that never touches its cache: neither path can serve it."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        out: mx.array = self.inner(x, mask=mask, cache=None)
        return out


@pytest.mark.parametrize("decode_path", ["auto", "universal"])
def test_a_model_neither_path_serves_is_refused_at_build_time(decode_path: str) -> None:
    model = build_tiny_model("llama", window=WINDOW, num_layers=4, vocab_size=VOCAB)
    _wrap_layers(model, [2], _CachelessAttention)
    with pytest.raises(UnsupportedModelError, match="cannot be served by batched decode"):
        build_engine(model, max_running=2, max_context=64, page_size=4, decode_path=decode_path)
    assert not is_patched(model)
    assert not any(type(m).__name__ == "BatchedAttention" for _, m in model.named_modules())


def test_fast_only_refuses_a_module_the_probe_rejects() -> None:
    model = build_tiny_model("llama", window=WINDOW, num_layers=4, vocab_size=VOCAB)
    _wrap_layers(model, [1], _ScaledAttention)
    with pytest.raises(UnsupportedModelError, match="layer 1"):
        build_engine(model, max_running=2, max_context=64, page_size=4, decode_path="fast")
    assert not is_patched(model)


def test_an_unknown_decode_path_is_refused() -> None:
    model = build_tiny_model("llama", window=WINDOW, num_layers=2, vocab_size=VOCAB)
    with pytest.raises(UnsupportedModelError, match="decode_path must be one of"):
        build_engine(model, max_running=2, max_context=64, decode_path="fastest")
