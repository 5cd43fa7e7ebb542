"""KVLifetime against brute force: the set of positions each query sees, page by page."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_protocol import CacheLayout, KVLifetime, LayerKind, LayerSpec, LayoutError

windows = st.one_of(st.none(), st.integers(1, 40))


def seen(position: int, window: int | None) -> set[int]:
    """Positions the query at ``position`` attends to, by the definition of a window."""
    return {p for p in range(position + 1) if window is None or position - p < window}


def pages_of(positions: set[int], page_size: int) -> set[int]:
    return {p // page_size for p in positions}


@given(window=windows, position=st.integers(0, 200))
def test_visible_positions(window: int | None, position: int) -> None:
    life = KVLifetime(window)
    visible = seen(position, window)
    assert life.first_visible(position) == min(visible)
    assert life.visible_keys(position) == len(visible)
    # A chunk starting at `position` keeps the older tokens its first query sees.
    assert life.kept_before(position) == len(visible) - 1


@given(window=windows, length=st.integers(1, 200), page_size=st.integers(1, 17))
def test_live_pages_are_what_later_queries_read(
    window: int | None, length: int, page_size: int
) -> None:
    life = KVLifetime(window)
    # Every query from position `length` on reads nothing before first_visible(length).
    later = set().union(*(seen(q, window) for q in range(length, length + 30)))
    held = {p for p in later if p < length}
    assert min(held, default=length) >= life.first_visible(length)
    first_page = life.first_live_page(length, page_size)
    assert first_page == life.first_visible(length) // page_size
    assert life.live_pages(length, page_size) == len(range(first_page, -(-length // page_size)))


@given(
    window=windows,
    max_context=st.integers(1, 300),
    page_size=st.integers(1, 17),
    chunk=st.integers(1, 40),
)
def test_peak_pages_bound_every_reservation(
    window: int | None, max_context: int, page_size: int, chunk: int
) -> None:
    """Reserving ``n <= chunk`` tokens at length ``L`` holds the pages of positions
    ``first_visible(L) .. L + n - 1``; the peak is the most of that over every ``L``."""
    life = KVLifetime(window)
    worst = 0
    for length in range(max_context):
        n = min(chunk, max_context - length)
        positions = set(range(life.first_visible(length), length + n))
        worst = max(worst, len(pages_of(positions, page_size)))
    assert worst <= life.peak_pages(max_context, page_size, chunk)
    if window is None:
        assert life.peak_pages(max_context, page_size, chunk) == worst
        assert life.span_pages(page_size) is None
    else:
        span = life.span_pages(page_size, chunk)
        assert span is not None and life.peak_pages(max_context, page_size, chunk) <= span


def test_array_form_matches_the_scalar_rule() -> None:
    host = [0, 1, 5, 7, 8, 30]
    positions = mx.array(host, dtype=mx.int32)
    for window in (None, 1, 3, 8):
        life = KVLifetime(window)
        got = life.first_visible_array(positions).tolist()
        assert got == [life.first_visible(p) for p in host]


def test_spec_and_layout_hand_out_their_lifetime() -> None:
    layout = CacheLayout(
        [
            LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=4, n_kv_heads=1, head_dim=2),
            LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2),
        ]
    )
    assert layout.lifetime(0) == KVLifetime(4) and layout.specs[1].lifetime == KVLifetime()
    with pytest.raises(LayoutError, match="window"):
        KVLifetime(0)
