"""The engine on quantized pages == mlx-lm on the same quantized K/V, token for token (fp32).

Two oracles. On a full-attention model, mlx-lm's own ``QuantizedKVCache`` (same
``mx.quantize`` groups and bits; its attention runs ``mx.quantized_matmul``). On hybrid models,
whose sliding layers mlx-lm cannot quantize (``RotatingKVCache Quantization NYI``), mlx-lm's
own caches with every written K/V replaced by ``dequantize(quantize(kv))`` before it is stored:
exactly the values the pool's pages hold, so the engine must agree with it whatever the
window, page size, arrival order, decode path or prefix hit.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from kv_batching import DecodeEngine
from kv_caches import PoolBackedKVCache
from kv_pool import HybridKVPool
from kv_protocol import KVQuantization, QuantizedKV, layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy, stored_kv_caches

VOCAB = 256
MAX_TOKENS = 24
WINDOWS = {"gpt_oss": 8, "gemma3_text": 16, "cohere2": 12, "olmo3": 16}
LENGTHS = (1, 9, 30, 75)


@cache
def tiny(arch: str) -> Any:
    extra: dict[str, Any] = {}
    if arch == "llama":
        extra["layer_types"] = ["full_attention"] * 4
    if arch == "cohere2":  # its heads must tile the hidden size
        extra["hidden_size"] = 4 * 64
    return build_tiny_model(
        arch, window=WINDOWS.get(arch, 8), num_layers=4, vocab_size=VOCAB, head_dim=64, **extra
    )


def prompts(seed: int, lengths: Sequence[int] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def engine_tokens(engine: DecodeEngine, batch: list[list[int]]) -> list[list[int]]:
    """Staggered arrivals: two, a step, the rest."""
    ids = [engine.submit(p, MAX_TOKENS) for p in batch[:2]]
    engine.step()
    ids += [engine.submit(p, MAX_TOKENS) for p in batch[2:]]
    out = engine.run()
    return [out[i] for i in ids]


@pytest.mark.parametrize(("bits", "group"), [(8, 64), (4, 32), (4, 64)])
def test_full_attention_model_matches_mlx_lm_quantized_kv_cache(bits: int, group: int) -> None:
    model = tiny("llama")
    batch = prompts(1)
    engine = build_engine(
        model,
        max_running=8,
        max_context=128,
        page_size=16,
        prefill_chunk=32,
        kv_bits=bits,
        kv_group_size=group,
    )
    assert isinstance(engine.pool.get_key_buffer(0), QuantizedKV)
    got = engine_tokens(engine, batch)
    want = [
        mlx_lm_greedy(
            model,
            p,
            MAX_TOKENS,
            caches=[QuantizedKVCache(group_size=group, bits=bits) for _ in range(4)],
        )
        for p in batch
    ]
    assert got == want
    if bits == 4:
        plain = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in batch]
        assert plain != got, "4-bit pages should change some greedy token of this model"
    engine.close()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", sorted(WINDOWS))
def test_hybrid_models_with_quantized_sliding_pages_match_mlx_lm(arch: str, bits: int) -> None:
    model = tiny(arch)
    quant = KVQuantization(bits=bits, group_size=32)
    batch = prompts(2)
    engine = build_engine(
        model,
        max_running=8,
        max_context=128,
        page_size=4,
        prefill_chunk=16,
        kv_bits=bits,
        kv_group_size=32,
    )
    got = engine_tokens(engine, batch)
    oracle = {"full": quant, "sliding": quant}
    assert got == [
        mlx_lm_greedy(model, p, MAX_TOKENS, caches=stored_kv_caches(model, oracle)) for p in batch
    ]
    if bits == 4:
        plain = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in batch]
        assert plain != got, "4-bit pages should change some greedy token of this model"
    engine.close()


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("gpt_oss", {"decode_path": "universal"}),
        ("gemma3_text", {"fused_rope": "reference"}),
        ("olmo3", {"kv_quantize": "full"}),
        ("cohere2", {"kv_quantize": "sliding", "page_size": 16}),
    ],
)
def test_decode_paths_fused_rope_and_per_kind_quantization(
    arch: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kv_batching")
    fused = options.get("fused_rope") is not None
    model = tiny(arch)
    quant = KVQuantization(bits=4, group_size=64)
    kinds = options.pop("kv_quantize", "all")
    engine = build_engine(
        model,
        max_running=8,
        max_context=128,
        page_size=options.pop("page_size", 8),
        prefill_chunk=16,
        kv_bits=4,
        kv_quantize=kinds,
        **options,
    )
    layout = engine.pool.layout
    for layer in layout.attention_layer_ids:
        kind = layout.spec(layer).kind.value
        quantized = kinds in ("all", kind)
        assert isinstance(engine.pool.get_key_buffer(layer), QuantizedKV) == quantized
    said = [
        r.getMessage() for r in caplog.records if "fused RoPE + scatter kernel" in r.getMessage()
    ]
    if fused:  # the kernel writes plain pages: it is not used on quantized layers, and says so
        assert engine._core.runner.kernels.rope is not None
        assert len(said) == 1 and "their pages are quantized" in said[0]
    batch = prompts(3)
    got = engine_tokens(engine, batch)
    oracle = {k: quant if kinds in ("all", k) else None for k in ("full", "sliding")}
    assert got == [
        mlx_lm_greedy(model, p, MAX_TOKENS, caches=stored_kv_caches(model, oracle)) for p in batch
    ]
    engine.close()


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_prefix_caching_reuses_quantized_pages(arch: str) -> None:
    model = tiny(arch)
    quant = KVQuantization(bits=8, group_size=64)
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    batch = [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (3, 11, 20)]
    engine = build_engine(
        model, max_running=4, max_context=128, page_size=4, prefill_chunk=16, kv_bits=8
    )
    first = engine.submit(batch[0], MAX_TOKENS)
    out = engine.run()
    ids = [engine.submit(p, MAX_TOKENS) for p in batch[1:]]
    out.update(engine.run())
    assert engine.stats.prefix_hit_tokens >= 2 * 36, "later prompts should reuse cached pages"
    oracle = {"full": quant, "sliding": quant}
    got = [out[i] for i in (first, *ids)]
    assert got == [
        mlx_lm_greedy(model, p, MAX_TOKENS, caches=stored_kv_caches(model, oracle)) for p in batch
    ]
    engine.close()


def test_pool_backed_cache_on_quantized_pages_returns_the_dequantized_k_v() -> None:
    """Prefill through the per-request cache: what mlx-lm's attention gets back is the pages'."""
    model = tiny("gemma3_text")
    layout = layout_from_model(model)
    quant = KVQuantization(bits=4, group_size=32)
    pool = HybridKVPool(layout, num_pages=64, page_size=4, kv_quantization=quant)
    pool.add_request(0)
    cache = PoolBackedKVCache(pool, 0, layout.full_layer_ids[0])
    keys = mx.random.normal((1, 2, 7, 64))
    values = mx.random.normal((1, 2, 7, 64))
    out_k, out_v = cache.update_and_fetch(keys, values)
    assert out_k.shape == keys.shape and out_k.dtype == keys.dtype
    assert mx.array_equal(out_k, quant.quantize(keys).dequantize())
    assert mx.array_equal(out_v, quant.quantize(values).dequantize())
    assert not mx.array_equal(out_k, keys)
    assert len(cache.state) == 6  # data, scales and biases of K and of V
