"""The engine on a pool whose buffers grow with use, and what it keeps alive.

Slabs of a few pages make the buffers grow many times while the requests prefill and decode
(and shrink when asked): every request's greedy tokens must still be mlx-lm's. The old
buffers must be freed as soon as they are replaced, not when Python's cycle collector next
runs: a step leaves no reference cycle holding MLX arrays, and with the collector off the
memory MLX holds is the weights plus the pool's buffers as they are now.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import pytest

from kv_pool import HybridKVPool
from kv_serve import build_engine
from kv_testing import build_zoo_model, mlx_lm_greedy

#: Full + sliding, sliding-only variants, recurrent state, and a model whose caches nest.
ARCHS = ["gpt_oss", "gemma3_text", "qwen3_next", "falcon_h1"]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 120) for _ in range(rng.randrange(5, 60))] for _ in range(5)]


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("arch", ARCHS)
def test_growing_buffers_keep_mlx_lm_s_tokens_and_free_what_they_replace(
    arch: str, no_cycle_collector: None
) -> None:
    model: nn.Module = build_zoo_model(arch)
    texts = prompts(len(arch))
    want = [list(mlx_lm_greedy(model, p, 12)) for p in texts]
    mx.eval(model.parameters())
    with build_engine(
        model, page_size=4, max_context=128, max_running=3, prefill_chunk=16, kv_slab_bytes=1
    ) as engine:
        pool = engine.pool
        assert isinstance(pool, HybridKVPool)
        before = pool.memory_report().bytes_committed
        weights = mx.get_active_memory() - before
        ids = [engine.submit(p, 12) for p in texts]
        out = engine.run()
        assert [out[i] for i in ids] == want
        report = pool.memory_report()
        assert report.bytes_committed > before or not report.sub_pools  # it grew
        # Nothing but the weights and today's buffers (plus small per-request arrays: the
        # recurrent states, kept snapshots, token ids) is held with the collector off.
        held = mx.get_active_memory() - weights - report.bytes_committed
        assert held < 256 * 1024, held
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            cycles = [o for o in gc.garbage if isinstance(o, mx.array)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert cycles == []
        # Idle: the buffers go back to what the cached prefixes hold; a request still runs.
        for rid in ids:
            engine.release(rid)
        engine.shrink_pool(drop_cached=True)
        assert pool.memory_report().bytes_committed <= report.bytes_committed
        again = engine.submit(texts[0], 12)
        assert engine.run()[again] == want[0]
