"""Prefix caching in the pool against a plain-Python model of the cache.

Every token's K/V written into the pool is a function of the whole prefix up to it, so a page
shared with the wrong request, or a block reused after its content changed, reads back wrong.
With a pool too large to evict, the hit length of every new request is exactly what the model
of the hash chain and the window rule says; with a small pool, hits are never longer than
that and always read back right. The allocator's eviction order is checked on its own.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_pool import BlockHashes, HybridKVPool, PageAllocator
from kv_pool._inspect import allocator, held_pages
from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVLifetime,
    LayerKind,
    LayerSpec,
    RequestStateError,
)

WINDOW = 5
PAGE = {"sliding-w5": 2, "full": 4}
STEP = 4  # a reusable prefix ends on a page boundary of both sub-pools
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 10, []]


def layout() -> CacheLayout:
    return CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=WINDOW, n_kv_heads=1, head_dim=1),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=1),
        ]
    )


def content(tokens: list[int], position: int) -> float:
    """The K/V of ``position``: a function of every token up to it."""
    return float(zlib.crc32(bytes(str(tokens[: position + 1]), "ascii")) % 100_003)


def expected_hit(tokens: list[int], committed: set[tuple[str, tuple[int, ...]]]) -> int:
    """The model: longest page-aligned p < len(tokens) whose needed blocks were committed."""
    best = 0
    for p in range(STEP, len(tokens), STEP):
        ok = True
        for name, size in PAGE.items():
            window = WINDOW if name.startswith("sliding") else None
            first = KVLifetime(window).first_live_page(p, size)
            for j in range(first, p // size):
                if (name, tuple(tokens[: (j + 1) * size])) not in committed:
                    ok = False
        if ok:
            best = p
    return best


class PrefixCacheMachine(RuleBasedStateMachine):
    num_pages = 200

    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridKVPool(
            layout(), num_pages=self.num_pages, page_size=PAGE, prefix_caching=True
        )
        cache = self.pool.prefix_cache
        assert cache is not None
        self.cache = cache
        self.forgotten: list[tuple[str, bytes]] = []
        cache.add_eviction_listener(self._forgot)
        self.active: dict[int, list[int]] = {}
        self.hashes: dict[int, BlockHashes] = {}
        self.committed: set[tuple[str, tuple[int, ...]]] = set()
        self.next_id = 0

    def _forgot(self, name: str, block: bytes) -> None:
        # Called as the block leaves its sub-pool: no lookup finds it any more.
        assert allocator(self.pool, name).cached_page(block) is None
        self.forgotten.append((name, block))

    def _write(self, rid: int, start: int, stop: int) -> None:
        tokens = self.active[rid]
        values = mx.array([content(tokens, p) for p in range(start, stop)])[:, None, None]
        for layer in (0, 1):
            self.pool.set_kv(layer, self.pool.token_slots(rid, layer, start, stop), values, values)
        self.cache.commit(rid, self.hashes[rid], stop)
        for name, size in PAGE.items():
            for j in range(stop // size):
                self.committed.add((name, tuple(tokens[: (j + 1) * size])))

    @rule(
        choice=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    )
    def start(self, choice: int, suffix: list[int]) -> None:
        tokens = PREFIXES[choice] + suffix
        rid = self.next_id
        self.next_id += 1
        hashes = self.cache.hash_tokens(tokens)
        hit = self.cache.match_prefix(hashes)
        self.check_hit(tokens, hit.length)
        try:
            self.pool.add_request(rid)
            self.cache.reuse_prefix(rid, hit)
            self.pool.reserve(rid, len(tokens) - hit.length)
        except MemoryError:
            if self.pool.has_request(rid):
                self.pool.free_request(rid)
            return
        self.active[rid] = tokens
        self.hashes[rid] = hashes
        assert self.pool.seq_len(rid) == len(tokens)
        self._write(rid, hit.length, len(tokens))

    def check_hit(self, tokens: list[int], hit: int) -> None:
        assert hit % STEP == 0 and 0 <= hit < len(tokens)
        assert hit == expected_hit(tokens, self.committed)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data(), token=st.integers(0, 20))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.active)))
        try:
            self.pool.reserve(rid, 1)
        except MemoryError:
            return
        self.active[rid].append(token)
        self.hashes[rid].extend([token])
        n = len(self.active[rid])
        self._write(rid, n - 1, n)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.active)))
        self.pool.free_request(rid)
        del self.active[rid], self.hashes[rid]

    @invariant()
    def every_request_reads_its_own_prefix(self) -> None:
        for rid, tokens in self.active.items():
            n = len(tokens)
            for layer, window in ((0, WINDOW), (1, None)):
                start = KVLifetime(window).first_visible(n)
                k, v = self.pool.get_kv(layer, self.pool.token_slots(rid, layer, start, n))
                want = [content(tokens, p) for p in range(start, n)]
                assert k[:, 0, 0].tolist() == want and v[:, 0, 0].tolist() == want

    @invariant()
    def an_active_request_holds_its_written_prefixes(self) -> None:
        if self.num_pages < PrefixCacheMachine.num_pages:
            return  # under pressure another request's copy may be the one registered, and gone
        for rid, tokens in self.active.items():
            for length in range(STEP, len(tokens) + 1, STEP):
                assert self.cache.holds_prefix(self.hashes[rid], length), (tokens, length)

    @invariant()
    def hits_never_exceed_lookups(self) -> None:
        stats = self.cache.stats()
        assert stats.hit_tokens <= stats.query_tokens
        assert self.pool.memory_report().prefix_cache == stats


class PrefixCacheUnderPressure(PrefixCacheMachine):
    num_pages = 12

    def check_hit(self, tokens: list[int], hit: int) -> None:
        # Evictions may have dropped blocks: never more than the model allows.
        assert hit % STEP == 0 and 0 <= hit < len(tokens)
        assert hit <= expected_hit(tokens, self.committed)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
PrefixCacheUnderPressure.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
test_hits_match_the_model_without_evictions = PrefixCacheMachine.TestCase
test_hits_stay_right_under_eviction = PrefixCacheUnderPressure.TestCase


def test_cached_pages_are_evicted_least_recently_released_first() -> None:
    allocator = PageAllocator(5, name="a")
    pages = allocator.alloc(4)
    for page, block in zip(pages, "wxyz", strict=True):
        assert allocator.register_hash(page, block)
    allocator.free([pages[2]])
    allocator.free([pages[0]])
    allocator.free([pages[3]])
    assert allocator.num_cached == 3 and allocator.num_free == 3
    # Reusing a cached block takes it out of the eviction order.
    allocator.reuse([pages[0]])
    assert allocator.refcount(pages[0]) == 1 and allocator.num_cached == 2
    got = allocator.alloc(1)
    assert got == [pages[2]] and allocator.cached_page("y") is None  # released first
    assert allocator.cached_page("z") == pages[3] and allocator.evictions_total == 1
    assert not allocator.register_hash(pages[1], "w")  # one page per block
    with pytest.raises(MemoryError):
        allocator.alloc(2)
    assert allocator.drop_cached() == 1 and allocator.cached_page("z") is None


def test_reuse_refuses_a_prefix_the_cache_no_longer_serves() -> None:
    pool = HybridKVPool(layout(), num_pages=64, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None
    tokens = list(range(1, 14))
    hashes = cache.hash_tokens(tokens)
    pool.add_request(0)
    pool.reserve(0, len(tokens))
    cache.commit(0, hashes, len(tokens))
    pool.free_request(0)
    hit = cache.match_prefix(hashes)
    assert hit.length == 12 and len(hit.pages["full"]) == 3 and len(hit.pages["sliding-w5"]) == 2
    pool.add_request(1)
    forgotten: list[tuple[str, bytes]] = []
    cache.add_eviction_listener(lambda name, block: forgotten.append((name, block)))
    assert cache.drop_cached() > 0
    assert {b for _, b in forgotten} >= set(hit.blocks["full"])
    with pytest.raises(CacheStateError, match="no longer holds"):
        cache.reuse_prefix(1, hit)
    assert pool.seq_len(1) == 0 and pool.memory_report().bytes_used == 0
    assert cache.match_prefix(hashes).length == 0


def test_hashes_are_computed_once_and_grow_with_the_text() -> None:
    pool = HybridKVPool(layout(), num_pages=64, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None
    tokens = list(range(3, 30))
    whole = cache.hash_tokens(tokens)
    grown = cache.hash_tokens(tokens[:5])
    for t in tokens[5:]:
        grown.extend([t])
    assert grown.num_tokens == whole.num_tokens == len(tokens)
    for length in range(2, 27, 2):  # granularity: gcd of the page sizes 2 and 4
        assert grown.prefix_hash(length) == whole.prefix_hash(length)
    # A page's hash stands for its whole prefix, whatever the page size.
    assert whole.page_hash(1, 4) == whole.page_hash(3, 2) == whole.prefix_hash(8)
    assert cache.hash_tokens([*tokens[:7], 99]).prefix_hash(6) == whole.prefix_hash(6)
    assert cache.hash_tokens([*tokens[:7], 99]).prefix_hash(8) != whole.prefix_hash(8)
    salted = HybridKVPool(
        layout(), num_pages=8, page_size=PAGE, prefix_caching=True, prefix_salt=b"adapter"
    ).prefix_cache
    assert salted is not None
    assert salted.hash_tokens(tokens).prefix_hash(4) != whole.prefix_hash(4)
    with pytest.raises(RequestStateError):
        salted.match_prefix(whole)  # hashes of another pool's salt
    with pytest.raises(RequestStateError):
        whole.extend([1, -1])
    assert whole.num_tokens == len(tokens)


def test_a_prefix_hit_is_used_once_per_new_request() -> None:
    pool = HybridKVPool(layout(), num_pages=64, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None
    tokens = list(range(1, 14))
    hashes = cache.hash_tokens(tokens)
    pool.add_request(0)
    pool.reserve(0, len(tokens))
    cache.commit(0, hashes, len(tokens))
    hit = cache.match_prefix(hashes)
    pool.add_request(1)
    cache.reuse_prefix(1, hit)
    assert pool.seq_len(1) == 12
    with pytest.raises(RequestStateError, match="already holds"):
        cache.reuse_prefix(1, hit)
    with pytest.raises(RequestStateError):
        cache.commit(1, hashes, 13)  # past its reserved length
    for name in hit.pages:
        assert held_pages(pool, 1, name) == list(hit.pages[name])


def test_a_block_held_only_by_an_evicted_copy_is_not_held() -> None:
    pool = HybridKVPool(layout(), num_pages=64, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None
    tokens = list(range(1, 10))
    twins = [cache.hash_tokens(tokens) for _ in range(2)]
    for rid, hashes in enumerate(twins):
        # Both write the same text from scratch: the first to commit registers its blocks.
        pool.add_request(rid)
        pool.reserve(rid, len(tokens))
        cache.commit(rid, hashes, len(tokens))
    assert all(cache.holds_prefix(twins[1], n) for n in (4, 8))
    pool.free_request(0)
    assert cache.drop_cached() > 0
    # Request 1 still holds the same K/V, but under no registered block: nothing to keep there.
    assert not any(cache.holds_prefix(twins[1], n) for n in (4, 8))
    for bad, why in ((0, "length must be"), (6, "no prefix of 6"), (12, "no prefix of 12")):
        with pytest.raises(RequestStateError, match=why):
            cache.holds_prefix(twins[1], bad)


def test_usable_limits_a_hit_to_the_lengths_the_caller_accepts() -> None:
    pool = HybridKVPool(layout(), num_pages=64, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None and cache.boundary == STEP
    tokens = list(range(1, 20))
    hashes = cache.hash_tokens(tokens)
    pool.add_request(0)
    pool.reserve(0, len(tokens))
    cache.commit(0, hashes, len(tokens))
    asked: list[int] = []

    def usable(length: int) -> bool:
        asked.append(length)
        return length in (4, 12)

    hit = cache.match_prefix(hashes, usable=usable)
    # Longest first, every candidate a boundary below the text's length.
    assert hit.length == 12 and asked == [16, 12]
    assert cache.match_prefix(hashes, usable=lambda n: False).length == 0
    assert cache.match_prefix(hashes).length == 16


def test_a_pool_without_pages_serves_the_boundaries_the_caller_holds() -> None:
    state_only = CacheLayout([LayerSpec(layer_id=0, kind=LayerKind.STATE)])
    pool = HybridKVPool(state_only, num_pages={}, page_size=5, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None and cache.boundary == 5
    hashes = cache.hash_tokens(list(range(23)))
    # Nothing of its own to reuse: no hit unless the caller holds something there.
    assert cache.match_prefix(hashes).length == 0
    hit = cache.match_prefix(hashes, usable=lambda n: n <= 15)
    assert hit.length == 15 and hit.pages == {}
    pool.add_request(3)
    cache.reuse_prefix(3, hit)
    assert pool.seq_len(3) == 15


def test_truncated_hashes_equal_the_hashes_of_the_shorter_text() -> None:
    pool = HybridKVPool(layout(), num_pages=8, page_size=PAGE, prefix_caching=True)
    cache = pool.prefix_cache
    assert cache is not None
    text = [(3 * i + 1) % 50 for i in range(31)]
    for length in range(0, 32):
        cut = cache.hash_tokens(text)
        cut.truncate(length, text)
        fresh = cache.hash_tokens(text[:length])
        assert cut.num_tokens == fresh.num_tokens == length
        for end in range(2, length + 1, 2):
            assert cut.prefix_hash(end) == fresh.prefix_hash(end)
        cut.extend(text[length:])
        assert cut.prefix_hash(30) == cache.hash_tokens(text).prefix_hash(30)
    whole = cache.hash_tokens(text)
    with pytest.raises(RequestStateError):
        whole.truncate(32, text)  # past the hashed text
    with pytest.raises(RequestStateError):
        whole.truncate(9, text[:8])  # the tail's tokens are missing
    assert whole.num_tokens == 31
