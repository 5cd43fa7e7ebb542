"""The values a pool hands out: a reservation, a prefix hit, the memory report."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_protocol import (
    PoolMemoryReport,
    PrefixCacheStats,
    PrefixHit,
    RequestStateError,
    Reservation,
    SubPoolReport,
)


def test_a_reservation_says_where_each_row_starts() -> None:
    slots = mx.array([10, 11, 12, 40, 41], dtype=mx.int32)
    got = Reservation(
        request_ids=(7, 3),
        start_lengths=(5, 0),
        n_tokens=(3, 2),
        slots={"full": slots},
        page_tables={"full": mx.zeros((2, 1), dtype=mx.int32)},
    )
    assert got.batch_size == 2 and got.total_tokens == 5
    assert got.lengths == (8, 2) and [got.row_start(b) for b in (0, 1)] == [0, 3]
    assert got.slots["full"] is slots  # the pool's issued array, not a copy
    with pytest.raises(TypeError):
        got.slots["sliding"] = slots  # type: ignore[index]
    with pytest.raises(RequestStateError, match="one start length"):
        Reservation(request_ids=(1,), start_lengths=(), n_tokens=(1,), slots={}, page_tables={})


def test_a_prefix_hit_pairs_pages_with_blocks() -> None:
    hit = PrefixHit(length=8, pages={"full": (3, 4)}, blocks={"full": (b"a", b"b")})
    assert hit and hit.pages["full"] == (3, 4)
    assert not PrefixHit(length=0, pages={}, blocks={})
    with pytest.raises(RequestStateError, match="one block hash per page"):
        PrefixHit(length=8, pages={"full": (3, 4)}, blocks={"full": (b"a",)})
    with pytest.raises(RequestStateError):
        PrefixHit(length=8, pages={"full": (3,)}, blocks={"sliding": (b"a",)})


def test_the_memory_report_sums_its_sub_pools() -> None:
    subs = tuple(
        SubPoolReport(
            name=name,
            kind=kind,
            window=window,
            layer_ids=(i,),
            page_size=4,
            num_pages=10,
            pages_used=used,
            pages_free=9 - used,
            bytes_per_page=64,
        )
        for i, (name, kind, window, used) in enumerate(
            [("sliding-w8", "sliding", 8, 2), ("full", "full", None, 5)]
        )
    )
    stats = PrefixCacheStats(
        queries=2, query_tokens=40, hit_tokens=10, cached_pages=1, hashed_pages=3, evictions=0
    )
    report = PoolMemoryReport(
        sub_pools=subs,
        num_requests=1,
        tokens=20,
        full_kv_bytes_per_token=32,
        full_capacity_tokens=36,
        prefix_cache=stats,
    )
    assert report.pages_used == {"sliding-w8": 2, "full": 5}
    assert report.bytes_used == 7 * 64 and report.bytes_total == 20 * 64
    assert report.full_equivalent_bytes == 20 * 32 and stats.hit_rate == 0.25
