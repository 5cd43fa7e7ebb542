"""How a model's flat cache list (one entry per layout layer id) nests into what it takes.

The layout gives every cache of the model's ``make_cache()`` its own layer id, with each
``CacheList`` flattened (:func:`kv_protocol.flatten_caches`). The engine builds one cache
per layer id; :class:`CacheNesting` puts them back into the shape the model indexes: a
``CacheList`` entry gets a shallow copy of the model's own ``CacheList`` holding the
engine's caches, so the model's ``cache[i][0]`` reads what the engine built for the flat
layer id.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kv_protocol import find_layers

__all__ = ["CacheNesting"]

_CACHE_LIST = "CacheList"

# A node of the model's cache list: a flat layer id, or a CacheList (its template and children).
_Node = int | tuple[Any, tuple["_Node", ...]]


def _nodes(caches: Sequence[Any], start: int) -> tuple[tuple[_Node, ...], int]:
    """The nodes of ``caches`` with flat ids from ``start``, and the next free flat id."""
    nodes: list[_Node] = []
    next_id = start
    for cache in caches:
        if type(cache).__name__ == _CACHE_LIST:
            children, next_id = _nodes(list(getattr(cache, "caches", ())), next_id)
            nodes.append((cache, children))
        else:
            nodes.append(next_id)
            next_id += 1
    return tuple(nodes), next_id


class CacheNesting:
    """The shape of a model's cache list over the layout's flat layer ids.

    ``by_layer`` is True when the list is one plain cache per decoder layer (layer id =
    decoder layer index), the only shape the patched fast path can address.
    """

    def __init__(self, caches: Sequence[Any] | None, num_decoder_layers: int) -> None:
        if caches is None:
            self._nodes: tuple[_Node, ...] = tuple(range(num_decoder_layers))
            self.num_layers = num_decoder_layers
        else:
            self._nodes, self.num_layers = _nodes(list(caches), 0)
        self.by_layer = self.num_layers == num_decoder_layers and all(
            isinstance(node, int) for node in self._nodes
        )
        self._flat = all(isinstance(node, int) for node in self._nodes)

    @classmethod
    def from_model(cls, model: object) -> CacheNesting:
        """Read the shape off ``model.make_cache()`` (one cache per layer without one)."""
        layers = len(find_layers(model))
        make_cache = getattr(model, "make_cache", None)
        if not callable(make_cache):
            return cls(None, layers)
        return cls(list(make_cache()), layers)

    def describe(self) -> str:
        """Why the fast path cannot address these caches by decoder layer, or ``""``."""
        if self.by_layer:
            return ""
        return (
            f"make_cache() gives {self.num_layers} caches (CacheLists flattened) that are not "
            "one plain cache per decoder layer; the patched path addresses caches by decoder "
            "layer index"
        )

    def nest(self, flat: Sequence[Any]) -> list[Any]:
        """The list the model takes, from one cache per flat layer id."""
        if self._flat:
            return list(flat)
        return [_build(node, flat) for node in self._nodes]


def _build(node: _Node, flat: Sequence[Any]) -> Any:
    """One model-level cache of ``node`` from the flat caches.

    A module function: a closure that calls itself is a reference cycle, which would hold
    ``flat`` (and the arrays it reaches) until the cycle collector runs.
    """
    if isinstance(node, int):
        return flat[node]
    template, children = node
    nested = copy.copy(template)
    nested.caches = tuple(_build(child, flat) for child in children)
    return nested
