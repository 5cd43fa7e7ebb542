"""A reference KV pool for tests: plain-Python page tables, one buffer pair per layer.

Independent of kv-pool: a sub-pool ``"full"`` and a sub-pool ``"sliding"`` (one window),
lists for page tables and free lists, the lifetime rule from ``kv_protocol.KVLifetime``. The
sliding sub-pool releases pages that left every window, so code under test meets freed
(null) page-table entries too. It satisfies ``kv_protocol.KVPool`` and counts the calls a
test may want to bound (``reserve_calls``, ``reserve_batch_calls``, ``set_kv_calls``,
``replace_calls``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVLifetime,
    KVQuantization,
    LayerKind,
    LayerKindError,
    PoolExhaustedError,
    RequestStateError,
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

    def can_reserve(self, demands: dict[int, int]) -> bool:
        """True if one reserve per request of ``demands`` fits in any order."""
        for sub in self.subs.values():
            balance = len(sub.free)
            for rid, n in demands.items():
                self._check(rid)
                needed, release = sub.plan(sub.tables[rid], self._lens[rid], n)
                # A release makes room for the same request's pages only (any order fits).
                balance -= max(0, needed - len(release))
            if balance < 0:
                return False
        return True

    def reserve(self, request_id: int, n_tokens: int) -> dict[str, mx.array]:
        """Reserve ``n_tokens`` more positions, all or nothing."""
        self._check(request_id)
        self.reserve_calls += 1
        seq = self._lens[request_id]
        plans = {}
        for sub in self.subs.values():
            needed, release = sub.plan(sub.tables[request_id], seq, n_tokens)
            if needed - len(release) > len(sub.free):
                raise PoolExhaustedError(
                    sub_pool=sub.name, pages_requested=needed, pages_free=len(sub.free)
                )
            plans[sub.name] = (needed, release)
        out = {}
        for sub in self.subs.values():
            needed, release = plans[sub.name]
            table = sub.tables[request_id]
            for j in release:
                sub.free.append(table[j])
                table[j] = 0
            for _ in range(needed):
                table.append(sub.free.pop())
            out[sub.name] = mx.array(
                [self._slot(sub, table, p) for p in range(seq, seq + n_tokens)], dtype=mx.int32
            )
        self._lens[request_id] = seq + n_tokens
        return out

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

    def reserve_batch(self, request_ids: Sequence[int], n_tokens: int = 1) -> dict[str, mx.array]:
        """All requests at once: every release first, then every allocation (all or nothing)."""
        self.reserve_batch_calls += 1
        ids = list(request_ids)
        for rid in ids:
            self._check(rid)
        if len(set(ids)) != len(ids):
            raise RequestStateError(f"repeated request ids {ids}")
        plans: dict[str, list[tuple[int, list[int]]]] = {}
        for sub in self.subs.values():
            plans[sub.name] = [sub.plan(sub.tables[r], self._lens[r], n_tokens) for r in ids]
            needed = sum(n for n, _ in plans[sub.name])
            released = sum(len(rel) for _, rel in plans[sub.name])
            if needed - released > len(sub.free):
                raise PoolExhaustedError(
                    sub_pool=sub.name, pages_requested=needed, pages_free=len(sub.free) + released
                )
        out = {}
        for sub in self.subs.values():
            for rid, (_, release) in zip(ids, plans[sub.name], strict=True):
                table = sub.tables[rid]
                for j in release:
                    sub.free.append(table[j])
                    table[j] = 0
            rows = []
            for rid, (needed, _) in zip(ids, plans[sub.name], strict=True):
                table = sub.tables[rid]
                for _ in range(needed):
                    table.append(sub.free.pop())
                seq = self._lens[rid]
                rows.append([self._slot(sub, table, p) for p in range(seq, seq + n_tokens)])
            out[sub.name] = mx.array(rows, dtype=mx.int32).reshape(len(ids), n_tokens)
        for rid in ids:
            self._lens[rid] += n_tokens
        return out

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
        width = max(1, max(len(t) for t in tables))
        return mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)

    def batch_slots(
        self, request_ids: Sequence[int], sub_pool: str, positions: Sequence[int]
    ) -> mx.array:
        """``(B,)`` slots of ``positions[b]`` of each request."""
        sub = self.subs[sub_pool]
        return mx.array(
            [
                self._slot(sub, sub.tables[r], p)
                for r, p in zip(request_ids, positions, strict=True)
            ],
            dtype=mx.int32,
        )

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

    def can_reserve(self, demands: dict[int, int]) -> bool:
        """True if the demands fit in the capacity beside what is held."""
        if self.capacity is None:
            return True
        return sum(self.lengths.values()) + sum(demands.values()) <= self.capacity
