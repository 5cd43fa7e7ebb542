"""The lifetime rule of a layer's keys: which positions a query still sees, in what pages.

Every package asks these questions (the pool's release plan and sizing, the kernels' start
page, the caches' read start and masks, the batched decode padding): they all call here.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ._errors import LayoutError
from ._validate import check_int

__all__ = ["KVLifetime"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLifetime:
    """Which cached positions a layer's queries see: all of them, or a trailing ``window``.

    ``window=None`` is a full-attention layer. On a sliding layer the query at position
    ``p`` sees positions ``p - window + 1 .. p`` (``window`` keys, itself included), so a
    position older than that is never read again by this or any later query.
    """

    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None:
            window = check_int(self.window, "window", minimum=1, error=LayoutError)
            object.__setattr__(self, "window", window)

    def first_visible(self, position: int) -> int:
        """The oldest position the query at ``position`` sees (0 on a full layer).

        With ``length`` tokens cached, ``first_visible(length)`` is the oldest position that
        any later query still needs: everything before it may be released.
        """
        if self.window is None:
            return 0
        return max(0, position - self.window + 1)

    def visible_keys(self, position: int) -> int:
        """Keys the query at ``position`` sees, itself included."""
        return position + 1 - self.first_visible(position)

    def kept_before(self, offset: int) -> int:
        """Cached tokens the first query of a chunk starting at ``offset`` still sees.

        ``offset`` on a full layer, ``min(offset, window - 1)`` on a sliding one.
        """
        return offset - self.first_visible(offset)

    def first_visible_array(self, positions: mx.array) -> mx.array:
        """:meth:`first_visible` of every entry of an integer array (no host sync)."""
        if self.window is None:
            return mx.zeros_like(positions)
        return mx.maximum(positions - (self.window - 1), 0)

    def first_live_page(self, length: int, page_size: int) -> int:
        """The first page a request of ``length`` cached tokens still needs."""
        return self.first_visible(length) // page_size

    def live_pages(self, length: int, page_size: int) -> int:
        """Pages a request of ``length`` cached tokens needs for its next query."""
        return _cdiv(length, page_size) - self.first_live_page(length, page_size)

    def span_pages(self, page_size: int, queries: int = 1) -> int | None:
        """The most pages the keys ``queries`` consecutive queries see can span.

        ``ceil((window - 1 + queries) / page_size) + 1`` on a sliding layer (the ``+ 1`` for
        a window that does not start on a page boundary); ``None`` (unbounded) on a full one.
        """
        if self.window is None:
            return None
        return _cdiv(self.window - 1 + queries, page_size) + 1

    def peak_pages(self, max_context: int, page_size: int, chunk: int = 1) -> int:
        """The most pages one request up to ``max_context`` tokens holds at once.

        Full: ``ceil(max_context / page_size)``. Sliding: while a chunk of ``chunk`` tokens is
        reserved, the request holds positions ``L - window + 1 .. L + chunk - 1``: at most
        ``ceil((window - 1 + chunk) / page_size) + 1`` pages (the ``+ 1`` for a window that
        does not start on a page boundary), never more than the full count.
        """
        full = _cdiv(max_context, page_size)
        span = self.span_pages(page_size, chunk)
        return full if span is None else min(full, span)
