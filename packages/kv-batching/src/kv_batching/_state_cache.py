"""Recurrent state of STATE layers (linear attention, SSM, convolution) beside the pool.

A STATE layer keeps a fixed-size state per request instead of K/V, in the model's own
cache object (mlx-lm's ``ArraysCache`` / ``MambaCache``: indexable slots of arrays, ``None``
until the first token). The engine keeps one such object per request and STATE layer,
created from the model's ``make_cache()``, advanced in place by prefill chunks, stacked
along the batch axis into a :class:`StackedStateCache` for a batched decode step and split
back into the rows after it. Nothing here imports mlx-lm: the caches are read through the
indexing protocol the models themselves use.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mlx.core as mx

from kv_protocol import CacheLayout, CacheStateError, UnsupportedModelError, flatten_caches

__all__ = [
    "StackedStateCache",
    "copy_state_caches",
    "install_stacked_states",
    "request_caches",
    "StateCacheFactory",
    "group_by_state_shapes",
    "model_state_caches",
    "request_state_bytes",
    "state_nbytes",
    "state_shapes",
]

T = TypeVar("T")

#: ``factory()`` -> fresh per-request caches, one per STATE layer, in layer order.
StateCacheFactory = Callable[[], list[Any]]


def model_state_caches(model: object, layout: CacheLayout) -> StateCacheFactory:
    """A factory of fresh state caches for ``layout``'s STATE layers from ``model.make_cache()``.

    Raises ``UnsupportedModelError`` when the model has STATE layers but no ``make_cache``,
    or when its caches cannot be indexed the way a recurrent layer reads its state.
    """
    state_ids = list(layout.state_layer_ids)
    make_cache = getattr(model, "make_cache", None)
    if not callable(make_cache):
        raise UnsupportedModelError(
            f"{type(model).__name__} has STATE layers {state_ids} but no make_cache(); the "
            "engine takes each request's recurrent state caches from it"
        )

    def factory() -> list[Any]:
        caches = flatten_caches(list(make_cache()))
        return [caches[i] for i in state_ids]

    for layer_id, cache in zip(state_ids, factory(), strict=True):
        slots = getattr(cache, "cache", None)
        if not isinstance(slots, list):
            raise UnsupportedModelError(
                f"layer {layer_id}: the state cache {type(cache).__name__} keeps no list of "
                "state arrays (.cache), so its rows cannot be stacked for a batched step"
            )
    return factory


def request_state_bytes(model: object, layout: CacheLayout) -> int:
    """Bytes of one request's recurrent state, measured after a one-token forward.

    The model runs one token on a fresh ``make_cache()`` list (its own caches, no pool) and
    the state arrays of ``layout``'s STATE layers are counted. Most recurrent states have a
    fixed size (convolution windows, SSM and linear-attention states); one that grows with
    the text is measured at one token, and the engine keeps the largest it sees afterwards.
    0 when the model has no STATE layer.
    """
    state_ids = list(layout.state_layer_ids)
    if not state_ids:
        return 0
    make_cache = getattr(model, "make_cache", None)
    if not callable(make_cache):
        raise UnsupportedModelError(
            f"{type(model).__name__} has STATE layers {state_ids} but no make_cache()"
        )
    caches = list(make_cache())
    forward: Any = model
    mx.eval(forward(mx.array([[0]], dtype=mx.int32), cache=caches))
    flat = flatten_caches(caches)
    return state_nbytes([flat[i] for i in state_ids])


def request_caches(
    num_layers: int,
    state_layer_ids: Sequence[int],
    states: Sequence[Any],
    attention_cache: Callable[[int], Any],
) -> list[Any]:
    """One request's per-layer cache list.

    Its own state cache on STATE layers, ``attention_cache(layer_id)`` on every other layer.
    """
    by_layer = dict(zip(state_layer_ids, states, strict=True))
    return [
        by_layer[layer_id] if layer_id in by_layer else attention_cache(layer_id)
        for layer_id in range(num_layers)
    ]


def install_stacked_states(
    caches: list[Any], state_layer_ids: Sequence[int], rows: Sequence[Sequence[Any]]
) -> list[StackedStateCache]:
    """Put each STATE layer's rows, stacked, into ``caches`` for one batched step.

    ``rows[b][k]`` is row ``b``'s cache of the ``k``-th STATE layer. ``caches`` gets each
    stacked cache's :attr:`~StackedStateCache.view` (of the model's own cache class); the
    stacked caches are returned so that the caller can split them back after the step.
    """
    stacked = [
        StackedStateCache(layer_id, [row[k] for row in rows])
        for k, layer_id in enumerate(state_layer_ids)
    ]
    for layer_id, state in zip(state_layer_ids, stacked, strict=True):
        caches[layer_id] = state.view
    return stacked


def state_shapes(caches: Sequence[Any]) -> tuple[tuple[tuple[int, ...] | None, ...], ...]:
    """The shape of every slot of every state cache, but the batch axis (``None``: unset)."""
    return tuple(
        tuple(
            tuple(slot.shape[1:]) if isinstance(slot, mx.array) else None
            for slot in getattr(cache, "cache", ())
        )
        for cache in caches
    )


def group_by_state_shapes(
    rows: Sequence[T], states_of: Callable[[T], Sequence[Any]]
) -> list[list[T]]:
    """``rows`` split into groups whose state caches stack (equal :func:`state_shapes`).

    Groups keep the rows' order, first-seen group first; one group when every row's state
    has the same shapes (the common case: a fixed-size recurrent state).
    """
    groups: dict[tuple[Any, ...], list[T]] = {}
    for row in rows:
        groups.setdefault(state_shapes(states_of(row)), []).append(row)
    return list(groups.values())


def state_nbytes(caches: Sequence[Any]) -> int:
    """Bytes of the state arrays the caches hold now."""
    return sum(
        int(array.nbytes)
        for cache in caches
        for array in getattr(cache, "cache", ())
        if isinstance(array, mx.array)
    )


def copy_state_caches(caches: Sequence[Any]) -> list[Any]:
    """Independent copies of a request's state caches (for a forked sequence).

    MLX arrays are immutable and a recurrent layer replaces its slots, so a shallow copy of
    each cache with its list attributes copied shares no state that either side changes.
    """
    copies = []
    for cache in caches:
        twin = copy.copy(cache)
        for name, value in vars(cache).items():
            if isinstance(value, list):
                setattr(twin, name, list(value))
        copies.append(twin)
    return copies


class StackedStateCache:
    """One STATE layer's cache for a batched decode step: the rows' states stacked.

    Reads and writes like mlx-lm's ``ArraysCache`` (``cache[i]``, ``cache[i] = x``,
    ``make_mask``, ``lengths`` / ``left_padding`` of ``None``: every row advances by the one
    token of the step, so no row is padded). :meth:`split` hands each row its slice of the
    new state after the step; until then the rows' own caches are untouched, so a step that
    raises leaves every request as it was.
    """

    def __init__(self, layer_id: int, rows: Sequence[Any]) -> None:
        if not rows:
            raise CacheStateError(f"layer {layer_id}: a batched state cache needs >= 1 row")
        sizes = {len(row.cache) for row in rows}
        if len(sizes) != 1:
            raise CacheStateError(
                f"layer {layer_id}: the rows' state caches have {sorted(sizes)} slots; "
                "expected the same number in every row"
            )
        self.layer_id = layer_id
        self.rows = list(rows)
        self.cache: list[mx.array | None] = []
        for slot in range(sizes.pop()):
            values = [row.cache[slot] for row in self.rows]
            present = [v is not None for v in values]
            if all(present):
                self.cache.append(mx.concatenate(values, axis=0))
            elif not any(present):
                self.cache.append(None)
            else:
                raise CacheStateError(
                    f"layer {layer_id}: state slot {slot} is set in some rows and empty in "
                    "others; every decoding request must have been prefilled"
                )
        self.left_padding: mx.array | None = None
        self.lengths: mx.array | None = None
        # What the model is handed: a shallow copy of the first row's cache, so it has the
        # model's own cache class (models test ``isinstance(cache, ArraysCache)`` before
        # they store a new state), holding the stacked slots and no padding.
        view = copy.copy(self.rows[0])
        view.cache = self.cache
        for name in ("left_padding", "lengths"):
            if hasattr(view, name):
                setattr(view, name, None)
        self.view: Any = view

    def __getitem__(self, index: int) -> mx.array | None:
        """The stacked state in ``index`` (``(B, ...)``), or ``None`` if never set."""
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        """Replace the stacked state in ``index`` (the layer's new state for every row)."""
        self.cache[index] = value

    @property
    def batch_size(self) -> int:
        """Rows in the step."""
        return len(self.rows)

    @property
    def state(self) -> list[mx.array | None]:
        """The stacked state slots."""
        return self.cache

    def empty(self) -> bool:
        """Whether no slot holds a state yet."""
        return all(c is None for c in self.cache)

    def make_mask(self, N: int) -> None:
        """No mask: every row of a decode step takes its one token."""
        return None

    def advance(self, N: int) -> None:
        """Nothing to advance: no row is padded."""

    def split(self) -> None:
        """Write each row's slice of the stacked state back into its own cache."""
        self.cache = list(self.view.cache)  # the model may have replaced the list itself
        for b, row in enumerate(self.rows):
            for slot, value in enumerate(self.cache):
                row.cache[slot] = None if value is None else value[b : b + 1]
