"""Models run on kv_caches give mlx-lm's own logits and greedy tokens (the oracle is mlx-lm)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kv_caches import (
    ContiguousAttentionKVCache,
    QuantizedAttentionKVCache,
    WindowedAttentionKVCache,
)
from kv_protocol import LayerKind, layout_from_model
from kv_testing import build_tiny_model, greedy_continue

DECODE_STEPS = 40
ATOL = 1e-5


def our_caches(model: Any) -> list[Any]:
    layout = layout_from_model(model)
    caches: list[Any] = []
    for spec in layout.specs:
        assert spec.kind is not LayerKind.STATE
        if spec.kind is LayerKind.SLIDING:
            assert spec.window is not None
            caches.append(WindowedAttentionKVCache(spec.window))
        else:
            caches.append(ContiguousAttentionKVCache())
    return caches


def run(
    model: Any, caches: list[Any], prompt: mx.array, chunks: list[int], steps: int
) -> tuple[list[mx.array], list[int]]:
    """Chunked prefill then greedy decode; returns every logits row and the tokens."""
    assert sum(chunks) == prompt.shape[0]
    logits: list[mx.array] = []
    pos = 0
    out = None
    for size in chunks:
        out = model(prompt[None, pos : pos + size], cache=caches)
        mx.eval(out, [c.state for c in caches])
        logits.append(out[0])
        pos += size
    assert out is not None
    tokens = greedy_continue(model, caches, out, steps + 1, record=logits)
    return logits, tokens


def assert_same(
    reference: tuple[list[mx.array], list[int]], ours: tuple[list[mx.array], list[int]]
) -> None:
    ref_logits, ref_tokens = reference
    our_logits, our_tokens = ours
    assert our_tokens == ref_tokens
    assert len(ref_logits) == len(our_logits)
    for step, (a, b) in enumerate(zip(ref_logits, our_logits, strict=True)):
        assert a.shape == b.shape
        diff = float(mx.max(mx.abs(a - b)))
        assert diff <= ATOL, f"step {step}: max |logit diff| {diff}"


CASES = [
    # (arch, window, chunks): chunks longer than the window, single tokens, window-edge sizes.
    ("gpt_oss", 8, [5, 1, 12, 3, 16]),
    ("gpt_oss", 4, [9, 2, 1, 4]),
    ("gemma3_text", 8, [20, 1, 1, 7, 8]),
    ("gemma3_text", 16, [3, 17, 16, 2]),
    ("cohere2", 8, [8, 9, 1, 14]),
    ("cohere2", 5, [1, 1, 1, 6, 11]),
    ("olmo3", 8, [7, 1, 8, 21]),
    ("olmo3", 12, [30, 5]),
]


@pytest.mark.parametrize(("arch", "window", "chunks"), CASES)
def test_hybrid_model_matches_mlx_lm(arch: str, window: int, chunks: list[int]) -> None:
    model = build_tiny_model(arch, window=window)
    prompt = mx.random.randint(0, 256, (sum(chunks),), key=mx.random.key(len(chunks) + window))
    reference = run(model, make_prompt_cache(model), prompt, chunks, DECODE_STEPS)
    ours = run(model, our_caches(model), prompt, chunks, DECODE_STEPS)
    assert_same(reference, ours)


@pytest.mark.parametrize(("bits", "group_size", "head_dim"), [(4, 32, 32), (8, 64, 64)])
def test_quantized_cache_matches_mlx_lm_quantized(
    bits: int, group_size: int, head_dim: int
) -> None:
    model = build_tiny_model("llama", layer_types=None, sliding_window=None, head_dim=head_dim)
    layout = layout_from_model(model)
    assert not layout.has_sliding_layers
    chunks = [6, 1, 13]
    prompt = mx.random.randint(0, 256, (sum(chunks),), key=mx.random.key(bits))
    n = layout.num_layers
    reference = run(
        model,
        [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(n)],
        prompt,
        chunks,
        DECODE_STEPS,
    )
    ours = run(
        model,
        [QuantizedAttentionKVCache(bits=bits, group_size=group_size) for _ in range(n)],
        prompt,
        chunks,
        DECODE_STEPS,
    )
    assert_same(reference, ours)


def test_full_model_contiguous_matches_mlx_lm_kvcache() -> None:
    model = build_tiny_model("llama", layer_types=None, sliding_window=None)
    chunks = [4, 11, 1]
    prompt = mx.random.randint(0, 256, (sum(chunks),), key=mx.random.key(3))
    n = len(model.layers)
    reference = run(model, [KVCache() for _ in range(n)], prompt, chunks, DECODE_STEPS)
    ours = run(
        model,
        [ContiguousAttentionKVCache(2, 16, max_seq_len=8) for _ in range(n)],
        prompt,
        chunks,
        DECODE_STEPS,
    )
    assert_same(reference, ours)


def test_mlx_lm_generate_step_runs_on_our_caches() -> None:
    from mlx_lm.generate import generate_step

    model = build_tiny_model("gemma3_text", window=8)
    prompt = mx.random.randint(0, 256, (40,), key=mx.random.key(1))

    def tokens(caches: list[Any]) -> list[int]:
        steps = generate_step(
            prompt, model, max_tokens=30, prompt_cache=caches, prefill_step_size=16
        )
        return [int(token) for token, _ in steps]

    assert tokens(our_caches(model)) == tokens(make_prompt_cache(model))
