"""The vocabulary head in the operand order MLX's CPU backend runs fastest, with mlx-lm's tokens.

A batched decode projects a few rows onto the vocabulary; ``(W @ h.T).T`` is then about twice
as fast on the CPU as mlx-lm's ``h @ W.T`` for a large head (``tools/profile_decode.py``). The
engine takes that order only for a plain head of at least ``HEAD_REORDER_MIN_WEIGHTS`` weights
whose probe matches the model's own logits; greedy tokens must stay mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kv_batching import _model_forward
from kv_batching._model_forward import (
    HEAD_REORDER_MIN_WEIGHTS,
    decode_forward,
    last_position_forward,
)
from kv_metal_kernels import CpuQuantizedHead
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

needs_kernel = pytest.mark.skipif(
    CpuQuantizedHead().library.handle is None,
    reason=f"no native CPU kernel: {CpuQuantizedHead().library.reason}",
)

VOCAB = 65536
HIDDEN = 256  # VOCAB x HIDDEN = HEAD_REORDER_MIN_WEIGHTS: the smallest head that is reordered


def big_head_model() -> nn.Module:
    return build_tiny_model(
        "gemma3_text", window=8, num_layers=6, vocab_size=VOCAB, hidden_size=HIDDEN
    )


def test_a_large_head_decodes_in_the_fast_order_with_mlx_lm_tokens() -> None:
    model = big_head_model()
    assert VOCAB * HIDDEN == HEAD_REORDER_MIN_WEIGHTS
    prompts = [
        [(97 * i + 31 * j + 5) % VOCAB for j in range(n)] for i, n in enumerate((3, 9, 14, 20, 6))
    ]
    want = [mlx_lm_greedy(model, p, 10) for p in prompts]
    with build_engine(model, max_running=8, max_context=64, page_size=4) as engine:
        assert engine._core.runner.decode_forward is not None
        ids = [engine.submit(p, 10) for p in prompts]
        out = engine.run()
    assert [out[i] for i in ids] == want


def test_the_reordered_head_matches_the_model_row_for_row() -> None:
    model = big_head_model()
    forward = decode_forward(model, VOCAB)
    assert forward is not None
    tokens = mx.array([[5], [77], [60001], [1234]], dtype=mx.int32)
    mine, theirs = forward(tokens), model(tokens)
    assert mine.shape == theirs.shape == (4, 1, VOCAB)
    assert bool(mx.allclose(mine, theirs, rtol=1e-4, atol=1e-4))
    assert bool(mx.array_equal(mine.argmax(-1), theirs.argmax(-1)))


def test_small_heads_and_quantized_heads_without_a_kernel_keep_the_model_call() -> None:
    small = build_tiny_model("gemma3_text", window=8, num_layers=6, vocab_size=256)
    assert decode_forward(small, 256) is None
    quantized = big_head_model()
    nn.quantize(quantized, group_size=64, bits=8)
    assert decode_forward(quantized, VOCAB) is None
    assert last_position_forward(quantized, VOCAB) is not None  # the model's own head
    small_quantized = build_tiny_model("gemma3_text", window=8, num_layers=6, vocab_size=256)
    nn.quantize(small_quantized, group_size=64, bits=8)
    assert decode_forward(small_quantized, 256, CpuQuantizedHead()) is None
    odd = big_head_model()
    nn.quantize(odd, group_size=64, bits=6)  # bits the kernel does not read
    assert decode_forward(odd, VOCAB, CpuQuantizedHead()) is None


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_a_large_quantized_head_decodes_natively_with_mlx_lms_tokens(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's own quantized model is the oracle: the engine's tokens are its tokens."""
    calls: list[int] = []
    prepare = CpuQuantizedHead.prepare

    def counted(self: CpuQuantizedHead, *args: Any, **kwargs: Any) -> Any:
        project = prepare(self, *args, **kwargs)
        assert project is not None

        def run(rows: mx.array) -> mx.array:
            calls.append(int(rows.shape[0]))
            return project(rows)

        return run

    monkeypatch.setattr(CpuQuantizedHead, "prepare", counted)
    model = big_head_model()
    nn.quantize(model, group_size=64, bits=bits)
    prompts = [
        [(97 * i + 31 * j + 5) % VOCAB for j in range(n)] for i, n in enumerate((3, 9, 14, 20, 6))
    ]
    want = [mlx_lm_greedy(model, p, 8) for p in prompts]
    with build_engine(model, max_running=8, max_context=64, page_size=4) as engine:
        assert engine._core.runner.decode_forward is not None
        calls.clear()
        ids = [engine.submit(p, 8) for p in prompts]
        out = engine.run()
    assert [out[i] for i in ids] == want
    assert 1 in calls and max(calls) > 1  # prompts' last positions and batched decode rows
    # A prompt in 5 chunks projects its last position once: the chunks before it leave
    # their logits lazy (the native head would evaluate them).
    with build_engine(model, max_running=2, max_context=64, page_size=4, prefill_chunk=4) as e:
        calls.clear()
        e.submit(prompts[3], 1)
        e.run()
    assert calls == [1]
    monkeypatch.setattr(CpuQuantizedHead, "prepare", prepare)
    forward = decode_forward(model, VOCAB, CpuQuantizedHead())
    assert forward is not None
    tokens = mx.array([[5], [77], [60001], [1234]], dtype=mx.int32)
    mine, theirs = forward(tokens), model(tokens)
    assert bool(mx.allclose(mine, theirs, rtol=1e-4, atol=1e-4))
    assert bool(mx.array_equal(mine.argmax(-1), theirs.argmax(-1)))


def test_prefill_projects_its_last_position_in_the_same_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt's last position goes through the reordered head too, with the model's logits."""
    calls: list[tuple[int, ...]] = []
    original = _model_forward.project_rows

    def counted(weight: mx.array, rows: mx.array) -> Any:
        calls.append(tuple(rows.shape))
        return original(weight, rows)

    monkeypatch.setattr(_model_forward, "project_rows", counted)
    model = big_head_model()
    forward = last_position_forward(model, VOCAB)
    assert forward is not None
    calls.clear()
    tokens = mx.array([[(13 * j + 7) % VOCAB for j in range(11)]], dtype=mx.int32)
    mine, theirs = forward(tokens, None), model(tokens)[:, -1:, :]  # type: ignore[arg-type]
    assert calls == [(1, HIDDEN)]
    assert mine.shape == theirs.shape == (1, 1, VOCAB)
    assert bool(mx.allclose(mine, theirs, rtol=1e-4, atol=1e-4))
    assert bool(mx.array_equal(mine.argmax(-1), theirs.argmax(-1)))
    small = build_tiny_model("gemma3_text", window=8, num_layers=6, vocab_size=256)
    small_forward = last_position_forward(small, 256)
    assert small_forward is not None
    calls.clear()
    small_forward(mx.array([[1, 2, 3]], dtype=mx.int32), None)  # type: ignore[arg-type]
    assert calls == []
