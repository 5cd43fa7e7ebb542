"""DecodeEngine on the real pool, caches and kernels == mlx-lm generating each prompt alone.

fp32 tiny random-weight models of four hybrid architectures; windows small enough that the
prompts (lengths 1..200) and the 48 generated tokens cross them; staggered arrivals;
page sizes 1, 16 and 64; RoPE unfused and fused (reference kernel).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest

from kv_batching import DecodeEngine
from kv_pool import HybridKVPool
from kv_pool._inspect import request_ids
from kv_protocol import layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

WINDOWS = {"gpt_oss": 8, "gemma3_text": 16, "cohere2": 12, "olmo3": 16}
PROMPT_LENGTHS = (1, 7, 16, 33, 64, 100, 150, 200)
MAX_TOKENS = 48
VOCAB = 256


@cache
def tiny(arch: str) -> Any:
    return build_tiny_model(arch, window=WINDOWS[arch], num_layers=4, vocab_size=VOCAB)


def prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@cache
def reference(arch: str, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    model = tiny(arch)
    return [mlx_lm_greedy(model, p, MAX_TOKENS) for p in prompts(seed, lengths)]


def make_engine(
    model: Any, *, page_size: int, fused: bool, num_pages: int, chunk: int = 64
) -> tuple[DecodeEngine, HybridKVPool]:
    pool = HybridKVPool(layout_from_model(model), num_pages=num_pages, page_size=page_size)
    engine = build_engine(
        model,
        pool=pool,
        fused_rope="reference" if fused else "off",
        max_running=16,
        prefill_chunk=chunk,
    )
    return engine, pool


def used_pages(pool: HybridKVPool) -> dict[str, int]:
    return {s.name: s.pages_used for s in pool.memory_report().sub_pools}


def run_staggered(engine: DecodeEngine, batch: list[list[int]]) -> list[list[int]]:
    ids = [engine.submit(p, MAX_TOKENS) for p in batch[:3]]
    engine.step()
    engine.step()
    ids += [engine.submit(p, MAX_TOKENS) for p in batch[3:6]]
    for _ in range(5):
        engine.step()
    ids += [engine.submit(p, MAX_TOKENS) for p in batch[6:]]
    out = engine.run()
    return [out[i] for i in ids]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("arch", sorted(WINDOWS))
def test_engine_matches_mlx_lm_alone(arch: str, page_size: int, fused: bool) -> None:
    model = tiny(arch)
    expected = reference(arch, 0, PROMPT_LENGTHS)
    num_pages = 8 * (-(-(max(PROMPT_LENGTHS) + MAX_TOKENS) // page_size) + 1) + 1
    engine, pool = make_engine(model, page_size=page_size, fused=fused, num_pages=num_pages)
    if fused:
        assert engine._core.runner.kernels.rope is not None
    got = run_staggered(engine, prompts(0, PROMPT_LENGTHS))
    for n, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine == theirs, f"{arch} prompt #{n} (length {PROMPT_LENGTHS[n]})"
    assert all(v == 0 for v in used_pages(pool).values())
    assert request_ids(pool) == ()
    assert max(engine.stats.decode_batch_sizes) == len(PROMPT_LENGTHS)


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text"])
def test_request_alone_equals_request_among_fifteen_others(arch: str) -> None:
    model = tiny(arch)
    rng = random.Random(7)
    target = [rng.randrange(VOCAB) for _ in range(41)]
    others = prompts(11, [rng.randrange(1, 120) for _ in range(15)])

    alone, _ = make_engine(model, page_size=16, fused=False, num_pages=256)
    rid = alone.submit(target, 32)
    solo = alone.run()[rid]

    crowd, pool = make_engine(model, page_size=16, fused=False, num_pages=256, chunk=48)
    ids = [crowd.submit(p, 20 + i) for i, p in enumerate(others[:8])]
    crowd.step()
    target_id = crowd.submit(target, 32)
    ids += [crowd.submit(p, 20 + i) for i, p in enumerate(others[8:])]
    out = crowd.run()
    assert out[target_id] == solo
    assert solo == mlx_lm_greedy(model, target, 32)
    assert max(crowd.stats.decode_batch_sizes) == 16
    assert all(v == 0 for v in used_pages(pool).values())
    assert len(ids) == 15
