"""A tiny gpt_oss prefilled (and decoded) through PoolBackedKVCache on HybridKVPool.

The oracle is the same mlx-lm model run on its own caches (``make_prompt_cache``: a
RotatingKVCache on sliding layers, a KVCache on full ones): logits must agree to 1e-5 in fp32,
for several page sizes and prefill chunkings, while the pool's sliding sub-pool holds at most
``ceil(window / page_size) + 1`` pages between decode steps.
"""

from __future__ import annotations

import math
import random
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kv_caches import PoolBackedKVCache
from kv_pool import HybridKVPool
from kv_pool._inspect import held_pages
from kv_protocol import KVPool, layout_from_model
from kv_testing import build_tiny_model

WINDOW = 8
PROMPT = 29
DECODE = 6


@cache
def tiny_gpt_oss() -> Any:
    return build_tiny_model("gpt_oss", window=WINDOW, num_layers=4)


def tokens() -> list[int]:
    rng = random.Random(4)
    return [rng.randrange(256) for _ in range(PROMPT + DECODE)]


def run(model: Any, caches: list[Any], chunks: list[int]) -> list[np.ndarray]:
    """Feed the prompt in ``chunks`` then DECODE tokens one by one; logits of every step."""
    ids = tokens()
    out = []
    pos = 0
    for n in [*chunks, *([1] * DECODE)]:
        logits = model(mx.array(ids[pos : pos + n])[None], cache=caches)
        out.append(np.array(logits[0].astype(mx.float32)))
        pos += n
    return out


@cache
def reference(chunks: tuple[int, ...]) -> list[np.ndarray]:
    model = tiny_gpt_oss()
    return run(model, make_prompt_cache(model), list(chunks))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunks", [(PROMPT,), (5, 11, 13), (8, 8, 8, 5)])
def test_pool_backed_prefill_matches_mlx_lm(page_size: int, chunks: tuple[int, ...]) -> None:
    model = tiny_gpt_oss()
    layout = layout_from_model(model)
    pool: KVPool = HybridKVPool(layout, num_pages=64, page_size=page_size)
    assert isinstance(pool, KVPool)
    pool.add_request(3)
    caches = [
        PoolBackedKVCache(pool, 3, layer_id) if layer_id in layout.attention_layer_ids else None
        for layer_id in range(layout.num_layers)
    ]
    got = run(model, caches, list(chunks))
    want = reference(chunks)
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape
        assert np.max(np.abs(a - b)) <= 1e-5, f"step {step}"

    assert pool.seq_len(3) == PROMPT + DECODE
    concrete = pool
    assert isinstance(concrete, HybridKVPool)
    held = len(held_pages(concrete, 3, f"sliding-w{WINDOW}"))
    assert held <= math.ceil(WINDOW / page_size) + 1
    assert len(held_pages(concrete, 3, "full")) == math.ceil((PROMPT + DECODE) / page_size)
    if page_size < WINDOW:  # with larger pages, rounding outweighs the window at 35 tokens
        report = concrete.memory_report()
        assert report.bytes_used < report.full_equivalent_bytes
