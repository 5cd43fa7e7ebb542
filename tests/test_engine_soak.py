"""Seeded soak of DecodeEngine on the real pool, caches and kernels.

Each seed draws one scenario: a tiny fp32 hybrid model (gpt_oss, gemma3_text, cohere2; windows
3..16; 2-4 layers), page sizes 1..64 (often larger than the window, sometimes different per
sub-pool), a prefill chunk of 1..64, ``max_running``, a roomy, tight or ``from_budget`` pool
(tight ones preempt), 1-9 requests of 1..120 prompt tokens arriving over time with
``max_tokens`` 1..24 and stop tokens, aborts at random steps (some while the request is
prefilling), fused RoPE on or off. After every step the pool's page accounting must match
the page tables of the registered requests, and only live requests may be registered. At
the end every request that finished normally must equal mlx-lm greedy generation of its
prompt alone (cut at its stop token / ``max_tokens``), an aborted one must have produced a
prefix of it, and every page must be free.

A second, smaller soak forks a prefilled request at a random point (``fork_request``) and
continues parent and child through ``PoolBackedKVCache``; both must equal mlx-lm alone.

The default run covers ``SOAK_SEEDS`` and ``FORK_SEEDS`` seeds; ``KV_SOAK_SEEDS=start:stop`` and
``KV_SOAK_FORK_SEEDS=start:stop`` run other ones (the long local hunt).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kv_batching import RequestStatus
from kv_caches import PoolBackedKVCache
from kv_pool import HybridKVPool, pages_per_request, required_bytes, sub_pool_groups
from kv_pool._inspect import allocator, held_pages, page_table, request_ids
from kv_protocol import RequestStateError, layout_from_model
from kv_serve import build_engine
from kv_testing import build_tiny_model, greedy_continue, mlx_lm_greedy

VOCAB = 48
MAX_GEN = 24
MAX_PROMPT = 120
STEP_LIMIT = 4000
SOAK_SEEDS = 24
ARCHS = (("gpt_oss", (2, 3, 4)), ("gemma3_text", (3, 4)), ("cohere2", (4,)))


def _seeds(variable: str = "KV_SOAK_SEEDS", default: int = SOAK_SEEDS) -> list[int]:
    spec = os.environ.get(variable)
    if not spec:
        return list(range(default))
    start, _, stop = spec.partition(":")
    return list(range(int(start), int(stop)))


@cache
def tiny(arch: str, window: int, layers: int) -> nn.Module:
    return build_tiny_model(arch, window=window, num_layers=layers, vocab_size=VOCAB)


@cache
def greedy(arch: str, window: int, layers: int, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """mlx-lm generating ``MAX_GEN`` tokens for the prompt alone (shorter runs are prefixes)."""
    return tuple(mlx_lm_greedy(tiny(arch, window, layers), prompt, MAX_GEN))


def expected(full: Sequence[int], max_tokens: int, stops: frozenset[int]) -> list[int]:
    out: list[int] = []
    for token in full[:max_tokens]:
        out.append(token)
        if token in stops:
            break
    return out


@dataclass(frozen=True)
class Req:
    arrival: int  # engine step before which it is submitted
    prompt: tuple[int, ...]
    max_tokens: int
    stops: frozenset[int]
    abort_at: int | None  # step before which it is aborted
    abort_in_prefill: bool  # abort the first time it is seen prefilling


@dataclass(frozen=True)
class Scenario:
    arch: str
    window: int
    layers: int
    page_size: int | dict[str, int]
    chunk: int
    max_running: int
    fused: bool
    pool_mode: str
    pool_extra: float
    concurrency: int
    requests: tuple[Req, ...]


def _prompt_length(rng: random.Random, window: int, page: int) -> int:
    pick = rng.random()
    if pick < 0.15:
        return 1
    if pick < 0.45:
        near = rng.choice([window, 2 * window, page, 2 * page, window + page])
        return max(1, min(MAX_PROMPT, near + rng.randint(-2, 2)))
    return rng.randint(1, MAX_PROMPT)


def draw(seed: int) -> Scenario:
    rng = random.Random(seed)
    arch, layer_choices = ARCHS[seed % len(ARCHS)] if seed < 6 else rng.choice(ARCHS)
    window = rng.randint(3, 16)
    layers = rng.choice(layer_choices)
    names = [g.name for g in sub_pool_groups(layout_from_model(tiny(arch, window, layers)))]
    sizes = [1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 64]
    page_size: int | dict[str, int]
    if rng.random() < 0.3:
        page_size = {n: rng.choice(sizes) for n in names}
        base = min(page_size.values())
    else:
        page_size = rng.choice(sizes)
        base = page_size
    chunk = rng.choice([1, 2, 3, window - 1, window, window + 1, 16, 33, 64, rng.randint(1, 64)])
    chunk = max(1, min(64, chunk))
    n_requests = rng.randint(1, 9)
    requests = []
    for _ in range(n_requests):
        n = _prompt_length(rng, window, base)
        prompt = tuple(rng.randrange(VOCAB) for _ in range(n))
        max_tokens = rng.choice([1, 1, 2, rng.randint(1, MAX_GEN), MAX_GEN])
        full = greedy(arch, window, layers, prompt)
        stops: set[int] = set()
        if rng.random() < 0.4:
            stops.add(rng.choice(full))  # a token that will (probably) be generated
        if rng.random() < 0.3:
            stops.add(rng.randrange(VOCAB))
        abort_at = rng.randint(0, 60) if rng.random() < 0.2 else None
        requests.append(
            Req(
                arrival=rng.choice([0, 0, rng.randint(0, 40)]),
                prompt=prompt,
                max_tokens=max_tokens,
                stops=frozenset(stops),
                abort_at=abort_at,
                abort_in_prefill=rng.random() < 0.1,
            )
        )
    return Scenario(
        arch=arch,
        window=window,
        layers=layers,
        page_size=page_size,
        chunk=chunk,
        max_running=rng.choice([1, 2, 3, 4, 16]),
        fused=rng.random() < 0.5,
        pool_mode=rng.choice(["roomy", "tight", "tight", "budget"]),
        pool_extra=rng.random(),
        concurrency=rng.randint(1, 3),
        requests=tuple(requests),
    )


def build_pool(s: Scenario, model: nn.Module) -> HybridKVPool:
    layout = layout_from_model(model)
    context = max(len(r.prompt) + r.max_tokens for r in s.requests)
    if s.pool_mode == "budget":
        need = required_bytes(
            layout,
            max_context=context,
            concurrency=s.concurrency,
            page_size=s.page_size,
            prefill_chunk=s.chunk,
        )
        budget = int(need * (1 + s.pool_extra))
        return HybridKVPool.from_budget(
            layout,
            budget,
            max_context=context,
            concurrency=s.concurrency,
            page_size=s.page_size,
            prefill_chunk=s.chunk,
        )
    # The least one request needs at its peak (the engine can shrink a chunk to one token).
    one = pages_per_request(layout, max_context=context, page_size=s.page_size)
    if s.pool_mode == "roomy":
        counts = {n: p * len(s.requests) + 2 for n, p in one.items()}
    else:
        counts = {n: p + 1 + int(p * s.pool_extra) for n, p in one.items()}
    return HybridKVPool(layout, num_pages=counts, page_size=s.page_size)


def check_accounting(pool: HybridKVPool) -> None:
    """Pages in use per sub-pool == the distinct pages the registered requests hold."""
    for spec in pool.sub_pools:
        held: set[int] = set()
        for rid in request_ids(pool):
            pages = held_pages(pool, rid, spec.name)
            assert 0 not in pages, f"request {rid} holds the null page in {spec.name}"
            held.update(pages)
        assert allocator(pool, spec.name).num_used == len(held), spec.name


def run_scenario(s: Scenario) -> dict[str, Any]:
    model = tiny(s.arch, s.window, s.layers)
    pool = build_pool(s, model)
    engine = build_engine(
        model,
        pool=pool,
        fused_rope="reference" if s.fused else "off",
        max_running=s.max_running,
        prefill_chunk=s.chunk,
    )
    ids: dict[int, int] = {}  # request index -> engine id
    aborted: set[int] = set()
    step = 0
    while len(ids) < len(s.requests) or engine.has_work:
        for i, r in enumerate(s.requests):
            if i not in ids and (r.arrival <= step or not engine.has_work):
                ids[i] = engine.submit(r.prompt, r.max_tokens, stop_tokens=r.stops)
        for i, rid in ids.items():
            r = s.requests[i]
            status = engine.output(rid).status
            prefilling = r.abort_in_prefill and status is RequestStatus.PREFILLING
            if (r.abort_at == step or prefilling) and engine.abort(rid):
                aborted.add(i)
                assert not pool.has_request(rid), f"aborted request {rid} is still in the pool"
                check_accounting(pool)
        engine.step()
        step += 1
        assert step < STEP_LIMIT, f"no progress after {step} steps"
        live = {
            rid
            for rid in ids.values()
            if engine.output(rid).status in (RequestStatus.PREFILLING, RequestStatus.RUNNING)
        }
        assert set(request_ids(pool)) <= live
        check_accounting(pool)

    for i, r in enumerate(s.requests):
        out = engine.output(ids[i])
        want = expected(greedy(s.arch, s.window, s.layers, r.prompt), r.max_tokens, r.stops)
        got = list(out.tokens)
        where = f"request #{i} (prompt length {len(r.prompt)}, max_tokens {r.max_tokens})"
        if i in aborted:
            assert out.finish_reason == "aborted", where
            assert got == want[: len(got)], where
        else:
            assert out.finish_reason in ("stop", "length"), (where, out.finish_reason)
            assert got == want, where
            assert (out.finish_reason == "stop") == (got[-1] in r.stops), where
    assert all(sub.pages_used == 0 for sub in pool.memory_report().sub_pools)
    assert request_ids(pool) == ()
    return {"steps": step, "preemptions": engine.stats.preemptions, "aborted": len(aborted)}


@pytest.mark.parametrize("seed", _seeds())
def test_engine_soak(seed: int) -> None:
    scenario = draw(seed)
    try:
        run_scenario(scenario)
    except BaseException as exc:
        exc.add_note(f"scenario of seed {seed}: {scenario}")
        raise


def test_soak_scenarios_cover_the_risky_corners() -> None:
    """The default seeds do draw the configurations the soak is meant to stress."""
    drawn = [draw(seed) for seed in range(SOAK_SEEDS)]

    def page_sizes(s: Scenario) -> list[int]:
        return list(s.page_size.values()) if isinstance(s.page_size, dict) else [s.page_size]

    assert {s.arch for s in drawn} == {a for a, _ in ARCHS}
    assert any(max(page_sizes(s)) > s.window for s in drawn)
    assert any(s.chunk < s.window for s in drawn) and any(s.chunk > s.window for s in drawn)
    assert {s.pool_mode for s in drawn} == {"roomy", "tight", "budget"}
    assert {s.fused for s in drawn} == {False, True}
    requests = [r for s in drawn for r in s.requests]
    assert any(len(r.prompt) == 1 for r in requests)
    assert any(r.max_tokens == 1 for r in requests)
    assert any(r.stops for r in requests)
    assert any(r.abort_at is not None for r in requests)
    assert any(r.abort_in_prefill for r in requests)


FORK_SEEDS = 16


def _prefill_through(
    model: nn.Module, caches: list[Any], tokens: Sequence[int], chunks: int
) -> Any:
    """Feed ``tokens`` through the model in ``chunks`` roughly equal pieces; last logits."""
    logits = None
    step = max(1, -(-len(tokens) // chunks))
    for start in range(0, len(tokens), step):
        logits = model(mx.array([list(tokens[start : start + step])]), cache=caches)
        mx.eval(logits)
    return logits


@pytest.mark.parametrize("seed", _seeds("KV_SOAK_FORK_SEEDS", FORK_SEEDS))
def test_fork_then_continue_matches_mlx_lm(seed: int) -> None:
    """fork_request + PoolBackedKVCache: the child continues a prefix of the parent's prompt
    with its own suffix, the parent continues its prompt; both equal mlx-lm alone, and a fork
    the pool refuses is one that needs positions the parent's window released."""
    rng = random.Random(1000 + seed)
    arch, layer_choices = ARCHS[seed % len(ARCHS)]
    window = rng.randint(3, 16)
    layers = rng.choice(layer_choices)
    model = tiny(arch, window, layers)
    layout = layout_from_model(model)
    page_size = rng.choice([1, 2, 3, 4, 8, 16, 64])
    pool = HybridKVPool(
        layout, num_pages=3 * (-(-2 * MAX_PROMPT // page_size)) + 4, page_size=page_size
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
    pool.add_request(0)
    parent = [PoolBackedKVCache(pool, 0, i) for i in range(layers)]
    logits = _prefill_through(model, parent, prompt, rng.choice([1, 2, 4, len(prompt)]))
    far_back = max(0, len(prompt) - 2 * window)
    cut = rng.choice([0, len(prompt), rng.randint(0, len(prompt)), rng.randint(0, far_back)])
    # The fork needs positions >= cut - window + 1 of each sliding sub-pool (from their page).
    needs_released = False
    for spec in pool.sub_pools:
        if spec.window is not None and cut:
            first_live = page_table(pool, 0, spec.name).shape[0] - len(
                held_pages(pool, 0, spec.name)
            )
            needs_released |= max(0, cut - spec.window + 1) // spec.page_size < first_live
    if needs_released:
        with pytest.raises(RequestStateError, match="released"):
            pool.fork_request(0, 1, cut)
        assert request_ids(pool) == (0,)
    else:
        pool.fork_request(0, 1, cut)
        suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        child = [PoolBackedKVCache(pool, 1, i) for i in range(layers)]
        assert all(c.offset == cut for c in child)
        child_logits = _prefill_through(model, child, suffix, rng.randint(1, 3))
        n = rng.randint(1, 12)
        got = greedy_continue(model, child, child_logits, n)
        want = mlx_lm_greedy(model, prompt[:cut] + suffix, n)
        assert got == want, f"child forked at {cut} of {len(prompt)}"
        pool.free_request(1)
    n = rng.randint(1, 12)
    assert greedy_continue(model, parent, logits, n) == list(
        greedy(arch, window, layers, tuple(prompt))[:n]
    )
    pool.free_request(0)
    assert all(sub.pages_used == 0 for sub in pool.memory_report().sub_pools)
