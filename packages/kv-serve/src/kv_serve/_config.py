"""The settings of a served model, as values: the pool's, the engine's and the server's.

``kv-serve serve`` builds one :class:`ServerConfig` from its command line and hands it whole
to :class:`~kv_serve.KVServer`, which hands its :class:`PoolConfig` and
:class:`kv_batching.EngineConfig` whole to :func:`~kv_serve.build_engine`, which hands the
engine's to the ``DecodeEngine``. Each value is checked once, when its config is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kv_batching import EngineConfig, SpeculationConfig
from kv_protocol import RequestStateError, check_int, kv_quantization_choice

from ._sizes import DEFAULT_KV_SLAB_BYTES, NGRAM_SPECULATIVE_TOKENS

__all__ = ["PoolConfig", "ServerConfig", "split_settings"]


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How :func:`~kv_serve.build_engine` sizes, stores and serves the KV pool.

    See :func:`~kv_serve.build_pool` (the budget, page count, page size, context, quantized
    pages and slabs) and :func:`~kv_serve.build_kernels` (``fused_rope``).
    """

    #: A cap on the pool's bytes (``None``: sized for ``max_running`` x ``max_context``).
    kv_budget_bytes: int | None = None
    #: Pages per sub-pool, instead of a byte budget.
    num_pages: int | None = None
    #: Tokens per page.
    page_size: int = 16
    #: The longest prompt plus completion a request may ask for.
    max_context: int = 4096
    #: 8 or 4: the pages stored quantized (``None``: the model's dtype).
    kv_bits: int | None = None
    #: Group size of quantized pages along ``head_dim`` (32, 64 or 128).
    kv_group_size: int = 64
    #: Which layer kinds' pages are quantized: ``all``, ``full`` or ``sliding``.
    kv_quantize: str = "all"
    #: How much a sub-pool's buffers grow at a time (``None``: the whole budget at start).
    kv_slab_bytes: int | None = DEFAULT_KV_SLAB_BYTES
    #: ``off``, ``auto`` or ``on``: RoPE fused into the pool scatter where it serves a layer.
    fused_rope: str = "off"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "max_context", check_int(self.max_context, "max_context", minimum=1)
        )
        kv_quantization_choice(self.kv_bits, self.kv_group_size, self.kv_quantize)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything a :class:`~kv_serve.KVServer` serves a model with.

    ``model_name`` is the name clients ask for; at most ``max_queued`` sequences wait for
    admission (429 past it). A chat request without ``max_tokens`` may generate up to the
    context left after its prompt, at most ``max_tokens_default`` (``None``: no cap).
    ``speculative`` (``"ngram"`` or a :class:`kv_batching.SpeculationConfig`) with
    ``num_speculative_tokens`` turns on speculative decoding (see :func:`~kv_serve.build_engine`).
    """

    model_name: str
    max_queued: int = 128
    max_tokens_default: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    speculative: str | SpeculationConfig | None = None
    num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise RequestStateError(f"model_name must be a str, got {self.model_name!r}")
        object.__setattr__(self, "max_queued", check_int(self.max_queued, "max_queued", minimum=0))
        if self.max_tokens_default is not None:
            cap = check_int(self.max_tokens_default, "max_tokens_default", minimum=1)
            object.__setattr__(self, "max_tokens_default", cap)
        for name, kind in (("engine", EngineConfig), ("pool", PoolConfig)):
            if not isinstance(getattr(self, name), kind):
                raise RequestStateError(f"{name} must be a {kind.__name__}")

    @classmethod
    def from_settings(cls, config: ServerConfig | None, settings: dict[str, Any]) -> ServerConfig:
        """``config`` with ``settings`` replacing its values, each routed to its config.

        A name of :class:`ServerConfig`, :class:`PoolConfig` or
        :class:`kv_batching.EngineConfig`; another raises ``TypeError`` naming it.
        """
        own, pool, engine = split_settings(settings, cls)
        if config is None:
            if "model_name" not in own:
                raise TypeError("KVServer needs model_name= (or a ServerConfig)")
            return cls(**own, engine=EngineConfig(**engine), pool=PoolConfig(**pool))
        return dataclasses.replace(
            config,
            **own,
            engine=dataclasses.replace(config.engine, **engine),
            pool=dataclasses.replace(config.pool, **pool),
        )


def split_settings(
    settings: dict[str, Any], own: type[Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``settings`` by where they belong: ``own``'s fields, the pool's and the engine's."""
    names = [
        {f.name for f in dataclasses.fields(kind)} if kind is not None else set()
        for kind in (own, PoolConfig, EngineConfig)
    ]
    parts: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, {}, {})
    unknown = []
    for name, value in settings.items():
        for part, fields in zip(parts, names, strict=True):
            if name in fields and name not in ("engine", "pool"):
                part[name] = value
                break
        else:
            unknown.append(name)
    if unknown:
        known = sorted(set().union(*names) - {"engine", "pool"})
        raise TypeError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
        )
    return parts
