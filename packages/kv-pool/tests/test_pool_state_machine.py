"""Stateful property test: the pool against a plain-Python model of requests and pages.

The model knows nothing of physical page ids. It gives every page allocation a fresh
*provenance* token (forks copy the tokens of shared pages, a tail copy gets a new one) and
every written token a code. After every step the pool must agree with it: pages are shared
exactly when provenances match, refcounts equal owners, free + used = total, sliding holdings
stay within the bound, every held position reads back the code written there, and a failed
call changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kv_pool import HybridKVPool
from kv_pool._inspect import (
    allocator,
    held_pages,
    num_free_pages,
    page_table,
    request_ids,
    sub_pool_names,
)
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    InvalidPageError,
    KVCacheError,
    LayerKind,
    LayerSpec,
    PoolExhaustedError,
    RequestStateError,
    ShapeMismatchError,
    UnknownRequestError,
)

SPECS = [
    LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=5, n_kv_heads=1, head_dim=2),
    LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2),
    LayerSpec(layer_id=2, kind=LayerKind.SLIDING, window=3, n_kv_heads=2, head_dim=2),
    LayerSpec(layer_id=3, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4),
    LayerSpec(layer_id=4, kind=LayerKind.STATE),
]
LAYOUT = CacheLayout(SPECS)
PAGE = {"sliding-w5-1x2": 2, "full-1x2": 3, "sliding-w3-2x2": 2, "full-2x4": 4}
NUM = {"sliding-w5-1x2": 9, "full-1x2": 10, "sliding-w3-2x2": 8, "full-2x4": 8}
WINDOW = {"sliding-w5-1x2": 5, "full-1x2": None, "sliding-w3-2x2": 3, "full-2x4": None}
LAYERS = {"sliding-w5-1x2": (0,), "full-1x2": (1,), "sliding-w3-2x2": (2,), "full-2x4": (3,)}
NAMES = list(PAGE)
RIDS = st.integers(min_value=0, max_value=7)


def tl(a: mx.array) -> Any:
    """``a.tolist()`` typed loosely (mlx's stub types it as a scalar-or-list union)."""
    return a.tolist()


def _value(code: int, layer: int) -> float:
    return code + layer / 8


@dataclass
class MReq:
    seq_len: int = 0
    # provenance token per logical page, None once released
    pages: dict[str, list[int | None]] = field(default_factory=lambda: {n: [] for n in NAMES})
    codes: dict[int, int] = field(default_factory=dict)
    last_n: int = 1
    # trimmed since the last reservation: the next query is at seq_len itself
    trimmed: bool = False


def _assert(condition: bool) -> None:
    assert condition


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridKVPool(LAYOUT, num_pages=NUM, page_size=PAGE)
        self.model: dict[int, MReq] = {}
        self.next_prov = 1
        self.next_code = 1

    # ---------------------------------------------------------------- model helpers

    def owners(self, name: str) -> dict[int, int]:
        counts: dict[int, int] = {}
        for req in self.model.values():
            for prov in req.pages[name]:
                if prov is not None:
                    counts[prov] = counts.get(prov, 0) + 1
        return counts

    def model_free(self, name: str) -> int:
        return NUM[name] - 1 - len(self.owners(name))

    def reserve_plan(self, req: MReq, n: int) -> dict[str, tuple[int, int, int]]:
        """Per sub-pool: (first logical page kept, pages to add, pages given back)."""
        plan = {}
        for name in NAMES:
            size, window = PAGE[name], WINDOW[name]
            pages = req.pages[name]
            first = next((j for j, p in enumerate(pages) if p is not None), len(pages))
            cut = first
            if window is not None:
                cut = max(first, max(0, req.seq_len - window + 1) // size)
            owners = self.owners(name)
            back = sum(1 for p in pages[first:cut] if p is not None and owners[p] == 1)
            plan[name] = (cut, math.ceil((req.seq_len + n) / size) - len(pages), back)
        return plan

    def snapshot(self) -> Any:
        pool = self.pool
        tables = {
            rid: (pool.seq_len(rid), {n: tl(page_table(pool, rid, n)) for n in NAMES})
            for rid in request_ids(pool)
        }
        refs = {
            n: [allocator(pool, n).refcount(p) for p in range(NUM[n])] + [num_free_pages(pool, n)]
            for n in NAMES
        }
        return tables, refs

    def expect_unchanged(self, error: type[BaseException], call: Any) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            call()
        assert self.snapshot() == before

    def write(self, rid: int, slots: Mapping[str, mx.array], start: int, n: int) -> None:
        req = self.model[rid]
        codes = []
        for pos in range(start, start + n):
            req.codes[pos] = self.next_code
            codes.append(self.next_code)
            self.next_code += 1
        for name in NAMES:
            for layer in LAYERS[name]:
                g = LAYOUT.geometry(layer)
                col = mx.array([_value(c, layer) for c in codes], dtype=mx.float32)
                k = mx.broadcast_to(col[:, None, None], (n, g.n_kv_heads, g.head_dim))
                self.pool.set_kv(layer, slots[name], k, -k)

    # ---------------------------------------------------------------- rules

    @initialize()
    def start(self) -> None:
        assert sub_pool_names(self.pool) == tuple(NAMES)
        for rid in (0, 1):
            self.pool.add_request(rid)
            self.model[rid] = MReq()

    @rule(rid=RIDS)
    def add(self, rid: int) -> None:
        if rid in self.model:
            self.expect_unchanged(RequestStateError, lambda: self.pool.add_request(rid))
            return
        self.pool.add_request(rid)
        self.model[rid] = MReq()

    def _reserve(self, rid: int, n: int) -> None:
        if rid not in self.model:
            self.expect_unchanged(UnknownRequestError, lambda: self.pool.reserve(rid, n))
            return
        req = self.model[rid]
        plan = self.reserve_plan(req, n)
        short = [name for name in NAMES if plan[name][1] > self.model_free(name) + plan[name][2]]
        if short:
            self.expect_unchanged(
                AssertionError, lambda: _assert(self.pool.try_reserve_batch({rid: n}) is not None)
            )
            before = self.snapshot()
            with pytest.raises(PoolExhaustedError) as info:
                self.pool.reserve(rid, n)
            event("reserve: pool exhausted")
            assert info.value.sub_pool == short[0]
            assert info.value.pages_requested == plan[short[0]][1]
            assert self.snapshot() == before
            return
        start = req.seq_len
        slots = self.pool.reserve(rid, n).slots
        if any(plan[name][0] for name in NAMES if WINDOW[name]):
            event("reserve: sliding pages released")
        for name in NAMES:
            cut, add, _ = plan[name]
            pages = req.pages[name]
            for j in range(cut):
                pages[j] = None
            for _ in range(add):
                pages.append(self.next_prov)
                self.next_prov += 1
            assert slots[name].shape == (n,)
            assert slots[name].dtype == mx.int32
        req.seq_len += n
        req.last_n = n
        req.trimmed = False
        if n:
            for name in NAMES:
                layer = LAYERS[name][0]
                expected = tl(self.pool.token_slots(rid, layer, start, start + n))
                assert tl(slots[name]) == expected
            self.write(rid, slots, start, n)

    @rule(rid=RIDS, n=st.integers(min_value=0, max_value=9))
    def reserve(self, rid: int, n: int) -> None:
        self._reserve(rid, n)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), n=st.integers(min_value=0, max_value=9))
    def reserve_live(self, data: st.DataObject, n: int) -> None:
        self._reserve(data.draw(st.sampled_from(sorted(self.model))), n)

    @precondition(lambda self: bool(self.model))
    @rule()
    def decode_step(self) -> None:
        for rid in list(self.model):
            self._reserve(rid, 1)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), frac=st.floats(min_value=0, max_value=1))
    def fork_live(self, data: st.DataObject, frac: float) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        fresh = [r for r in range(8) if r not in self.model]
        child = data.draw(st.sampled_from(fresh)) if fresh else parent
        self.fork(parent, child, frac)

    @precondition(lambda self: bool(self.model))
    @rule(n=st.integers(min_value=0, max_value=3))
    def decode_batch(self, n: int) -> None:
        """All live requests at once through one try_reserve_batch: atomic over the batch."""
        rids = sorted(self.model)
        plans = {rid: self.reserve_plan(self.model[rid], n) for rid in rids}
        short = [
            name
            for name in NAMES
            if sum(plans[r][name][1] for r in rids)
            > self.model_free(name) + sum(plans[r][name][2] for r in rids)
        ]
        if short:
            event("try_reserve_batch: pool exhausted")
            self.expect_unchanged(
                AssertionError,
                lambda: _assert(self.pool.try_reserve_batch(dict.fromkeys(rids, n)) is not None),
            )
            return
        starts = {rid: self.model[rid].seq_len for rid in rids}
        got = self.pool.try_reserve_batch(dict.fromkeys(rids, n))
        assert got is not None
        assert got.request_ids == tuple(rids) and got.start_lengths == tuple(starts.values())
        slots = got.slots
        for b, rid in enumerate(rids):
            req = self.model[rid]
            for name in NAMES:
                cut, add, _ = plans[rid][name]
                for j in range(cut):
                    req.pages[name][j] = None
                for _ in range(add):
                    req.pages[name].append(self.next_prov)
                    self.next_prov += 1
            req.seq_len += n
            req.last_n = n
            req.trimmed = False
            if n:
                row = {name: slots[name][b * n : (b + 1) * n] for name in NAMES}
                for name in NAMES:
                    assert slots[name].shape == (len(rids) * n,)
                    expected = self.pool.token_slots(rid, LAYERS[name][0], starts[rid], req.seq_len)
                    assert tl(row[name]) == tl(expected)
                self.write(rid, row, starts[rid], n)
        if len(rids) > 1:
            self.expect_unchanged(
                RequestStateError,
                lambda: self.pool.try_reserve_batch({rids[0]: 1}, headroom={rids[0]: 1}),
            )

    @rule(parent=RIDS, child=RIDS, frac=st.floats(min_value=0, max_value=1))
    def fork(self, parent: int, child: int, frac: float) -> None:
        if parent not in self.model:
            self.expect_unchanged(
                UnknownRequestError, lambda: self.pool.fork_request(parent, child, 0)
            )
            return
        preq = self.model[parent]
        n = round(frac * preq.seq_len)
        if child in self.model:
            self.expect_unchanged(
                RequestStateError, lambda: self.pool.fork_request(parent, child, n)
            )
            return
        shared: dict[str, tuple[int, list[int | None], bool]] = {}
        released = False
        for name in NAMES:
            size, window = PAGE[name], WINDOW[name]
            whole, tail = divmod(n, size)
            first = 0 if window is None else max(0, n - window + 1) // size
            kept = preq.pages[name][first:whole]
            if n and (None in kept or (tail and preq.pages[name][whole] is None)):
                released = True
            shared[name] = (first, kept, bool(tail))
        if released:
            event("fork: refused, released")
            self.expect_unchanged(
                RequestStateError, lambda: self.pool.fork_request(parent, child, n)
            )
            return
        short = [name for name in NAMES if shared[name][2] and self.model_free(name) < 1]
        if short:
            self.expect_unchanged(
                PoolExhaustedError, lambda: self.pool.fork_request(parent, child, n)
            )
            return
        self.pool.fork_request(parent, child, n)
        event("fork: done")
        creq = MReq(seq_len=n, last_n=0, codes={p: c for p, c in preq.codes.items() if p < n})
        for name in NAMES:
            first, kept, tail = shared[name]
            pages: list[int | None] = [None] * first
            pages += kept
            if tail:
                pages.append(self.next_prov)
                self.next_prov += 1
            creq.pages[name] = pages
        self.model[child] = creq
        # A bad n on a live parent is refused without change.
        self.expect_unchanged(
            RequestStateError,
            lambda: self.pool.fork_request(parent, 99, preq.seq_len + 1),
        )

    @rule(rid=RIDS)
    def free(self, rid: int) -> None:
        if rid not in self.model:
            self.expect_unchanged(UnknownRequestError, lambda: self.pool.free_request(rid))
            return
        self.pool.free_request(rid)
        del self.model[rid]

    def first_held(self, req: MReq, name: str) -> int:
        pages = req.pages[name]
        return next((j for j, p in enumerate(pages) if p is not None), len(pages))

    def model_trim(self, req: MReq, new_len: int) -> None:
        """The model's side of a granted trim: drop pages and codes past ``new_len``."""
        for name in NAMES:
            keep = max(math.ceil(new_len / PAGE[name]), self.first_held(req, name))
            del req.pages[name][keep:]
        req.codes = {p: c for p, c in req.codes.items() if p < new_len}
        req.seq_len = new_len
        req.trimmed = True

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), n=st.integers(min_value=0, max_value=12))
    def trim(self, data: st.DataObject, n: int) -> None:
        """Give back the last ``n`` positions: allowed while every window stays whole."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        req = self.model[rid]
        if n > req.seq_len:
            self.expect_unchanged(RequestStateError, lambda: self.pool.trim_request(rid, n))
            return
        new_len = req.seq_len - n
        for name in NAMES:
            window, size = WINDOW[name], PAGE[name]
            first = self.first_held(req, name)
            if window is not None and first and first * size > max(0, new_len - window + 1):
                event("trim: refused, window released")
                self.expect_unchanged(CacheStateError, lambda: self.pool.trim_request(rid, n))
                return
            keep = max(math.ceil(new_len / size), first)
            if n and new_len % size and keep > first:
                tail = req.pages[name][keep - 1]
                if tail is not None and self.owners(name)[tail] > 1:
                    event("trim: refused, shared tail page")
                    self.expect_unchanged(CacheStateError, lambda: self.pool.trim_request(rid, n))
                    return
        self.pool.trim_request(rid, n)
        event("trim: done")
        self.model_trim(req, new_len)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), n=st.integers(min_value=1, max_value=6))
    def rolled_back_reserve(self, data: st.DataObject, n: int) -> None:
        """A reservation trimmed right away (a failed engine step) leaves no trace."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        req = self.model[rid]
        before_len = req.seq_len
        got = self.pool.try_reserve_batch({rid: n})
        if got is None:
            return
        self.pool.rollback(got)
        self.pool.rollback(got)  # a second rollback finds nothing to undo
        # The model: the reservation's sliding releases stay, its new pages go.
        plan = self.reserve_plan(req, n)
        for name in NAMES:
            for j in range(plan[name][0]):
                req.pages[name][j] = None
        req.seq_len += n
        self.model_trim(req, before_len)
        # The next reservation from the same length is served as if nothing happened.
        self._reserve(rid, 1)
        # The next reservation from the same length is served as if nothing happened.
        self._reserve(rid, 1)

    @precondition(lambda self: bool(self.model))
    @rule(
        data=st.data(), layer=st.sampled_from([0, 1, 2, 3]), how=st.sampled_from(["free", "trim"])
    )
    def stale_slots_refused(self, data: st.DataObject, layer: int, how: str) -> None:
        """Slots issued for a request stop being trusted once it lets go of their pages."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        req = self.model[rid]
        name = NAMES[layer]
        start = self.first_held(req, name) * PAGE[name]
        if start >= req.seq_len:
            return
        slots = self.pool.token_slots(rid, layer, start, req.seq_len)
        g = LAYOUT.geometry(layer)
        kv = mx.zeros((req.seq_len - start, g.n_kv_heads, g.head_dim))
        if how == "free":
            self.pool.free_request(rid)
            del self.model[rid]
        else:
            self.trim(data, req.seq_len - start)
            if self.pool.seq_len(rid) != start:
                return
        event(f"stale slots after {how}")
        self.expect_unchanged(CacheStateError, lambda: self.pool.set_kv(layer, slots, kv, kv))
        self.expect_unchanged(CacheStateError, lambda: self.pool.get_kv(layer, slots))

    @rule(name=st.sampled_from(NAMES), data=st.data())
    def bad_page_free(self, name: str, data: st.DataObject) -> None:
        alloc = allocator(self.pool, name)
        owners = self.owners(name)
        held = {
            held_pages(self.pool, rid, name)[0]
            for rid in self.model
            if held_pages(self.pool, rid, name)
        }
        free_pages = [p for p in range(1, NUM[name]) if alloc.refcount(p) == 0]
        choices: list[list[int]] = [[0], [NUM[name]], [-1]]
        if free_pages:
            choices.append([data.draw(st.sampled_from(free_pages))])
        if held:
            page = data.draw(st.sampled_from(sorted(held)))
            # one legal owner plus one more than it has: the whole call must be refused
            choices.append([page] * (alloc.refcount(page) + 1))
            if free_pages:
                choices.append([page, free_pages[0]])
        pages = data.draw(st.sampled_from(choices))
        assert sum(owners.values()) >= 0
        self.expect_unchanged(InvalidPageError, lambda: alloc.free(pages))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def bad_buffer_calls(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        req = self.model[rid]
        layer = data.draw(st.sampled_from([0, 1, 2, 3]))
        g = LAYOUT.geometry(layer)
        slots = mx.array([1], dtype=mx.int32)
        bad = mx.zeros((1, g.n_kv_heads + 1, g.head_dim))
        self.expect_unchanged(ShapeMismatchError, lambda: self.pool.set_kv(layer, slots, bad, bad))
        half = mx.zeros((1, g.n_kv_heads, g.head_dim), dtype=mx.float16)
        self.expect_unchanged(
            ShapeMismatchError, lambda: self.pool.set_kv(layer, slots, half, half)
        )
        self.expect_unchanged(
            RequestStateError,
            lambda: self.pool.token_slots(rid, layer, 0, req.seq_len + 1),
        )
        name = NAMES[layer]
        first = next((j for j, p in enumerate(req.pages[name]) if p is not None), None)
        if first:
            self.expect_unchanged(
                CacheStateError, lambda: self.pool.token_slots(rid, layer, 0, req.seq_len)
            )
        self.expect_unchanged(KVCacheError, lambda: self.pool.get_key_buffer(4))

    # ---------------------------------------------------------------- invariants

    @invariant()
    def pages_agree_with_model(self) -> None:
        assert set(request_ids(self.pool)) == set(self.model)
        for name in NAMES:
            alloc = allocator(self.pool, name)
            size = PAGE[name]
            prov_to_page: dict[int, int] = {}
            page_count: dict[int, int] = {}
            for rid, req in self.model.items():
                assert self.pool.seq_len(rid) == req.seq_len
                table = tl(page_table(self.pool, rid, name))
                assert len(table) == math.ceil(req.seq_len / size) == len(req.pages[name])
                for phys, prov in zip(table, req.pages[name], strict=True):
                    if prov is None:
                        assert phys == 0
                        continue
                    assert phys != 0
                    # same page <=> same provenance (shared by fork)
                    assert prov_to_page.setdefault(prov, phys) == phys
                    page_count[phys] = page_count.get(phys, 0) + 1
                assert len(set(prov_to_page.values())) == len(prov_to_page)
                held = [p for p in req.pages[name] if p is not None]
                window = WINDOW[name]
                if window is not None:
                    # every query of the last reservation still sees its whole window
                    query = req.seq_len - (0 if req.trimmed else req.last_n)
                    needed = max(0, query - window + 1)
                    if req.seq_len:
                        assert req.pages[name][needed // size] is not None
                    bound = math.ceil((window - 1 + max(1, req.last_n)) / size) + 1
                    assert len(held) <= bound
                    if req.last_n <= 1:
                        assert len(held) <= math.ceil(window / size) + 1
            assert alloc.refcount(0) == 0
            for page in range(1, NUM[name]):
                assert alloc.refcount(page) == page_count.get(page, 0)
            assert alloc.num_free + alloc.num_used == NUM[name] - 1
            assert alloc.num_used == len(page_count)
            assert alloc.num_free == self.model_free(name)

    @invariant()
    def data_reads_back(self) -> None:
        for rid, req in self.model.items():
            for name in NAMES:
                size = PAGE[name]
                first = next((j for j, p in enumerate(req.pages[name]) if p is not None), None)
                if first is None:
                    continue
                start = first * size
                for layer in LAYERS[name]:
                    slots = self.pool.token_slots(rid, layer, start, req.seq_len)
                    k, v = self.pool.get_kv(layer, slots)
                    expected = [_value(req.codes[p], layer) for p in range(start, req.seq_len)]
                    assert tl(k[:, 0, 0]) == expected
                    assert (-v[:, -1, -1]).tolist() == expected


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    stateful_step_count=40,
    max_examples=2 * settings().max_examples,
)
