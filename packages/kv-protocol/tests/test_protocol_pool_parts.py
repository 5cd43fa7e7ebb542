"""The pool protocol in three parts: a scheduler depends on the tensor-free bookkeeping only."""

from __future__ import annotations

import inspect
from typing import get_type_hints

from kv_protocol import (
    CacheLayout,
    KVBufferStorage,
    KVPageAddressing,
    KVPool,
    KVRequestBookkeeping,
    LayerKind,
    LayerSpec,
)


def members(protocol: type) -> set[str]:
    return {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def test_bookkeeping_takes_and_returns_no_array() -> None:
    for name in members(KVRequestBookkeeping):
        member = getattr(KVRequestBookkeeping, name)
        function = member.fget if isinstance(member, property) else member
        hints = get_type_hints(function, globalns=vars(inspect.getmodule(KVPool)))
        assert all("array" not in str(hint) for hint in hints.values()), (name, hints)


def test_the_parts_make_the_pool() -> None:
    parts = members(KVRequestBookkeeping) | members(KVPageAddressing) | members(KVBufferStorage)
    assert members(KVPool) <= parts
    assert {"reserve", "batch_page_table", "token_slots"} <= members(KVPageAddressing)
    assert {"set_kv", "get_kv", "get_key_buffer", "replace_buffers"} <= members(KVBufferStorage)
    assert not members(KVRequestBookkeeping) & members(KVBufferStorage)


class LengthsOnly:
    """A scheduler's view of a pool: lengths and room, no tensors."""

    def __init__(self) -> None:
        self.lengths: dict[int, int] = {}

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout([LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2)])

    def add_request(self, request_id: int) -> None:
        self.lengths[request_id] = 0

    def free_request(self, request_id: int) -> None:
        del self.lengths[request_id]

    def has_request(self, request_id: int) -> bool:
        return request_id in self.lengths

    def seq_len(self, request_id: int) -> int:
        return self.lengths[request_id]

    def trim_request(self, request_id: int, n_tokens: int) -> None:
        self.lengths[request_id] -= n_tokens

    def can_reserve(self, demands: dict[int, int]) -> bool:
        return True


def test_a_tensor_free_book_is_bookkeeping_but_not_a_pool() -> None:
    book = LengthsOnly()
    assert isinstance(book, KVRequestBookkeeping)
    assert not isinstance(book, KVPageAddressing) and not isinstance(book, KVPool)
    assert not isinstance(book, KVBufferStorage)
