"""One reservation per step, owned by the scheduler; a prefix hit hashes each page once.

Counted on a real pool and a tiny gpt-oss-like model: the pool calls a decode step makes
outside the model's layers, the reservations of prefill chunks (and that the prefill caches
never reserve or ask for the chunk's slots), and the block hashes a request's text costs over
its whole life, preemption and re-admission included. Tokens are checked against mlx-lm
generating each prompt alone.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import kv_pool._prefix as prefix_module
from kv_batching import DecodeEngine
from kv_pool import HybridKVPool
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

WINDOW = 8
MAX_TOKENS = 6
#: Modules whose pool calls happen inside the model's layers (attention writes and reads).
IN_LAYER = ("_batched_attention.py", "_layer_cache.py", "_pool_backed.py")


def prompt(n: int, seed: int) -> list[int]:
    return [(7 * i + 3 * seed + 1) % 60 for i in range(n)]


@contextmanager
def pool_calls(pool: HybridKVPool) -> Iterator[Counter[str]]:
    """Count the pool's public method calls made from outside the model's layers."""
    calls: Counter[str] = Counter()
    names = [n for n in dir(HybridKVPool) if not n.startswith("_")]
    originals: dict[str, Any] = {}
    for name in names:
        if isinstance(getattr(HybridKVPool, name), property):
            continue  # an attribute (the slot writer is a callable one), not a pool call
        real = getattr(pool, name)
        if not callable(real):
            continue
        originals[name] = real

        def counted(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            caller = inspect.stack()[1].filename
            if not caller.endswith(IN_LAYER):
                calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(pool, name, counted)
    try:
        yield calls
    finally:
        for name in originals:
            delattr(pool, name)


def engine_for(**kwargs: Any) -> DecodeEngine:
    model = build_tiny_model("gpt_oss", window=WINDOW)
    defaults: dict[str, Any] = {
        "max_running": 4,
        "max_context": 96,
        "page_size": 4,
        "prefill_chunk": 8,
        "record_pages": False,
    }
    engine: DecodeEngine = build_engine(model, **(defaults | kwargs))
    return engine


def test_a_decode_step_is_one_pool_call_outside_the_layers() -> None:
    engine = engine_for()
    prompts = [prompt(n, s) for s, n in enumerate((5, 11, 3, 9))]
    ids = [engine.submit(p, 12) for p in prompts]
    while engine.num_queued or engine.num_running < 4:
        engine.step()
    pool = engine.pool
    assert isinstance(pool, HybridKVPool)
    lengths = [pool.seq_len(i) for i in ids]
    with pool_calls(pool) as calls:
        produced = engine.step()
    assert sorted(produced) == ids
    assert calls == Counter({"try_reserve_batch": 1})
    assert [pool.seq_len(i) for i in ids] == [n + 1 for n in lengths]
    engine.run()
    model = build_tiny_model("gpt_oss", window=WINDOW)
    for rid, p in zip(ids, prompts, strict=True):
        assert list(engine.output(rid).tokens) == mlx_lm_greedy(model, p, 12)


def test_a_prefill_chunk_is_one_reservation_its_caches_take() -> None:
    engine = engine_for(max_running=1)
    pool = engine.pool
    assert isinstance(pool, HybridKVPool)
    rid = engine.submit(prompt(21, 4), MAX_TOKENS)
    chunks = 0
    with pool_calls(pool) as calls:
        while engine.num_running == 0:
            engine.step()
            chunks += 1
    # 21 prompt tokens in chunks of 8: three steps, one reservation each; the prefill
    # caches never reserve, trim or ask the pool for the chunk's slots.
    assert chunks == 3 and calls["try_reserve_batch"] == 3
    assert not {"reserve", "trim_request", "rollback"} & set(calls)
    engine.run()
    model = build_tiny_model("gpt_oss", window=WINDOW)
    assert list(engine.output(rid).tokens) == mlx_lm_greedy(model, prompt(21, 4), MAX_TOKENS)


@pytest.fixture
def hashed_blocks(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Count the blake2b calls of the prefix module, keyed by hashed bytes."""
    seen: Counter[int] = Counter()
    real = hashlib.blake2b

    class Counting:
        @staticmethod
        def blake2b(data: bytes, **kwargs: Any) -> Any:
            seen[len(data)] += 1
            return real(data, **kwargs)

    monkeypatch.setattr(prefix_module, "hashlib", Counting)
    return seen


def test_a_request_hashes_each_page_of_its_text_once(hashed_blocks: Counter[int]) -> None:
    page = 4
    engine = engine_for(page_size=page, max_running=2)
    shared = prompt(16, 1)
    first = engine.submit([*shared, 5, 6], MAX_TOKENS)
    engine.run()
    one = sum(hashed_blocks.values())
    # Prompt 18 tokens + 5 fed back by decode = 23 tokens written: 5 complete pages.
    assert one == (18 + MAX_TOKENS - 1) // page
    second = engine.submit([*shared, 9], MAX_TOKENS)
    engine.run()
    # The hit (16 tokens) is found from the request's own hashes; nothing hashed twice.
    assert sum(hashed_blocks.values()) - one == (17 + MAX_TOKENS - 1) // page
    assert engine.stats.prefix_hit_tokens == 16
    model = build_tiny_model("gpt_oss", window=WINDOW)
    for rid, p in ((first, [*shared, 5, 6]), (second, [*shared, 9])):
        assert list(engine.output(rid).tokens) == mlx_lm_greedy(model, p, MAX_TOKENS)


def test_preempted_requests_keep_their_hashes(hashed_blocks: Counter[int]) -> None:
    # A pool this small preempts: two requests cannot both hold their whole text.
    page = 4
    engine = engine_for(page_size=page, num_pages=10, max_running=2, max_context=40)
    prompts = [prompt(12, 2), prompt(12, 3)]
    ids = [engine.submit(p, 14) for p in prompts]
    engine.run()
    assert engine.stats.preemptions > 0
    # Every request hashes each complete page of its written text once, however often
    # it was re-admitted.
    assert sum(hashed_blocks.values()) == sum((len(p) + 14 - 1) // page for p in prompts)
    model = build_tiny_model("gpt_oss", window=WINDOW)
    for rid, p in zip(ids, prompts, strict=True):
        assert list(engine.output(rid).tokens) == mlx_lm_greedy(model, p, 14)
