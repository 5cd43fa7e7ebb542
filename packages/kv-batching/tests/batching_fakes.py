"""Small, obviously-correct fakes of the pool, kernels and prefill cache for kv-batching tests.

Independent of kv-pool / kv-caches / kv-metal-kernels: plain Python bookkeeping plus
gather + dense SDPA. The sliding sub-pool releases pages that left every window, so the
wrapper is tested against freed (null) page-table entries too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from kv_protocol import (
    CacheLayout,
    KVLifetime,
    LayerKind,
    PoolExhaustedError,
    RequestStateError,
    RopeConfig,
    UnknownRequestError,
)


class _SubPool:
    def __init__(self, name: str, page_size: int, num_pages: int, window: int | None) -> None:
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self.window = window
        self.free: list[int] = list(range(num_pages - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}

    def first_visible(self, seq_len: int) -> int:
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


class FakePagedPool:
    """A KVPool with a 'full' and a 'sliding' sub-pool, head-major per-layer buffers."""

    def __init__(
        self,
        layout: CacheLayout,
        *,
        num_pages: int = 64,
        page_size: int = 4,
        sliding_num_pages: int | None = None,
        sliding_page_size: int | None = None,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
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
            shape = (geo.n_kv_heads, sub.num_pages * sub.page_size, geo.head_dim)
            self._keys[layer_id] = mx.zeros(shape, dtype=dtype)
            self._values[layer_id] = mx.zeros(shape, dtype=dtype)
        self._lens: dict[int, int] = {}
        self.set_kv_calls = 0
        self.reserve_batch_calls = 0
        self.replace_calls = 0

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        return self._layout

    def free_pages(self) -> dict[str, int]:
        return {name: len(sub.free) for name, sub in self.subs.items()}

    def pages_in_use(self) -> dict[str, int]:
        return {name: sub.num_pages - 1 - len(sub.free) for name, sub in self.subs.items()}

    def add_request(self, request_id: int) -> None:
        assert request_id not in self._lens, request_id
        self._lens[request_id] = 0
        for sub in self.subs.values():
            sub.tables[request_id] = []

    def _check(self, request_id: int) -> None:
        if request_id not in self._lens:
            raise UnknownRequestError(f"unknown request {request_id}")

    def free_request(self, request_id: int) -> None:
        self._check(request_id)
        for sub in self.subs.values():
            sub.free.extend(p for p in sub.tables.pop(request_id) if p != 0)
        del self._lens[request_id]

    def has_request(self, request_id: int) -> bool:
        return request_id in self._lens

    def seq_len(self, request_id: int) -> int:
        self._check(request_id)
        return self._lens[request_id]

    def can_reserve(self, demands: dict[int, int]) -> bool:
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
        self._check(request_id)
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
            raise ValueError(f"position {position} was released from sub-pool {sub.name}")
        return page * sub.page_size + position % sub.page_size

    def sub_pool_of(self, layer_id: int) -> str:
        kind = self._layout.kind(layer_id)
        if kind is LayerKind.FULL:
            return "full"
        if kind is LayerKind.SLIDING:
            return "sliding"
        raise ValueError(f"{layer_id=} not in attention layers")

    def page_size(self, layer_id: int) -> int:
        return self.subs[self.sub_pool_of(layer_id)].page_size

    def token_slots(self, request_id: int, layer_id: int, start: int, stop: int) -> mx.array:
        self._check(request_id)
        assert 0 <= start <= stop <= self._lens[request_id]
        sub = self.subs[self.sub_pool_of(layer_id)]
        table = sub.tables[request_id]
        return mx.array([self._slot(sub, table, p) for p in range(start, stop)], dtype=mx.int32)

    def batch_page_table(self, request_ids: Sequence[int], sub_pool: str) -> mx.array:
        sub = self.subs[sub_pool]
        tables = [sub.tables[r] for r in request_ids]
        width = max(1, max(len(t) for t in tables))
        return mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)

    def batch_slots(
        self, request_ids: Sequence[int], sub_pool: str, positions: Sequence[int]
    ) -> mx.array:
        sub = self.subs[sub_pool]
        return mx.array(
            [
                self._slot(sub, sub.tables[r], p)
                for r, p in zip(request_ids, positions, strict=True)
            ],
            dtype=mx.int32,
        )

    def get_key_buffer(self, layer_id: int) -> mx.array:
        return self._keys[layer_id]

    def get_value_buffer(self, layer_id: int) -> mx.array:
        return self._values[layer_id]

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        assert keys.shape == self._keys[layer_id].shape
        self.replace_calls += 1
        self._keys[layer_id] = keys
        self._values[layer_id] = values

    def set_kv(self, layer_id: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        self.set_kv_calls += 1
        k = self._keys[layer_id]
        v = self._values[layer_id]
        k[:, slots, :] = keys.transpose(1, 0, 2).astype(k.dtype)
        v[:, slots, :] = values.transpose(1, 0, 2).astype(v.dtype)
        self._keys[layer_id] = k
        self._values[layer_id] = v

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        return (
            self._keys[layer_id][:, slots, :].transpose(1, 0, 2),
            self._values[layer_id][:, slots, :].transpose(1, 0, 2),
        )


class FakeAttention:
    """Gather every page of each request, mask by length and window, dense SDPA."""

    name = "fake-gather"

    def __init__(self) -> None:
        self.calls = 0
        self.windows: list[int | None] = []

    def __call__(
        self,
        q: mx.array,
        k_pool: mx.array,
        v_pool: mx.array,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        self.calls += 1
        self.windows.append(window)
        batch, pages = page_table.shape
        slots = (page_table[:, :, None] * page_size + mx.arange(page_size)[None, None, :]).reshape(
            batch, pages * page_size
        )
        keys = k_pool[:, slots, :].transpose(1, 0, 2, 3)
        values = v_pool[:, slots, :].transpose(1, 0, 2, 3)
        pos = mx.arange(pages * page_size)[None, :]
        keep = pos < seq_lens[:, None]
        if window is not None:
            keep = keep & (pos >= seq_lens[:, None] - window)
        mask = keep[:, None, None, :]
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask, sinks=sinks
        )


class FakeRope:
    """Reference fused RoPE + scatter: mx.fast.rope per row, then a scatter into the pools."""

    name = "fake-rope"

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls = 0

    def supports(self, rope: RopeConfig) -> bool:
        return not self.refuse

    def __call__(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        positions: mx.array,
        slots: mx.array,
        k_pool: mx.array,
        v_pool: mx.array,
        *,
        rope: RopeConfig,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        self.calls += 1

        def rot(x: mx.array) -> mx.array:
            return mx.fast.rope(
                x[:, :, None, :],
                rope.dims,
                traditional=rope.traditional,
                base=rope.base,
                scale=rope.scale,
                offset=positions,
            )[:, :, 0, :]

        q_rot, k_rot = rot(q), rot(k)
        k_new = mx.array(k_pool)
        v_new = mx.array(v_pool)
        k_new[:, slots, :] = k_rot.transpose(1, 0, 2)
        v_new[:, slots, :] = v.transpose(1, 0, 2)
        return q_rot, k_rot, k_new, v_new


@dataclass
class FakeKernels:
    """A KernelSet."""

    rope: Any = None
    attention: Any = None

    def __post_init__(self) -> None:
        if self.attention is None:
            self.attention = FakeAttention()


class FakePrefillCache:
    """A per-request, per-layer mlx-lm cache view onto FakePagedPool (prefill / extend)."""

    def __init__(self, pool: FakePagedPool, request_id: int, layer_id: int) -> None:
        self.pool = pool
        self.request_id = request_id
        self.layer_id = layer_id
        self.window = pool.layout.window(layer_id)
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def state(self) -> tuple[()]:
        return ()

    def _kept(self) -> int:
        return KVLifetime(self.window).kept_before(self._offset)

    def make_mask(
        self, N: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        kept = self._kept()
        if window_size is not None and kept + N > window_size:
            return create_causal_mask(N, kept, window_size=window_size)
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, kept)
        return "causal"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        start, stop = self._offset, self._offset + n
        have = self.pool.seq_len(self.request_id)
        if have < stop:
            self.pool.reserve(self.request_id, stop - have)
        slots = self.pool.token_slots(self.request_id, self.layer_id, start, stop)
        self.pool.set_kv(
            self.layer_id, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2)
        )
        lo = start - self._kept()
        every = self.pool.token_slots(self.request_id, self.layer_id, lo, stop)
        k, v = self.pool.get_kv(self.layer_id, every)
        self._offset = stop
        return k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0

    def empty(self) -> bool:
        return self._offset == 0


def fake_prefill_cache(pool: Any, request_id: int, layer_id: int) -> FakePrefillCache:
    """The make_prefill_cache factory for FakePagedPool."""
    assert isinstance(pool, FakePagedPool)
    return FakePrefillCache(pool, request_id, layer_id)


def mlx_lm_greedy(model: Any, prompt: Sequence[int], max_tokens: int, chunk: int = 0) -> list[int]:
    """mlx-lm generating ``prompt`` alone with its own make_prompt_cache, greedy."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = list(prompt)
    step = chunk or len(tokens)
    logits = None
    for start in range(0, len(tokens), step):
        logits = model(mx.array(tokens[start : start + step])[None], cache=cache)
    assert logits is not None
    out: list[int] = []
    token = int(mx.argmax(logits[0, -1]))
    while True:
        out.append(token)
        if len(out) == max_tokens:
            return out
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]))
