"""Recurrent layers on the ragged rows of a shared verification step.

In a shared decode step a request that verifies a proposal owns ``n > 1`` adjacent rows of
the step's ``(R, 1)`` tokens (its last token and the proposal). Attention reads each row at
its own position, but a recurrent layer has to run a request's ``n`` tokens in order from
its state. For such a step the module that reads and writes a STATE layer's cache (the
mixer: a gated delta net, a Mamba block, a short convolution) is called with the rows
regrouped per request as ``(B, L)``, right-padded, under mlx-lm's own padding contract for
batched prompts: a ``(B, L)`` mask of real tokens and the cache's ``lengths``, by which the
model's mixers take the convolution state at each request's last real token and leave the
recurrent state as the padding found it. The mixer's output goes back to the rows.

:class:`RaggedStateMixers` (a :class:`~kv_batching._model_surgery.ModelChange`) finds each
STATE layer's mixer by tracing a short forward in which every module records its calls (the
innermost module call handed the layer's cache; the same one at every access),
accepts only a mixer called as ``(x, cache)`` or ``(x, mask, cache)``, checks each one on a
probe (ragged rows against each request's tokens run alone, outputs and states) and swaps its
class for a subclass that runs the rows when the cache carries :data:`RAGGED_ROWS_ATTRIBUTE`:
right-padded in one call, or, where the probe finds the mixer does not keep mlx-lm's padding
contract or it takes no mask, one call per group of requests with as many rows. A model
where any of that fails keeps its mixers (the report says why): its requests verify by a
forward of their own.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import CacheStateError, flatten_caches

from ._attention_probe import _max_rel_err, _tolerance
from ._cache_nesting import CacheNesting
from ._model_surgery import ChangeReport
from ._speculative import MAX_SPECULATIVE_TOKENS
from ._state_cache import StackedStateCache, StateCacheFactory

__all__ = [
    "RAGGED_INPUTS_ATTRIBUTE",
    "RAGGED_ROWS_ATTRIBUTE",
    "RaggedRows",
    "RaggedStateMixers",
    "install_ragged_state_mixers",
]

logger = logging.getLogger(__name__)

#: The attribute of a step's stacked state cache (its model-class view) that holds the
#: step's :class:`RaggedRows`; a cache without it runs the mixer as the model calls it.
RAGGED_ROWS_ATTRIBUTE = "kv_ragged_rows"
#: The attribute under which a swapped mixer leaves the ``(R, 1, ...)`` input rows it ran,
#: so that a state can be advanced again through some of them without the rest of the model.
RAGGED_INPUTS_ATTRIBUTE = "kv_ragged_inputs"


@dataclass(frozen=True, kw_only=True, eq=False)
class RaggedRows:
    """A step's rows regrouped per request: request ``b`` owns ``counts[b]`` adjacent rows.

    ``index`` (``(B, L)``, ``L = max(counts)``) is the row each cell reads (a padding cell
    repeats the request's last row), ``mask`` (``(B, L)`` bool) the real cells, ``lengths``
    (``(B,)``) the counts, ``take`` (``(R,)``) the cell each row's output comes from.
    """

    counts: tuple[int, ...]
    index: mx.array
    mask: mx.array
    lengths: mx.array
    take: mx.array

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> RaggedRows:
        """The regrouping of requests with ``counts[b] >= 1`` rows each, in row order."""
        if not counts or any(n < 1 for n in counts):
            raise ValueError(f"every request needs at least one row, got counts {list(counts)}")
        width = max(counts)
        index: list[list[int]] = []
        take: list[int] = []
        first = 0
        for b, n in enumerate(counts):
            index.append([first + min(cell, n - 1) for cell in range(width)])
            take.extend(b * width + cell for cell in range(n))
            first += n
        lengths = mx.array(list(counts), dtype=mx.int32)
        return cls(
            counts=tuple(counts),
            index=mx.array(index, dtype=mx.int32),
            mask=mx.arange(width)[None, :] < lengths[:, None],
            lengths=lengths,
            take=mx.array(take, dtype=mx.int32),
        )

    def gather(self, rows: mx.array) -> mx.array:
        """``(R, 1, ...)`` step rows -> ``(B, L, ...)`` per request, right-padded."""
        return rows[:, 0][self.index]

    def scatter(self, cells: mx.array) -> mx.array:
        """``(B, L, ...)`` per request -> ``(R, 1, ...)`` step rows (padding dropped)."""
        flat = cells.reshape(-1, *cells.shape[2:])
        return flat[self.take][:, None]


class _Signature:
    """Where a mixer's call takes its input, mask and cache (by name and position)."""

    def __init__(self, cls: type) -> None:
        params = list(inspect.signature(cls.__call__).parameters.values())[1:]
        names = [p.name for p in params]
        kinds_ok = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        others = [n for n in names if n not in ("mask", "cache")]
        #: Called as ``(x, cache)`` or ``(x, mask, cache)`` in any order: nothing else that
        #: would have to follow the rows (an offset, a second per-token input).
        self.supported = kinds_ok and "cache" in names and len(others) == 1
        self.has_mask = "mask" in names
        self.input_name = others[0] if others else ""
        self.names = names

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name."""
        bound = dict(zip(self.names, args, strict=False))
        bound.update(kwargs)
        return bound

    def arguments(self, x: mx.array, mask: mx.array | None, cache: Any) -> list[Any]:
        """Positional arguments of a call with input ``x``, ``mask`` and ``cache``."""
        given = {self.input_name: x, "mask": mask, "cache": cache}
        return [given[name] for name in self.names]


#: How a swapped mixer runs a step's ragged rows: ``padded`` in one call on the rows
#: regrouped and right-padded (mlx-lm's padding contract); ``grouped`` one call per group of
#: requests with the same number of rows, on their rows and their part of the stacked state
#: (no padding, so any mixer; as many calls as distinct row counts).
MixerMode = Literal["padded", "grouped"]

_SUBCLASSES: dict[tuple[type, MixerMode], type] = {}
_SIGNATURES: dict[type, _Signature] = {}


def _signature(cls: type) -> _Signature:
    found = _SIGNATURES.get(cls)
    if found is None:
        found = _SIGNATURES[cls] = _Signature(cls)
    return found


def _run_padded(
    call: Callable[..., Any], signature: _Signature, rows: RaggedRows, x: mx.array, cache: Any
) -> Any:
    # A copy: the mixer advances the cache's lengths in place (``lengths -= S``), which
    # would change the step's shared array for the layers after it.
    cache.lengths = mx.array(rows.lengths)
    try:
        out = call(*signature.arguments(rows.gather(x), rows.mask, cache))
    finally:
        cache.lengths = None
    return rows.scatter(out) if isinstance(out, mx.array) else out


def _run_grouped(
    call: Callable[..., Any], signature: _Signature, rows: RaggedRows, x: mx.array, cache: Any
) -> Any:
    firsts = [0]
    for n in rows.counts:
        firsts.append(firsts[-1] + n)
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(rows.counts):
        groups.setdefault(n, []).append(b)
    flat = x[:, 0]
    outputs: list[mx.array | None] = [None] * len(rows.counts)
    states: list[list[Any]] = [[] for _ in rows.counts]
    for n, members in groups.items():
        take = mx.array(members, dtype=mx.int32)
        own = copy.copy(cache)
        own.cache = [None if s is None else s[take] for s in cache.cache]
        setattr(own, RAGGED_ROWS_ATTRIBUTE, None)
        cells = mx.array([[firsts[b] + i for i in range(n)] for b in members], dtype=mx.int32)
        out = call(*signature.arguments(flat[cells], None, own))
        if not isinstance(out, mx.array):
            return out
        for j, b in enumerate(members):
            outputs[b] = out[j]
            states[b] = [None if s is None else s[j : j + 1] for s in own.cache]
    for slot in range(len(cache.cache)):
        values = [state[slot] for state in states]
        if all(v is not None for v in values):
            cache[slot] = mx.concatenate(values, axis=0)
        elif any(v is not None for v in values):
            raise CacheStateError(f"state slot {slot} was set for some requests and not others")
    return mx.concatenate([o for o in outputs if o is not None], axis=0)[:, None]


def _ragged_class(cls: type, mode: MixerMode) -> type:
    """``cls`` with a call that runs the step's rows when its cache carries :class:`RaggedRows`."""
    sub = _SUBCLASSES.get((cls, mode))
    if sub is not None:
        return sub
    signature = _signature(cls)
    base_call: Callable[..., Any] = cls.__call__  # type: ignore[operator]
    run = _run_padded if mode == "padded" else _run_grouped

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(args, kwargs)
        cache = bound.get("cache")
        rows = getattr(cache, RAGGED_ROWS_ATTRIBUTE, None)
        if not isinstance(rows, RaggedRows):
            return base_call(self, *args, **kwargs)
        setattr(cache, RAGGED_INPUTS_ATTRIBUTE, bound[signature.input_name])
        out = run(partial(base_call, self), signature, rows, bound[signature.input_name], cache)
        if not isinstance(out, mx.array):
            raise TypeError(f"{cls.__name__} returned {type(out).__name__}, not one array")
        return out

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    sub.__qualname__ = f"{cls.__qualname__}[{mode} rows]"
    _SUBCLASSES[(cls, mode)] = sub
    return sub


def _original_class(cls: type) -> type:
    """The mixer's own class (``cls`` itself unless it is one of the swapped subclasses)."""
    for (original, _), sub in _SUBCLASSES.items():
        if sub is cls:
            return original
    return cls


@dataclass(frozen=True, kw_only=True, eq=False)
class _Found:
    """What the trace saw of one STATE layer's mixer: the module and its input."""

    module: nn.Module
    input_tail: tuple[int, ...]
    dtype: mx.Dtype


@dataclass(frozen=True, eq=False)
class _Call:
    """A module call in flight during the trace forward: the module, its class, its arguments."""

    module: nn.Module
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def holds(self, cache: Any) -> bool:
        """Whether ``cache`` is one of the call's arguments."""
        return any(a is cache for a in self.args) or any(v is cache for v in self.kwargs.values())


def _recording_class(cls: type, calls: list[_Call]) -> type:
    """``cls`` with a call that stands on ``calls`` (innermost last) while it runs."""
    base_call: Callable[..., Any] = cls.__call__  # type: ignore[operator]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(_Call(self, cls, args, kwargs))
        try:
            return base_call(self, *args, **kwargs)
        finally:
            calls.pop()

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})


def _traced_class(cls: type, calls: list[_Call]) -> type:
    """``cls`` (a STATE layer's cache class) noting, at each access, the module that reads it.

    The module is the innermost call in flight that was handed the cache (a helper method of
    the mixer is part of the mixer's call).
    """
    base_get: Callable[[Any, Any], Any] = getattr(cls, "__getitem__")  # noqa: B009
    base_set: Callable[[Any, Any, Any], None] = getattr(cls, "__setitem__")  # noqa: B009

    def note(self: Any) -> None:
        # Every access is traced: a cache that two modules read or write (a token shift in
        # the MLP beside the mixer, say) has no one mixer to swap, and is refused.
        found: dict[int, _Found | None] = self.kv_trace_found
        layer_id: int = self.kv_trace_layer
        seen = next((call for call in reversed(calls) if call.holds(self)), None)
        if layer_id in found:
            known = found[layer_id]
            if known is not None and (seen is None or seen.module is not known.module):
                found[layer_id] = None
            return
        if seen is None:
            found[layer_id] = None
            return
        signature = _signature(_original_class(seen.cls))
        x = signature.bind(seen.args, seen.kwargs).get(signature.input_name)
        if not signature.supported or not isinstance(x, mx.array) or x.ndim < 3:
            found[layer_id] = None
            return
        found[layer_id] = _Found(module=seen.module, input_tail=tuple(x.shape[2:]), dtype=x.dtype)

    def __getitem__(self: Any, index: Any) -> Any:
        note(self)
        return base_get(self, index)

    def __setitem__(self: Any, index: Any, value: Any) -> None:
        note(self)
        base_set(self, index, value)

    return type(cls.__name__, (cls,), {"__getitem__": __getitem__, "__setitem__": __setitem__})


def _trace_mixers(
    model: nn.Module, nesting: CacheNesting, num_layers: int, state_layer_ids: Sequence[int]
) -> dict[int, _Found | None]:
    """Each STATE layer's mixer, seen in a two-token forward on the model's own caches.

    For the forward every module's class records its calls (and is put back after it).
    """
    make_cache = getattr(model, "make_cache", None)
    if not callable(make_cache):
        return {}
    flat = flatten_caches(list(make_cache()))
    if len(flat) != num_layers:
        return {}
    calls: list[_Call] = []
    found: dict[int, _Found | None] = {}
    for layer_id in state_layer_ids:
        cache: Any = copy.copy(flat[layer_id])
        cache.__class__ = _traced_class(type(cache), calls)
        cache.kv_trace_found = found
        cache.kv_trace_layer = layer_id
        flat[layer_id] = cache
    recording: dict[type, type] = {}
    originals: list[tuple[nn.Module, type]] = []
    seen: set[int] = set()
    try:
        for _, module in model.named_modules():
            if id(module) in seen:
                continue  # a module held under two names is swapped once
            seen.add(id(module))
            cls = type(module)
            if cls not in recording:
                recording[cls] = _recording_class(cls, calls)
            originals.append((module, cls))
            module.__class__ = recording[cls]
        forward: Any = model
        mx.eval(forward(mx.array([[0, 1]], dtype=mx.int32), cache=nesting.nest(flat)))
    finally:
        for module, cls in originals:
            module.__class__ = cls
    return found


def _close(a: mx.array, b: mx.array, dtype: mx.Dtype) -> bool:
    """The attention probe's rule: the largest error relative to ``b``'s largest value."""
    return a.shape == b.shape and _max_rel_err(a, b) <= _tolerance(dtype)


def _probe(found: _Found, layer_id: int, fresh_cache: Callable[[], Any]) -> bool:
    """Ragged rows through the swapped mixer equal each request's tokens run alone.

    Three requests from states of their own: one as wide as the widest verification (a
    proposal of ``MAX_SPECULATIVE_TOKENS`` and the last token), one of a single row (a plain
    row beside it) and one in between.
    """
    module: Any = found.module
    signature = _signature(_original_class(type(module)))
    counts = (MAX_SPECULATIVE_TOKENS + 1, 1, 3)
    key = mx.random.key(layer_id + 11)
    shape = (len(counts), 2, *found.input_tail)
    prefix = (0.5 * mx.random.normal(shape, key=key)).astype(found.dtype)
    tokens = (
        0.5 * mx.random.normal((len(counts), max(counts), *found.input_tail), key=key + 1)
    ).astype(found.dtype)
    starts = []
    for b in range(len(counts)):
        cache = fresh_cache()
        module(*signature.arguments(prefix[b : b + 1], None, cache))
        starts.append(cache)
    expected = []
    for b, n in enumerate(counts):
        alone = copy.copy(starts[b])
        alone.cache = list(starts[b].cache)
        out = module(*signature.arguments(tokens[b : b + 1, :n], None, alone))
        expected.append((out[0], [s for s in alone.cache]))
    stacked = StackedStateCache(layer_id, [copy.copy(s) for s in starts])
    for row, start in zip(stacked.rows, starts, strict=True):
        row.cache = list(start.cache)
    rows = RaggedRows.from_counts(counts)
    setattr(stacked.view, RAGGED_ROWS_ATTRIBUTE, rows)
    flat = mx.concatenate([tokens[b, :n] for b, n in enumerate(counts)])[:, None]
    out = module(*signature.arguments(flat, None, stacked.view))
    mx.eval(out, stacked.view.cache)
    if rows.lengths.tolist() != list(counts):
        return False  # the step's rows must serve every layer unchanged
    stacked.split()
    first = 0
    for b, n in enumerate(counts):
        want_out, want_state = expected[b]
        if not _close(out[first : first + n, 0], want_out, found.dtype):
            return False
        for got, want in zip(stacked.rows[b].cache, want_state, strict=True):
            if (got is None) != (want is None):
                return False
            if got is not None and not _close(got, want, found.dtype):
                return False
        first += n
    return True


#: How many installs hold each swapped mixer (by ``id``): its class goes back at the last
#: :meth:`RaggedStateMixers.uninstall`, so engines sharing a model do not undo each other.
_HOLDS: dict[int, int] = {}


class RaggedStateMixers:
    """The change that swaps a model's STATE-layer mixers for ones that run ragged rows.

    A :class:`~kv_batching._model_surgery.ModelChange`: :meth:`install` traces the mixers
    and probes each swap (see the module docstring), :meth:`uninstall` puts the classes back.
    ``make_state_caches`` gives fresh state caches, one per STATE layer, for the probe.
    """

    name = "ragged state mixers"

    def __init__(
        self,
        nesting: CacheNesting,
        num_layers: int,
        state_layer_ids: Sequence[int],
        make_state_caches: StateCacheFactory,
    ) -> None:
        self._nesting = nesting
        self._num_layers = num_layers
        self._state_layer_ids = tuple(state_layer_ids)
        self._make_state_caches = make_state_caches
        self._modules: list[tuple[nn.Module, type]] = []

    def install(self, model: nn.Module) -> ChangeReport:
        """Swap every STATE layer's mixer, or none (with the reason) if any cannot be."""
        if self._modules:
            return self._report(None)
        if not self._state_layer_ids:
            return self._report("the model has no STATE layers")
        try:
            found = _trace_mixers(model, self._nesting, self._num_layers, self._state_layer_ids)
        except Exception as error:  # a model the trace does not fit verifies per request
            return self._report(f"the trace forward raised {error!r}")
        mixers = [found.get(layer_id) for layer_id in self._state_layer_ids]
        if any(m is None for m in mixers):
            missing = [i for i, m in zip(self._state_layer_ids, mixers, strict=True) if m is None]
            return self._report(
                f"no mixer called as (x, cache) or (x, mask, cache) found for layers {missing}"
            )
        chosen = [m for m in mixers if m is not None]
        if len({id(m.module) for m in chosen}) != len(chosen):
            return self._report("one mixer serves several layers")
        try:
            for k, (layer_id, mixer) in enumerate(zip(self._state_layer_ids, chosen, strict=True)):
                original = _original_class(type(mixer.module))
                self._hold(mixer.module, original)

                def fresh(k: int = k) -> Any:
                    return self._make_state_caches()[k]

                modes: list[MixerMode] = ["grouped"]
                if _signature(original).has_mask:
                    modes.insert(0, "padded")
                for mode in modes:
                    mixer.module.__class__ = _ragged_class(original, mode)
                    if _probe(mixer, layer_id, fresh):
                        break
                else:
                    self.uninstall()
                    return self._report(f"layer {layer_id}'s {original.__name__} fails the probe")
        except Exception as error:
            self.uninstall()
            return self._report(f"the probe raised {error!r}")
        return self._report(None)

    def _report(self, reason: str | None) -> ChangeReport:
        if reason is not None:
            reason = f"proposals verify by a forward per request: {reason}"
        return ChangeReport(name=self.name, installed=len(self._modules), reason=reason)

    def _hold(self, module: nn.Module, original: type) -> None:
        """Count ``module`` (of class ``original`` before any swap) as swapped by this install."""
        self._modules.append((module, original))
        _HOLDS[id(module)] = _HOLDS.get(id(module), 0) + 1

    @property
    def modes(self) -> list[MixerMode]:
        """How each swapped mixer runs the rows, in STATE-layer order."""
        return [
            "padded" if "[padded rows]" in type(module).__qualname__ else "grouped"
            for module, _ in self._modules
        ]

    @property
    def installed(self) -> bool:
        """Whether every mixer still has its swapped class (nothing put them back since)."""
        swapped = set(_SUBCLASSES.values())
        return bool(self._modules) and all(type(m) in swapped for m, _ in self._modules)

    def uninstall(self, model: nn.Module | None = None) -> int:
        """Let go of the mixers; one no other install holds gets its own class back.

        Returns how many mixers this install held.
        """
        held = len(self._modules)
        for module, original in self._modules:
            left = _HOLDS.get(id(module), 1) - 1
            if left > 0:
                _HOLDS[id(module)] = left
            else:
                _HOLDS.pop(id(module), None)
                module.__class__ = original
        self._modules.clear()
        return held

    def replay(
        self,
        stacked: Sequence[StackedStateCache],
        first_rows: Sequence[int],
        counts: Sequence[int],
        befores: Sequence[Sequence[Any]],
    ) -> list[list[Any]]:
        """States advanced from ``befores`` through the first ``counts[j]`` rows of request ``j``.

        ``stacked`` are a finished step's stacked caches, one per STATE layer in order, each
        holding the input rows its mixer ran (:data:`RAGGED_INPUTS_ATTRIBUTE`); request ``j``'s
        rows start at step row ``first_rows[j]``; ``befores[j]`` are its state caches before
        the step (one per STATE layer; they are advanced in place and returned). A mixer's
        input at a row depends only on the rows before it, so a verification that keeps fewer
        tokens than it ran gets its state by running only the mixers again, on the kept rows
        of every such request at once: no other layer, no vocabulary head. Lazy: evaluate the
        returned states.
        """
        if len(stacked) != len(self._modules):
            raise CacheStateError(
                f"{len(stacked)} stacked state caches for {len(self._modules)} swapped mixers"
            )
        index = mx.array(
            [first + i for first, n in zip(first_rows, counts, strict=True) for i in range(n)],
            dtype=mx.int32,
        )
        rows = RaggedRows.from_counts(counts)
        for k, (state, (module, original)) in enumerate(zip(stacked, self._modules, strict=True)):
            inputs = getattr(state.view, RAGGED_INPUTS_ATTRIBUTE, None)
            if not isinstance(inputs, mx.array):
                raise CacheStateError(
                    f"layer {state.layer_id}: the step left no mixer inputs to replay"
                )
            again = StackedStateCache(state.layer_id, [before[k] for before in befores])
            setattr(again.view, RAGGED_ROWS_ATTRIBUTE, rows)
            call: Any = module
            call(*_signature(original).arguments(inputs[index], None, again.view))
            again.split()
        return [list(before) for before in befores]

    @staticmethod
    def mark(view: Any, rows: RaggedRows | None) -> None:
        """Hand ``rows`` to the mixer reading ``view`` (a stacked cache's view); ``None`` clears."""
        setattr(view, RAGGED_ROWS_ATTRIBUTE, rows)


def install_ragged_state_mixers(
    model: nn.Module,
    nesting: CacheNesting,
    num_layers: int,
    state_layer_ids: Sequence[int],
    make_state_caches: StateCacheFactory,
) -> RaggedStateMixers | None:
    """Swap each STATE layer's mixer for one that runs ragged rows, if all of them can.

    :class:`RaggedStateMixers`' install outside a :class:`~kv_batching._model_surgery.
    ModelSurgery`: ``None`` (nothing changed, the reason logged) when a mixer is not found
    by the trace, is shared by two layers, is not called as ``(x, mask, cache)`` or fails its
    probe.
    """
    change = RaggedStateMixers(nesting, num_layers, state_layer_ids, make_state_caches)
    report = change.install(model)
    if report.installed:
        return change
    logger.info("%s", report.reason)
    return None
