"""A reference KV pool for tests: plain-Python page tables, one buffer pair per layer.

Independent of kv-pool: a sub-pool ``"full"`` and a sub-pool ``"sliding"`` (one window),
lists for page tables and free lists, the lifetime rule from ``kv_protocol.KVLifetime``. The
sliding sub-pool releases pages that left every window, so code under test meets freed
(null) page-table entries too. It satisfies ``kv_protocol.KVPool`` and counts the calls a
test may want to bound (``reserve_calls``, ``reserve_batch_calls`` (calls of
``try_reserve_batch``), ``set_kv_calls``, ``replace_calls``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVLifetime,
    KVQuantization,
    LayerKind,
    LayerKindError,
    PoolExhaustedError,
    PoolMemoryReport,
    RequestStateError,
    Reservation,
    SubPoolReport,
    UnknownRequestError,
)

__all__ = ["ReferenceBookkeeping", "ReferenceKVPool"]


class _SubPool:
    """One sub-pool: its page size, free list, window and page tables."""

    def __init__(self, name: str, page_size: int, num_pages: int, window: int | None) -> None:
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self.window = window
        self.free: list[int] = list(range(num_pages - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}

    def first_visible(self, seq_len: int) -> int:
        """The first position the query at ``seq_len`` sees."""
        return KVLifetime(self.window).first_visible(seq_len)

    def plan(self, table: list[int], seq_len: int, n: int) -> tuple[int, list[int]]:
        """(pages to allocate, table indices to release) to reserve n more tokens."""
        needed = -(-(seq_len + n) // self.page_size) - len(table)
        release: list[int] = []
        if self.window is not None:
            first = self.first_visible(seq_len)
            release = [
                j for j, page in enumerate(table) if page != 0 and (j + 1) * self.page_size <= first
            ]
        return needed, release


class ReferenceKVPool:
    """A KVPool with a 'full' and a 'sliding' sub-pool, head-major per-layer buffers."""

    def __init__(
        self,
        layout: CacheLayout,
        *,
        num_pages: int = 64,
        page_size: int = 4,
        sliding_num_pages: int | None = None,
        sliding_page_size: int | None = None,
        dtype: mx.Dtype | None = None,
    ) -> None:
        """A pool for ``layout``; ``dtype`` (default: each layer's own) is the buffers' dtype."""
        self._layout = layout
        windows = {layout.window(i) for i in layout.sliding_layer_ids}
        assert len(windows) <= 1, "the fake pool supports one window"
        window = windows.pop() if windows else None
        self.subs: dict[str, _SubPool] = {}
        if layout.full_layer_ids:
            self.subs["full"] = _SubPool("full", page_size, num_pages, None)
        if layout.sliding_layer_ids:
            self.subs["sliding"] = _SubPool(
                "sliding",
                sliding_page_size or page_size,
                sliding_num_pages or num_pages,
                window,
            )
        self._keys: dict[int, mx.array] = {}
        self._values: dict[int, mx.array] = {}
        for layer_id in layout.attention_layer_ids:
            geo = layout.geometry(layer_id)
            sub = self.subs[self.sub_pool_of(layer_id)]
            slots = sub.num_pages * sub.page_size
            kind = geo.dtype if dtype is None else dtype
            self._keys[layer_id] = mx.zeros((geo.n_kv_heads, slots, geo.head_dim), dtype=kind)
            self._values[layer_id] = mx.zeros((geo.n_kv_heads, slots, geo.value_dim), dtype=kind)
        self._lens: dict[int, int] = {}
        self.set_kv_calls = 0
        self.reserve_calls = 0
        self.reserve_batch_calls = 0
        self.replace_calls = 0

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        """The layout the pool was built for."""
        return self._layout

    def free_pages(self) -> dict[str, int]:
        """Free pages per sub-pool."""
        return {name: len(sub.free) for name, sub in self.subs.items()}

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per sub-pool."""
        return {name: sub.num_pages - 1 - len(sub.free) for name, sub in self.subs.items()}

    def add_request(self, request_id: int) -> None:
        """Register a new request holding no tokens."""
        assert request_id not in self._lens, request_id
        self._lens[request_id] = 0
        for sub in self.subs.values():
            sub.tables[request_id] = []

    def _check(self, request_id: int) -> None:
        if request_id not in self._lens:
            raise UnknownRequestError(f"unknown request {request_id}")

    def free_request(self, request_id: int) -> None:
        """Release every page of the request and forget it."""
        self._check(request_id)
        for sub in self.subs.values():
            sub.free.extend(p for p in sub.tables.pop(request_id) if p != 0)
        del self._lens[request_id]

    def has_request(self, request_id: int) -> bool:
        """True while the request is registered."""
        return request_id in self._lens

    def seq_len(self, request_id: int) -> int:
        """Token positions reserved so far for the request."""
        self._check(request_id)
        return self._lens[request_id]

    def _plans(self, demands: Mapping[int, int]) -> dict[str, list[tuple[int, list[int]]]]:
        """Per sub-pool, (pages to allocate, table indices to release) of each request."""
        return {
            sub.name: [sub.plan(sub.tables[r], self._lens[r], n) for r, n in demands.items()]
            for sub in self.subs.values()
        }

    def _short(self, plans: dict[str, list[tuple[int, list[int]]]]) -> tuple[str, int, int] | None:
        for sub in self.subs.values():
            needed = sum(n for n, _ in plans[sub.name])
            released = sum(len(rel) for _, rel in plans[sub.name])
            if needed > len(sub.free) + released:
                return sub.name, needed, len(sub.free) + released
        return None

    def try_reserve_batch(
        self,
        demands: Mapping[int, int],
        *,
        headroom: Mapping[int, int] | None = None,
        page_tables: bool = True,
    ) -> Reservation | None:
        """All requests at once: every release first, then every allocation; or ``None``."""
        self.reserve_batch_calls += 1
        if not isinstance(demands, Mapping):
            raise RequestStateError(f"expected a mapping of request id -> tokens, got {demands!r}")
        for rid in demands:
            self._check(rid)
        plans = self._plans(demands)
        if self._short(plans) is not None:
            return None
        if headroom:
            both = {**demands, **headroom}
            for rid in headroom:
                self._check(rid)
            if self._short(self._plans(both)) is not None:
                return None
        ids = list(demands)
        starts = [self._lens[r] for r in ids]
        slots: dict[str, mx.array] = {}
        for sub in self.subs.values():
            for rid, (_, release) in zip(ids, plans[sub.name], strict=True):
                table = sub.tables[rid]
                for j in release:
                    sub.free.append(table[j])
                    table[j] = 0
            flat: list[int] = []
            for rid, (needed, _) in zip(ids, plans[sub.name], strict=True):
                table = sub.tables[rid]
                for _ in range(needed):
                    table.append(sub.free.pop())
                seq = self._lens[rid]
                flat.extend(self._slot(sub, table, p) for p in range(seq, seq + demands[rid]))
            slots[sub.name] = mx.array(flat, dtype=mx.int32)
        for rid in ids:
            self._lens[rid] += demands[rid]
        return Reservation(
            request_ids=tuple(ids),
            start_lengths=tuple(starts),
            n_tokens=tuple(demands[r] for r in ids),
            slots=slots,
            page_tables={name: self.batch_page_table(ids, name) for name in self.subs}
            if page_tables
            else {},
        )

    def reserve(self, request_id: int, n_tokens: int) -> Reservation:
        """Reserve ``n_tokens`` more positions for one request, all or nothing (or raise)."""
        self._check(request_id)
        self.reserve_calls += 1
        short = self._short(self._plans({request_id: n_tokens}))
        if short is not None:
            name, asked, free = short
            raise PoolExhaustedError(sub_pool=name, pages_requested=asked, pages_free=free)
        got = self.try_reserve_batch({request_id: n_tokens}, page_tables=False)
        assert got is not None
        return got

    def rollback(self, reservation: Reservation) -> None:
        """Trim each request still registered back to its start length."""
        for rid, start in zip(reservation.request_ids, reservation.start_lengths, strict=True):
            if rid in self._lens and self._lens[rid] > start:
                self.trim_request(rid, self._lens[rid] - start)

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        """Drop the last ``n_tokens`` positions and the pages that no longer hold any."""
        self._check(request_id)
        new_len = self._lens[request_id] - n_tokens
        if n_tokens < 0 or new_len < 0:
            raise RequestStateError(f"cannot trim {n_tokens} of {self._lens[request_id]}")
        for sub in self.subs.values():
            table = sub.tables[request_id]
            keep = -(-new_len // sub.page_size)
            sub.free.extend(p for p in table[keep:] if p != 0)
            del table[keep:]
        self._lens[request_id] = new_len

    def _slot(self, sub: _SubPool, table: list[int], position: int) -> int:
        page = table[position // sub.page_size]
        if page == 0:
            raise CacheStateError(f"position {position} was released from sub-pool {sub.name}")
        return page * sub.page_size + position % sub.page_size

    def sub_pool_of(self, layer_id: int) -> str:
        """``"full"`` or ``"sliding"``."""
        kind = self._layout.kind(layer_id)
        if kind is LayerKind.FULL:
            return "full"
        if kind is LayerKind.SLIDING:
            return "sliding"
        raise LayerKindError(f"{layer_id=} not in attention layers")

    def page_size(self, layer_id: int) -> int:
        """Tokens per page in the layer's sub-pool."""
        return self.subs[self.sub_pool_of(layer_id)].page_size

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        """Slots of positions ``start .. stop - 1`` of the request for the layer."""
        self._check(request_id)
        assert 0 <= start <= stop <= self._lens[request_id]
        sub = self.subs[self.sub_pool_of(layer_id)]
        table = sub.tables[request_id]
        return mx.array([self._slot(sub, table, p) for p in range(start, stop)], dtype=mx.int32)

    def batch_page_table(self, request_ids: Sequence[int], sub_pool: str) -> mx.array:
        """``(B, max_pages)`` page tables, padded with page 0."""
        sub = self.subs[sub_pool]
        tables = [sub.tables[r] for r in request_ids]
        width = max(1, max((len(t) for t in tables), default=0))
        if not tables:
            return mx.zeros((0, width), dtype=mx.int32)
        return mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)

    def get_key_buffer(self, layer_id: int) -> mx.array:
        """The layer's key buffer."""
        return self._keys[layer_id]

    def get_value_buffer(self, layer_id: int) -> mx.array:
        """The layer's value buffer."""
        return self._values[layer_id]

    def kv_quantization(self, layer_id: int) -> KVQuantization | None:
        """``None``: this pool stores plain pages (the layout's error for a bad id)."""
        self.layout.attention_index(layer_id)
        return None

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        """Rebind the layer's buffers."""
        assert keys.shape == self._keys[layer_id].shape
        self.replace_calls += 1
        self._keys[layer_id] = keys
        self._values[layer_id] = values

    def set_kv(self, layer_id: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Write token-major keys/values at ``slots``."""
        self.set_kv_calls += 1
        k = self._keys[layer_id]
        v = self._values[layer_id]
        k[:, slots, :] = keys.transpose(1, 0, 2).astype(k.dtype)
        v[:, slots, :] = values.transpose(1, 0, 2).astype(v.dtype)
        self._keys[layer_id] = k
        self._values[layer_id] = v

    def held_slots(self, request_id: int, sub_pool: str) -> int:
        """Token slots the request's held pages of ``sub_pool`` span."""
        sub = self.subs[sub_pool]
        return sub.page_size * sum(1 for page in sub.tables[request_id] if page != 0)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major keys/values at ``slots``."""
        return (
            self._keys[layer_id][:, slots, :].transpose(1, 0, 2),
            self._values[layer_id][:, slots, :].transpose(1, 0, 2),
        )

    @property
    def prefix_cache(self) -> None:
        """``None``: this pool keeps no prefixes."""
        return None

    def memory_report(self) -> PoolMemoryReport:
        """Pages used and free per sub-pool (bytes from the buffers' dtypes)."""
        subs = []
        for sub in self.subs.values():
            layers = tuple(
                i for i in self._layout.attention_layer_ids if self.sub_pool_of(i) == sub.name
            )
            per_page = sum(
                (self._keys[i].nbytes + self._values[i].nbytes) // sub.num_pages for i in layers
            )
            subs.append(
                SubPoolReport(
                    name=sub.name,
                    kind="full" if sub.window is None else "sliding",
                    window=sub.window,
                    layer_ids=layers,
                    page_size=sub.page_size,
                    num_pages=sub.num_pages,
                    pages_used=sub.num_pages - 1 - len(sub.free),
                    pages_free=len(sub.free),
                    bytes_per_page=per_page,
                )
            )
        return PoolMemoryReport(
            sub_pools=tuple(subs),
            num_requests=len(self._lens),
            tokens=sum(self._lens.values()),
            full_kv_bytes_per_token=self._layout.full_kv_bytes_per_token(),
            full_capacity_tokens=None,
        )


class ReferenceBookkeeping:
    """A pool reduced to the tensor-free bookkeeping a scheduler needs.

    Lengths per request and one token ``capacity`` shared by all of them (``None``: no
    limit); it satisfies ``kv_protocol.KVRequestBookkeeping`` and nothing more.
    """

    def __init__(self, layout: CacheLayout, capacity: int | None = None) -> None:
        self._layout = layout
        self.capacity = capacity
        self.lengths: dict[int, int] = {}

    @property
    def layout(self) -> CacheLayout:
        """The layout the book was made for."""
        return self._layout

    def add_request(self, request_id: int) -> None:
        """Register a new request holding no tokens."""
        self.lengths[request_id] = 0

    def free_request(self, request_id: int) -> None:
        """Forget the request."""
        del self.lengths[request_id]

    def has_request(self, request_id: int) -> bool:
        """True while the request is registered."""
        return request_id in self.lengths

    def seq_len(self, request_id: int) -> int:
        """Tokens the request holds."""
        return self.lengths[request_id]

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        """Give back the request's last ``n_tokens``."""
        self.lengths[request_id] -= n_tokens

    def try_reserve_batch(
        self,
        demands: Mapping[int, int],
        *,
        headroom: Mapping[int, int] | None = None,
        page_tables: bool = True,
    ) -> Reservation | None:
        """The demands if they (and the headroom) fit in the capacity beside what is held."""
        for rid in [*demands, *(headroom or {})]:
            if rid not in self.lengths:
                raise UnknownRequestError(f"unknown request {rid}")
        if self.capacity is not None:
            wanted = sum(demands.values()) + sum((headroom or {}).values())
            if sum(self.lengths.values()) + wanted > self.capacity:
                return None
        starts = tuple(self.lengths[r] for r in demands)
        for rid, n in demands.items():
            self.lengths[rid] += n
        return Reservation(
            request_ids=tuple(demands),
            start_lengths=starts,
            n_tokens=tuple(demands.values()),
            slots={},
            page_tables={},
        )

    def rollback(self, reservation: Reservation) -> None:
        """Each request still registered goes back to its start length."""
        for rid, start in zip(reservation.request_ids, reservation.start_lengths, strict=True):
            if rid in self.lengths and self.lengths[rid] > start:
                self.lengths[rid] = start
