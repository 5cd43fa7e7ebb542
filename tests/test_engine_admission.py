"""DecodeEngine admission control on the real HybridKVPool: queue, preempt, never fail."""

from __future__ import annotations

import random

import pytest

from kv_pool import HybridKVPool
from kv_pool._inspect import request_ids
from kv_protocol import layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_tight_real_pool_preempts_and_still_matches_mlx_lm(arch: str) -> None:
    model = build_tiny_model(arch, window=8, num_layers=4, vocab_size=128)
    rng = random.Random(5)
    batch = [[rng.randrange(128) for _ in range(n)] for n in (3, 30, 12, 45, 20, 8)]
    expected = [mlx_lm_greedy(model, p, 24) for p in batch]
    layout = layout_from_model(model)
    # 6 usable full pages of 16 tokens: any one request (<= 69 tokens) fits, all six do not.
    pool = HybridKVPool(layout, num_pages={"full": 7, "sliding-w8": 64}, page_size=16)
    engine = build_engine(model, pool=pool, prefill_chunk=16)
    ids = [engine.submit(p, 24) for p in batch]
    out = engine.run()
    assert [out[i] for i in ids] == expected
    assert engine.stats.preemptions > 0 and max(engine.stats.queue_length) > 0
    assert all(engine.output(i).finish_reason == "length" for i in ids)
    assert max(s["full"] for s in engine.stats.pages_used) <= 6
    report = pool.memory_report()
    assert all(s.pages_used == 0 for s in report.sub_pools)
    assert request_ids(pool) == ()
