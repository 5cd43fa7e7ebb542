"""Writing token rows into head-major, slot-addressed pools, in place where MLX can."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import mlx.core as mx

from kv_protocol import RequestStateError, as_int

from ._memo import IdentityMemo

__all__ = ["ScatterPlan", "memoized_plan_scatter", "plan_scatter", "scatter_token_rows"]


@dataclass(frozen=True)
class ScatterPlan:
    """Which tokens are written where: ``tokens[i]`` goes to pool column ``slots[i]``."""

    num_tokens: int
    tokens: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def writes_all(self) -> bool:
        """True when every token is written, in order (no row selection needed)."""
        return len(self.tokens) == self.num_tokens

    @cached_property
    def token_index(self) -> mx.array:
        """``tokens`` as an int32 array, built once per plan."""
        return mx.array(self.tokens, dtype=mx.int32)

    @cached_property
    def slot_index(self) -> mx.array:
        """``slots`` as an int32 ``(1, n, 1)`` index for the pool's slot axis, built once."""
        return mx.array(self.slots, dtype=mx.int32)[None, :, None]


def plan_scatter(slots: mx.array | Sequence[int], num_slots: int) -> ScatterPlan:
    """Read the ``(T,)`` slots on the host and check them; negative slots are skipped.

    Slots are tiny and normally built from host data (a pool's slot queries), so reading
    them costs nothing; only slots computed lazily on a device make this wait for them.
    A slot ``>= num_slots``, two tokens writing one slot, or (in a plain sequence) a slot
    that is not an int raise :class:`kv_protocol.RequestStateError` before anything is
    written, the error ``HybridKVPool.set_kv`` raises for the same slot values.
    """
    values = cast(list[object], slots.tolist()) if isinstance(slots, mx.array) else list(slots)
    tokens: list[int] = []
    targets: list[int] = []
    seen: set[int] = set()
    for t, value in enumerate(values):
        slot = as_int(value)
        if slot is None:
            raise RequestStateError(
                f"slot {value!r} of token {t} is not an int; expected a negative slot (skip) "
                f"or 0 .. {num_slots - 1}"
            )
        if slot < 0:
            continue
        if slot >= num_slots:
            raise RequestStateError(
                f"slot {slot} of token {t} is past the end of the pool "
                f"(num_slots={num_slots}); expected a negative slot (skip) or "
                f"0 .. {num_slots - 1}"
            )
        if slot in seen:
            raise RequestStateError(f"two tokens write the same pool slot {slot}")
        seen.add(slot)
        tokens.append(t)
        targets.append(slot)
    return ScatterPlan(num_tokens=len(values), tokens=tuple(tokens), slots=tuple(targets))


def memoized_plan_scatter(
    memo: IdentityMemo[ScatterPlan], slots: mx.array, num_slots: int
) -> ScatterPlan:
    """:func:`plan_scatter`, reused for the same ``slots`` array object and ``num_slots``.

    Every layer of a decode step passes one ``slots`` object per sub-pool, so the host read
    and the checks run once per step. A new array is always planned (and checked) afresh;
    bad slots raise and are never stored.
    """
    plan = memo.get(slots, num_slots)
    if plan is None:
        plan = plan_scatter(slots, num_slots)
        memo.put(slots, num_slots, plan)
    return plan


def scatter_token_rows(pool: mx.array, plan: ScatterPlan, rows: mx.array) -> mx.array:
    """Return ``pool (H, num_slots, D)`` with token-major ``rows (T, H, D)`` written per plan.

    Tokens the plan skips are not part of the scatter at all, so the pool's other columns
    keep their exact bits. The result is a new array in MLX's functional sense; MLX performs
    the scatter in place when ``pool`` is not referenced elsewhere once the graph runs (the
    caller rebinds its buffer to the result), so a decode step costs O(T), not O(pool).
    """
    if not plan.tokens:
        return pool
    rows = rows.astype(pool.dtype)
    if not plan.writes_all:
        rows = rows[plan.token_index]
    return mx.put_along_axis(pool, plan.slot_index, rows.swapaxes(0, 1), axis=1)
