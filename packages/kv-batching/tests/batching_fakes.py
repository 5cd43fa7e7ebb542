"""Small, obviously-correct fakes of the kernels and prefill cache for kv-batching tests.

Independent of kv-pool / kv-caches / kv-metal-kernels: gather + dense SDPA. The pool is the
shared ``kv_testing.ReferenceKVPool`` (plain-Python page tables), whose sliding sub-pool
releases pages that left every window, so the wrapper is tested against freed (null)
page-table entries too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from kv_batching import DecodePlan, DecodeRoute
from kv_batching._decode_paths import fuse_routes
from kv_batching._decode_step import DecodeStep, PoolAddressing
from kv_protocol import (
    KVLifetime,
    Reservation,
    RopeConfig,
)
from kv_testing import ReferenceKVPool


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


class CountingPrefillAttention:
    """A PrefillAttention: MLX's fused SDPA, counting its calls."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        self.calls += 1
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask, sinks=sinks
        )


@dataclass
class FakeKernels:
    """A KernelSet."""

    rope: Any = None
    attention: Any = None
    prefill_attention: Any = None

    def __post_init__(self) -> None:
        if self.attention is None:
            self.attention = FakeAttention()


class FakePrefillCache:
    """A per-request, per-layer mlx-lm cache view onto ReferenceKVPool (prefill / extend)."""

    def __init__(
        self, pool: ReferenceKVPool, request_id: int, layer_id: int, offset: int = 0
    ) -> None:
        self.pool = pool
        self.request_id = request_id
        self.layer_id = layer_id
        self.window = pool.layout.window(layer_id)
        self._offset = offset

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


def fake_prefill_cache(pool: Any, reservation: Reservation, layer_id: int) -> FakePrefillCache:
    """The make_prefill_cache factory for ReferenceKVPool: the chunk ``reservation`` holds."""
    assert isinstance(pool, ReferenceKVPool)
    return FakePrefillCache(
        pool, reservation.request_ids[0], layer_id, reservation.start_lengths[0]
    )


def decode_step(
    pool: ReferenceKVPool,
    request_ids: Sequence[int],
    kernels: FakeKernels,
    *,
    routes: dict[int, DecodeRoute] | None = None,
    model: Any = None,
) -> DecodeStep:
    """Reserve one token per request and build the decode step on that reservation.

    ``routes`` (default ``unfused``) give each attention layer its decode route; with a
    patched ``model`` instead, the routes are what the engine would choose for these kernels.
    """
    if model is not None:
        plan = DecodePlan(routes=dict.fromkeys(pool.layout.attention_layer_ids, "unfused"))
        routes = dict(fuse_routes(model, pool, kernels, plan).routes)
    reservation = pool.try_reserve_batch(dict.fromkeys(request_ids, 1))
    assert reservation is not None, "the pool has no room for the decode step"
    return DecodeStep.from_reservation(
        reservation, pool, kernels, PoolAddressing.from_pool(pool, routes)
    )
