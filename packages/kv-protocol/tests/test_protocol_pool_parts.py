"""The pool protocol in three parts: a scheduler depends on the tensor-free bookkeeping only."""

from __future__ import annotations

import inspect
from typing import get_type_hints

from kv_protocol import (
    CacheLayout,
    KVBufferStorage,
    KVPageAddressing,
    KVPool,
    KVPoolStats,
    KVRequestBookkeeping,
    LayerKind,
    LayerSpec,
)
from kv_testing import ReferenceBookkeeping


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
    parts = (
        members(KVRequestBookkeeping)
        | members(KVPageAddressing)
        | members(KVBufferStorage)
        | members(KVPoolStats)
    )
    assert members(KVPool) == {"prefix_cache"}  # the one member of its own
    assert {"try_reserve_batch", "rollback", "seq_len"} <= members(KVRequestBookkeeping)
    assert not {"can_reserve", "reserve_batch"} & parts  # one reservation call per step
    assert {"reserve", "token_slots"} <= members(KVPageAddressing)
    assert members(KVPoolStats) == {"memory_report"}
    assert {"set_kv", "get_kv", "get_key_buffer", "replace_buffers"} <= members(KVBufferStorage)
    assert not members(KVRequestBookkeeping) & members(KVBufferStorage)


def test_a_tensor_free_book_is_bookkeeping_but_not_a_pool() -> None:
    book = ReferenceBookkeeping(
        CacheLayout([LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=1, head_dim=2)])
    )
    assert isinstance(book, KVRequestBookkeeping)
    assert not isinstance(book, KVPageAddressing) and not isinstance(book, KVPool)
    assert not isinstance(book, KVBufferStorage)
