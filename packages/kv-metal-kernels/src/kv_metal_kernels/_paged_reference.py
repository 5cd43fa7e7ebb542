"""The reference paged decode attention: gather through the page table, then fused SDPA."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from kv_protocol import KVBuffer, KVLifetime, QuantizedKV, ShapeMismatchError, check_int

from ._memo import IdentityMemo
from ._softmax_cpu import softmax_attention, unfused_softmax_choice, use_unfused_softmax
from ._validate import PagedIndexCheck, check_paged_attention_args

__all__ = ["ReferencePagedAttention", "window_page_count"]


def window_page_count(window: int, page_size: int) -> int:
    """Pages that can hold the trailing ``window`` tokens: ``ceil(window / page_size) + 1``."""
    span = KVLifetime(window).span_pages(page_size)
    assert span is not None  # a window always spans a bounded number of pages
    return span


def _gather_pages(pool: KVBuffer, pages: mx.array, page_size: int) -> mx.array:
    """``(H, num_slots, D)`` pool, ``(B, n)`` page ids -> ``(H, B, n * page_size, D)``.

    A quantized pool is gathered in its stored form and the gathered pages dequantized.
    """
    if isinstance(pool, QuantizedKV):
        return pool.map(lambda a: _gather_pages(a, pages, page_size)).dequantize()
    h, num_slots, d = pool.shape
    b, n = pages.shape
    paged = pool.reshape(h, num_slots // page_size, page_size, d)
    # Head-major gather keeps each page a contiguous block (measured fastest on CPU).
    return paged[:, pages].reshape(h, b, n * page_size, d)


def _visible_pages(
    page_table: mx.array,
    seq_lens: mx.array,
    *,
    n_cols: int,
    page_size: int,
    window: int | None,
    queries: int = 1,
) -> tuple[mx.array, mx.array]:
    """The ``(B, n)`` page ids the queries read and their keep-mask.

    Query ``l`` of row ``b`` is at position ``seq_lens[b] - queries + l`` (one query: the
    decode query at ``seq_len - 1``). At most ``n_cols`` page-table columns; a sliding
    window reads only the pages that can cover the keys its queries see. The mask is ``(B,
    n * page_size)`` for one query, ``(B, queries, n * page_size)`` for several; every key
    outside ``0 .. position`` (or the window) is masked, so null-page entries are never
    attended. A query at a negative position (padding) keeps key 0 only.
    """
    max_pages = page_table.shape[1]
    lifetime = KVLifetime(window)
    positions = mx.maximum(
        seq_lens[:, None] - queries + mx.arange(queries, dtype=mx.int32)[None, :], 0
    )
    span = lifetime.span_pages(page_size, queries)
    in_table: mx.array | None = None
    if span is not None and span < n_cols:
        first = lifetime.first_visible_array(positions[:, 0])
        cols = (first // page_size)[:, None] + mx.arange(span, dtype=mx.int32)[None, :]
        in_table = mx.repeat(cols < max_pages, page_size, axis=1)[:, None, :]
        pages = mx.take_along_axis(page_table, mx.minimum(cols, max_pages - 1), axis=1)
        offsets = mx.arange(page_size, dtype=mx.int32)
        pos = (cols[:, :, None] * page_size + offsets).reshape(cols.shape[0], 1, -1)
    else:
        pages = page_table[:, :n_cols]
        pos = mx.arange(n_cols * page_size, dtype=mx.int32)[None, None, :]
    query = positions[:, :, None]
    keep = pos <= query
    if window is not None:
        keep = keep & (pos >= lifetime.first_visible_array(query))
    if in_table is not None:
        keep = keep & in_table
    if queries == 1:
        keep = keep[:, 0, :]
    return pages, keep


def _attend(
    q: mx.array,
    k_pool: KVBuffer,
    v_pool: KVBuffer,
    pages: mx.array,
    keep: mx.array,
    *,
    page_size: int,
    scale: float,
    sinks: mx.array | None,
    unfused_softmax: bool,
) -> mx.array:
    """One attention call for the rows of ``q`` over their gathered ``pages``."""
    keys = _gather_pages(k_pool, pages, page_size)
    values = _gather_pages(v_pool, pages, page_size)
    if unfused_softmax:
        return softmax_attention(q, keys, values, keep, scale=scale, sinks=sinks)
    return mx.fast.scaled_dot_product_attention(
        q,
        keys.swapaxes(0, 1),
        values.swapaxes(0, 1),
        scale=scale,
        mask=keep[:, None, None, :] if keep.ndim == 2 else keep[:, None, :, :],
        sinks=None if sinks is None else sinks.astype(q.dtype),
    )


class ReferencePagedAttention:
    """Paged decode attention as gather + one ``mx.fast.scaled_dot_product_attention``.

    For request ``b`` the keys are positions ``0 .. seq_lens[b] - 1`` (or the trailing
    ``window`` of them), read through ``page_table[b]``; everything else in the gathered
    block is masked, so null-page entries are never attended. Sliding layers gather only
    the ``ceil(window / page_size) + 1`` table entries that can cover the window, so their
    cost is O(window), not O(context).

    ``buckets`` (default 4): the requests are sorted by length and split into up to
    ``buckets`` groups, one SDPA call each, when that cuts the gathered area by at least a
    quarter (ragged batches; measured 0.7x of one call on CPU). On a sliding layer a row
    reads at most its window's span, so there the split sets rows shorter than the window
    apart from those that read the whole span.
    This, and trimming the gather to the longest request, reads ``seq_lens`` back to the
    host (a tiny sync). ``buckets=0`` never reads ``seq_lens`` back and makes one call over
    every page-table column. The plan (host lengths, groups, row order) is kept for the
    last few ``seq_lens`` array objects, so the layers of one decode step, which share one
    ``seq_lens`` object, read it back once; pass a new array rather than writing into one
    already passed.

    Index values are always checked before any work (an out-of-range page id would make
    the gather read outside the pool): page ids within the pool, ``seq_lens`` in ``1 ..
    max_pages * page_size``, else :class:`kv_protocol.RequestStateError`. The check is one
    fused min/max reduction read back to the host, kept per ``page_table`` / ``seq_lens``
    array object like the plan (so once per decode step and sub-pool);
    ``validate=True`` repeats it on every call.

    Quantized pools (:class:`kv_protocol.QuantizedKV`) are gathered in their stored form
    (packed data, scales, biases) and dequantized after the gather, then attended the same way.

    ``unfused_softmax``: on MLX's CPU backend (the default, ``None``, decides by the default
    device when called) the attention is composed here, the softmax in float32 from
    vectorised arithmetic (:func:`softmax_attention`), since there MLX's fused attention
    falls back to unfused operations whose ``exp`` runs element by element; elsewhere one
    ``mx.fast.scaled_dot_product_attention``. The pages and keep-mask a step's rows read
    are built once per ``page_table`` / ``seq_lens`` pair and shared by its layers.

    :meth:`attend_queries` (:class:`kv_protocol.PagedQueryAttention`) attends several
    consecutive queries per request from one gather of its pages.
    """

    def __init__(
        self, *, buckets: int = 4, validate: bool = False, unfused_softmax: bool | None = None
    ) -> None:
        self._buckets = check_int(buckets, "buckets", minimum=0, error=ShapeMismatchError)
        self._validate = validate
        self._unfused_softmax = unfused_softmax_choice(unfused_softmax)
        self._plans: IdentityMemo[_BucketPlan] = IdentityMemo()
        self._visible: IdentityMemo[tuple[mx.array, mx.array, mx.array]] = IdentityMemo(16)
        self._index_check = PagedIndexCheck()

    @property
    def name(self) -> str:
        """Backend name: ``reference``."""
        return "reference"

    def __call__(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, 1, D)``; see :class:`kv_protocol.PagedDecodeAttention`."""
        page_size, scale, window = check_paged_attention_args(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks
        )
        return self._attend_rows(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks
        )

    def attend_queries(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, L, D)`` of ``L`` consecutive queries per request.

        See :class:`kv_protocol.PagedQueryAttention`: query ``l`` is at position
        ``seq_lens[b] - L + l``. Each request's pages are gathered once for all its queries
        (a speculative verification's rows would otherwise each gather the same keys).
        """
        page_size, scale, window = check_paged_attention_args(
            q,
            k_pool,
            v_pool,
            page_table,
            seq_lens,
            page_size,
            scale,
            window,
            sinks,
            queries=True,
        )
        return self._attend_rows(
            q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window, sinks
        )

    def _attend_rows(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        page_size: int,
        scale: float,
        window: int | None,
        sinks: mx.array | None,
    ) -> mx.array:
        """The checked call: ``q.shape[2]`` consecutive queries per row."""
        b, queries = q.shape[0], q.shape[2]
        if b == 0:
            return mx.zeros_like(q)
        self._index_check(
            page_table, seq_lens, page_size, k_pool.shape[1], every_call=self._validate
        )
        max_pages = page_table.shape[1]
        unfused = use_unfused_softmax(self._unfused_softmax)

        def run(
            rows_q: mx.array, lens: mx.array, n_cols: int, rows: mx.array | None = None
        ) -> mx.array:
            pages, keep = self._pages_and_mask(
                page_table, lens, n_cols, page_size, window, queries, rows
            )
            return _attend(
                rows_q,
                k_pool,
                v_pool,
                pages,
                keep,
                page_size=page_size,
                scale=float(scale),
                sinks=sinks,
                unfused_softmax=unfused,
            )

        if self._buckets == 0:
            return run(q, seq_lens, max_pages)

        row_work = q.shape[1] * queries * q.shape[3]
        plan_key = (page_size, max_pages, window, self._buckets, row_work, queries)
        plan = self._plans.get(seq_lens, plan_key)
        if plan is None:
            plan = _plan_buckets(
                seq_lens,
                page_size,
                max_pages,
                window,
                self._buckets,
                row_work=row_work,
                queries=queries,
            )
            self._plans.put(seq_lens, plan_key, plan)
        if plan.inverse is None:
            return run(q, seq_lens, plan.n_all)
        outs = [run(q[group.rows], group.lens, group.n_cols, group.rows) for group in plan.groups]
        return mx.concatenate(outs, axis=0)[plan.inverse]

    def _pages_and_mask(
        self,
        table: mx.array,
        lens: mx.array,
        n_cols: int,
        page_size: int,
        window: int | None,
        queries: int,
        rows: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        """:func:`_visible_pages` of ``table``'s ``rows`` (all when ``None``), kept per step.

        Kept per ``lens`` object and table object: a bucket group's ``lens`` belongs to that
        group alone, so its rows' pages and mask are built once for the step's layers.
        """
        # The table's id is part of the key; the entry holds the table, so while the entry
        # lives no other array can take that id.
        key = (id(table), n_cols, page_size, window, queries)
        held = self._visible.get(lens, key)
        if held is not None:
            return held[1], held[2]
        pages, keep = _visible_pages(
            table if rows is None else table[rows],
            lens,
            n_cols=n_cols,
            page_size=page_size,
            window=window,
            queries=queries,
        )
        self._visible.put(lens, key, (table, pages, keep))
        return pages, keep


@dataclass(frozen=True)
class _Group:
    """One SDPA call of a bucketed batch: its ``rows``, their lengths, the columns to read."""

    rows: mx.array
    lens: mx.array
    n_cols: int


@dataclass(frozen=True)
class _BucketPlan:
    """How one ``seq_lens`` array is attended.

    One call over ``n_all`` columns when ``inverse`` is ``None``; else one call per group,
    whose concatenated outputs are put back in request order by ``inverse``.
    """

    n_all: int
    groups: tuple[_Group, ...]
    inverse: mx.array | None


#: What one more attention call costs, in query-head x key x head-dim products (measured on
#: a 2-core x86_64: about 0.13 ms, the time 700 keys of 8 heads x 64 take).
_CALL_COST = 360_000


def _plan_buckets(
    seq_lens: mx.array,
    page_size: int,
    max_pages: int,
    window: int | None,
    buckets: int,
    *,
    row_work: int,
    queries: int = 1,
) -> _BucketPlan:
    """Read ``seq_lens`` on the host and decide the attention calls (``buckets >= 1``).

    Rows sorted by length are split into 1 .. ``buckets`` groups; the split chosen has the
    least modelled cost: the keys each group reads (``row_work`` = query heads x head dim
    per key) plus a fixed cost per call. One call unless splitting also cuts the keys read
    by at least a quarter. On a sliding layer a row reads at most the pages its window
    spans (``queries`` consecutive queries): rows shorter than the window are grouped
    apart from those that read the whole span, so they do not read (and copy) it too.
    """
    host_lens = [int(n) for n in cast(list[int], seq_lens.tolist())]
    b = len(host_lens)
    span = KVLifetime(window).span_pages(page_size, queries)

    def cols_for(n_tokens: int) -> int:
        return max(1, min(max_pages, math.ceil(n_tokens / page_size)))

    def read(n_cols: int) -> int:
        """Table columns a call over ``n_cols`` gathers per row (its window's span)."""
        return n_cols if span is None else min(n_cols, span)

    n_all = cols_for(max(host_lens))
    single = _BucketPlan(n_all=n_all, groups=(), inverse=None)
    order = sorted(range(b), key=host_lens.__getitem__)
    one_call_keys = b * read(n_all) * page_size
    best_cost = one_call_keys * row_work + _CALL_COST
    best: list[list[int]] | None = None
    for count in range(2, buckets + 1):
        groups = _split(order, count)
        keys = sum(len(g) * read(cols_for(host_lens[g[-1]])) for g in groups) * page_size
        cost = keys * row_work + len(groups) * _CALL_COST
        if keys <= 0.75 * one_call_keys and cost < best_cost:
            best_cost, best = cost, groups
    if best is None:
        return single
    planned = []
    for group in best:
        rows = mx.array(group, dtype=mx.int32)
        planned.append(
            _Group(rows=rows, lens=seq_lens[rows], n_cols=cols_for(host_lens[group[-1]]))
        )
    inverse = [0] * b
    for new_index, old_index in enumerate(order):
        inverse[old_index] = new_index
    return _BucketPlan(
        n_all=n_all, groups=tuple(planned), inverse=mx.array(inverse, dtype=mx.int32)
    )


def _split(order: list[int], buckets: int) -> list[list[int]]:
    """Split ``order`` into up to ``buckets`` contiguous groups of near-equal size."""
    n = len(order)
    count = max(1, min(buckets, n // 2))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [order[bounds[i] : bounds[i + 1]] for i in range(count) if bounds[i] < bounds[i + 1]]
