"""The pool's tensors.

Each layer's K and V buffers, reads and writes by slot, and which slot arrays are trusted
without a host read.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from kv_protocol import (
    CacheLayout,
    CacheStateError,
    KVBuffer,
    LayerTransferCounter,
    QuantizedKV,
    RequestStateError,
    ShapeMismatchError,
    SlotWriter,
    gather_slots,
    stored_arrays,
)

from ._allocator import PageAllocator
from ._sizing import SubPoolSpec

__all__ = ["KVStorage", "int32_array"]

#: How many slot arrays the storage remembers (FIFO): a decode step issues one per sub-pool,
#: a prefill chunk two per layer. A remembered array is trusted while its pages keep their
#: owners and refused after; an older one is checked on the host like any foreign array.
_KNOWN_SLOTS = 1024


def int32_array(buffer: array[int] | memoryview) -> mx.array:
    """An int32 ``mx.array`` copied from an ``array('i')`` (or a shaped view of one)."""
    # mlx reads objects with the buffer protocol; its stubs do not declare that.
    return mx.array(cast(Any, buffer))


class _Issued:
    """A slot array the storage vouches for, with the pages it addresses and their generations.

    The trust lasts while every page is still at the generation it had at issue (no owner let
    go of any of them in between); ``epoch`` (the allocator's drop count when last confirmed)
    lets the common case skip the per-page comparison.
    """

    __slots__ = ("array", "epoch", "generations", "index", "pages")

    def __init__(
        self, array: mx.array, index: int, pages: list[int], generations: list[int], epoch: int
    ) -> None:
        self.array = array
        self.index = index
        self.pages = pages
        self.generations = generations
        self.epoch = epoch


def _zeros(spec: SubPoolSpec, shape: tuple[int, int, int]) -> KVBuffer:
    """A zeroed (lazy) layer buffer of ``spec``: plain, or quantized when the sub-pool is."""
    if spec.quantization is None:
        return mx.zeros(shape, dtype=spec.geometry.dtype)
    return spec.quantization.zeros(shape, spec.geometry.dtype)


def _scatter(
    buffer: KVBuffer, slots: mx.array, rows: mx.array, writer: SlotWriter | None = None
) -> None:
    """Write token-major ``rows (T, H, D)`` at ``slots`` of a head-major buffer, in place.

    A plain buffer goes to ``writer`` first (where it serves the call).
    """
    if isinstance(buffer, QuantizedKV):
        stored = buffer.quantization.quantize(rows.transpose(1, 0, 2))
        for dst, src in zip(buffer.arrays, stored.arrays, strict=True):
            dst[:, slots] = src
    elif writer is None or not writer(buffer, slots, rows):
        buffer[:, slots] = rows.transpose(1, 0, 2)


def _read(buffer: KVBuffer, slots: mx.array) -> mx.array:
    """Rows ``slots`` of a head-major buffer as token-major ``(T, H, D)`` values."""
    return gather_slots(buffer, slots).transpose(1, 0, 2)


class KVStorage:
    """K/V buffers of every attention layer, grouped by sub-pool, addressed by slot.

    Each layer's buffers are head-major, ``(n_kv_heads, committed * page_size, head_dim)``
    (V with its own width); slot ``page * page_size + i`` holds position ``i`` of a page and
    page 0 is the null page. ``committed[i]`` (default: all of sub-pool ``i``'s pages) is how
    many pages its buffers hold now: :meth:`resize` grows or cuts them at the end, so a page's
    slots never move. A quantized sub-pool's buffers are :class:`kv_protocol.QuantizedKV`
    of that logical shape (packed data, scales and biases, each slot-addressed the same way).
    ``allocators[i]`` is sub-pool ``i``'s page allocator: its page
    generations end the trust of slot arrays whose pages lost an owner. ``slot_writer``
    gets ``set_kv``'s plain buffers first.
    """

    def __init__(
        self,
        layout: CacheLayout,
        specs: Sequence[SubPoolSpec],
        allocators: Sequence[PageAllocator],
        committed: Sequence[int] | None = None,
        slot_writer: SlotWriter | None = None,
    ) -> None:
        self._layout = layout
        self.slot_writer = slot_writer
        self._specs = tuple(specs)
        self._allocators = tuple(allocators)
        self._committed = (
            [s.num_pages for s in self._specs] if committed is None else list(committed)
        )
        self.keys: list[list[KVBuffer]] = []
        self.values: list[list[KVBuffer]] = []
        # attention index -> (sub-pool index, layer index inside the sub-pool)
        self._by_attention: list[tuple[int, int]] = [(-1, -1)] * len(layout.attention_layer_ids)
        for index, spec in enumerate(self._specs):
            g = spec.geometry
            slots = self._committed[index] * spec.page_size
            key_shape = (g.n_kv_heads, slots, g.head_dim)
            value_shape = (g.n_kv_heads, slots, g.value_dim)
            # mx.zeros is lazy: memory is committed when a buffer is first evaluated.
            self.keys.append([_zeros(spec, key_shape) for _ in spec.layer_ids])
            self.values.append([_zeros(spec, value_shape) for _ in spec.layer_ids])
            for local, layer_id in enumerate(spec.layer_ids):
                self._by_attention[layout.attention_index(layer_id)] = (index, local)
        self._counter: LayerTransferCounter | None = None
        # id -> issue record of the slot arrays known valid for writes in one sub-pool
        # (issued here or checked once); holding the arrays keeps their ids from being
        # reused while they are listed.
        self._known_slots: dict[int, _Issued] = {}

    # ------------------------------------------------------------------ addressing

    def entry(self, layer_id: int) -> tuple[int, int]:
        """``(sub-pool index, layer index inside it)`` of an attention layer.

        The layout's exact error for a STATE or unknown id.
        """
        return self._by_attention[self._layout.attention_index(layer_id)]

    def spec_of(self, layer_id: int) -> SubPoolSpec:
        """The spec of the sub-pool storing ``layer_id``."""
        return self._specs[self.entry(layer_id)[0]]

    def committed(self, index: int) -> int:
        """Pages sub-pool ``index``'s buffers hold now (the null page included)."""
        return self._committed[index]

    def resize(self, index: int, pages: int) -> None:
        """Make sub-pool ``index``'s buffers hold ``pages`` pages, growing or cutting the end.

        Growing appends zeroed pages; cutting keeps pages ``0 .. pages - 1`` (the caller
        checks that nobody holds a page past them). One buffer at a time is copied and
        evaluated, and its old copy let go, so the memory in flight beyond the new size is
        one layer's buffer, never the sub-pool's.
        """
        spec = self._specs[index]
        old = self._committed[index]
        if pages == old:
            return
        size = spec.page_size
        extra = (pages - old) * size

        def resized(array: mx.array) -> mx.array:
            if extra < 0:
                return mx.contiguous(array[:, : pages * size])
            tail = mx.zeros((array.shape[0], extra, *array.shape[2:]), dtype=array.dtype)
            return mx.concatenate([array, tail], axis=1)

        for buffers in (self.keys[index], self.values[index]):
            for local, buffer in enumerate(buffers):
                new = buffer.map(resized) if isinstance(buffer, QuantizedKV) else resized(buffer)
                mx.eval(*stored_arrays(new))
                buffers[local] = new
                del buffer
        self._committed[index] = pages
        mx.clear_cache()

    # ------------------------------------------------------------------ transfers

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        """Make buffer accessors wait on ``counter`` for their global layer id (``None``: stop)."""
        self._counter = counter

    @property
    def layer_transfer_counter(self) -> LayerTransferCounter | None:
        """The registered layer transfer counter, if any."""
        return self._counter

    def _wait(self, layer_id: int) -> None:
        if self._counter is not None:
            self._counter.wait_until(layer_id)

    # ------------------------------------------------------------------ buffers

    def get_key_buffer(self, layer_id: int, *, wait: bool = True) -> KVBuffer:
        """The layer's key buffer; waits for its transfer unless ``wait=False``."""
        index, local = self.entry(layer_id)
        if wait:
            self._wait(layer_id)
        return self.keys[index][local]

    def get_value_buffer(self, layer_id: int, *, wait: bool = True) -> KVBuffer:
        """The layer's value buffer (same waiting rule as :meth:`get_key_buffer`)."""
        index, local = self.entry(layer_id)
        if wait:
            self._wait(layer_id)
        return self.values[index][local]

    def replace_buffers(self, layer_id: int, keys: mx.array, values: mx.array) -> None:
        """Rebind the layer's buffers to arrays a kernel produced (same shape and dtype)."""
        index, local = self.entry(layer_id)
        spec = self._specs[index]
        if spec.quantization is not None:
            raise CacheStateError(
                f"replace_buffers({layer_id}): sub-pool {spec.name!r} stores "
                f"{spec.quantization.bits}-bit quantized pages, which only set_kv writes; a "
                "kernel cannot hand back plain buffers for it"
            )
        for name, new, old in (
            ("keys", keys, self.keys[index][local]),
            ("values", values, self.values[index][local]),
        ):
            if not isinstance(new, mx.array) or new.shape != old.shape or new.dtype != old.dtype:
                got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, mx.array) else repr(new)
                raise ShapeMismatchError(
                    f"replace_buffers({layer_id}): {name} must be {tuple(old.shape)} "
                    f"{old.dtype}, got {got}"
                )
        self.keys[index][local] = keys
        self.values[index][local] = values

    def copy_tokens(self, copies: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy tokens between slots in every layer of a sub-pool (a fork's tail page).

        Each entry is ``(index, src, dst, n)``: ``n`` tokens from slot ``src`` to ``dst`` in
        sub-pool ``index``.
        """
        if not copies:
            return
        # Materialise the sources first: a write whose source is a lazy read of the same
        # buffer cannot be done in place and would copy the whole buffer.
        # Quantized buffers copy their stored arrays as they are (no requantization).
        targets = [
            [a for buf in (*self.keys[index], *self.values[index]) for a in stored_arrays(buf)]
            for index, _, _, _ in copies
        ]
        sources = [
            [mx.contiguous(a[:, src : src + n]) for a in arrays]
            for arrays, (_, src, _, n) in zip(targets, copies, strict=True)
        ]
        mx.eval(*[a for arrays in sources for a in arrays])
        for arrays, parts, (_, _, dst, n) in zip(targets, sources, copies, strict=True):
            for target, part in zip(arrays, parts, strict=True):
                target[:, dst : dst + n] = part

    # ------------------------------------------------------------------ trusted slots

    def issue(self, slots: mx.array, index: int, pages: list[int]) -> mx.array:
        """Remember ``slots`` (distinct, in range of sub-pool ``index``) as valid; return it.

        ``pages`` are the physical pages the slots lie in: the trust ends as soon as an owner
        lets go of one of them (the request is freed or trimmed, or the page leaves its
        window).
        """
        allocator = self._allocators[index]
        known = self._known_slots
        known[id(slots)] = _Issued(
            slots, index, pages, allocator.generations(pages), allocator.drops_total
        )
        if len(known) > _KNOWN_SLOTS:
            del known[next(iter(known))]
        return slots

    def _still_owned(self, record: _Issued) -> bool:
        """True while no owner has let go of a page of an issued slot array."""
        allocator = self._allocators[record.index]
        released = allocator.drops_total
        if released == record.epoch:
            return True
        if allocator.generations(record.pages) != record.generations:
            return False
        record.epoch = released
        return True

    @staticmethod
    def _check_slots(layer_id: int, slots: mx.array) -> int:
        """Check the rank and dtype of ``slots``; return ``T``."""
        if not isinstance(slots, mx.array) or slots.ndim != 1:
            got = f"shape {tuple(slots.shape)}" if isinstance(slots, mx.array) else repr(slots)
            raise ShapeMismatchError(f"layer {layer_id}: slots must be a 1-D mx.array, got {got}")
        if slots.dtype != mx.int32:
            raise ShapeMismatchError(
                f"layer {layer_id}: slots must have the integer dtype int32, got {slots.dtype}"
            )
        return int(slots.shape[0])

    def _trust_slots(self, layer_id: int, slots: mx.array, *, write: bool) -> None:
        """Check the values of ``slots`` for a read (``write=False``) or write of the layer.

        Arrays this storage issued (or already checked for a write) are trusted by identity,
        so the decode path needs no device read; any other array is read on the host once.
        """
        index = self.entry(layer_id)[0]
        known = self._known_slots.get(id(slots))
        if known is None or known.array is not slots or known.index != index:
            values = self._check_slot_values(layer_id, slots, write=write)
            if write:
                size = self._specs[index].page_size
                self.issue(slots, index, sorted({v // size for v in values}))
            return
        if not self._still_owned(known):
            raise CacheStateError(
                f"layer {layer_id}: this slot array was issued for pages of sub-pool "
                f"{self._specs[index].name!r} that have been freed since (the request finished, "
                "was trimmed, or the pages left its window) and may belong to another request "
                "now; ask the pool for the request's current slots"
            )

    def _check_slot_values(self, layer_id: int, slots: mx.array, *, write: bool) -> list[int]:
        """Read ``slots`` on the host: in range, outside the null page, distinct for a write."""
        index = self.entry(layer_id)[0]
        spec = self._specs[index]
        num_slots = self._committed[index] * spec.page_size
        values = cast(list[int], slots.tolist())
        if not values:
            return values
        low, high = min(values), max(values)
        if low < spec.page_size or high >= num_slots:
            bad = low if low < spec.page_size else high
            where = "in the null page 0" if 0 <= bad < spec.page_size else "out of range"
            raise RequestStateError(
                f"layer {layer_id}: slot {bad} is {where}; slots of sub-pool {spec.name!r} "
                f"must be in {spec.page_size}..{num_slots - 1} (page 0 is the null page)"
            )
        if write and len(set(values)) != len(values):
            seen: set[int] = set()
            dup = values[0]
            for dup in values:
                if dup in seen:
                    break
                seen.add(dup)
            raise RequestStateError(
                f"layer {layer_id}: slot {dup} appears more than once in one write; the slots "
                "of one set_kv must be distinct (the order of a repeated write is undefined)"
            )
        return values

    # ------------------------------------------------------------------ reads and writes

    def set_kv(
        self,
        layer_id: int,
        slots: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        wait: bool = True,
    ) -> None:
        """Write token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        See :meth:`kv_pool.HybridKVPool.set_kv`.
        """
        index, local = self.entry(layer_id)
        t = self._check_slots(layer_id, slots)
        g = self._specs[index].geometry
        for name, arr, dim in (("keys", keys, "head_dim"), ("values", values, "v_head_dim")):
            want = (t, g.n_kv_heads, g.head_dim if name == "keys" else g.value_dim)
            if not isinstance(arr, mx.array) or tuple(arr.shape) != want or arr.dtype != g.dtype:
                got = f"{tuple(arr.shape)} {arr.dtype}" if isinstance(arr, mx.array) else repr(arr)
                raise ShapeMismatchError(
                    f"set_kv(layer {layer_id}): {name} must be (T, n_kv_heads, {dim}) = "
                    f"{want} {g.dtype}, got {got}"
                )
        self._trust_slots(layer_id, slots, write=True)
        if wait:
            self._wait(layer_id)
        _scatter(self.keys[index][local], slots, keys, self.slot_writer)
        _scatter(self.values[index][local], slots, values, self.slot_writer)

    def get_kv(self, layer_id: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Read token-major ``(T, n_kv_heads, head_dim)`` keys/values at ``slots (T,)``.

        A quantized layer's tokens come back dequantized, in the model's dtype.
        """
        index, local = self.entry(layer_id)
        self._check_slots(layer_id, slots)
        self._trust_slots(layer_id, slots, write=False)
        self._wait(layer_id)
        return _read(self.keys[index][local], slots), _read(self.values[index][local], slots)
