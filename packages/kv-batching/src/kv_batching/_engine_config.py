"""The settings of one :class:`~kv_batching.DecodeEngine`, checked once, in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kv_protocol import RequestStateError, check_int

from ._engine_stats import DEFAULT_STATS_WINDOW
from ._prefill_budget import PrefillBudget
from ._speculative import SpeculationConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How a :class:`~kv_batching.DecodeEngine` schedules, prefills, samples and reuses.

    Every value is checked when the config is made (``RequestStateError``, a
    ``ValueError``, naming the field); what depends on the pool (a snapshot interval that
    must be a multiple of its prefix boundary, prefix caching on a pool without a prefix
    cache) or on the model (the vocabulary size, the decode routes) is checked when the
    engine is built. See :class:`~kv_batching.DecodeEngine` for what each setting does.
    """

    #: The most requests that decode together.
    max_running: int = 16
    #: The most prompt tokens one prefill chunk (and, unbounded, one step) takes.
    prefill_chunk: int = 512
    #: Seed of the engine's random stream (requests without a seed of their own sample there).
    seed: int = 0
    #: Keep each step's pages in use in :attr:`DecodeEngine.stats`.
    record_pages: bool = True
    #: Token ids are ``0 .. vocab_size - 1`` (``None``: the model's embedding table's rows).
    vocab_size: int | None = None
    #: Prefill chunks project only their last position where that is exact for the model.
    prefill_last_logits: bool = True
    #: Steps the per-step series keep (``None``: all of them).
    stats_window: int | None = DEFAULT_STATS_WINDOW
    #: ``auto``, ``universal`` or ``fast``: each attention layer's decode route.
    decode_path: str = "auto"
    #: Bytes of recurrent state the running requests may hold together (``None``: no cap).
    state_budget_bytes: int | None = None
    #: Reuse cached prompt prefixes (``None``: where the pool has a prefix cache).
    prefix_caching: bool | None = None
    #: A step's prefill bound as a multiple of its decode time (``None``: whole chunks).
    prefill_stall: float | None = None
    #: Tokens between recurrent-state snapshots (``None``: the default interval).
    state_snapshot_interval: int | None = None
    #: Bytes of recurrent-state snapshots kept for prefix reuse (``None``: the default).
    state_cache_bytes: int | None = None
    #: Keep each running request's state before its last decode step (for ``restore``).
    step_snapshots: bool = False
    #: Speculative decoding (``None``: off).
    speculation: SpeculationConfig | None = None
    #: The wide gated MLPs' activation from vectorised arithmetic on MLX's CPU.
    fast_activations: bool = True

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "max_running": check_int(self.max_running, "max_running", minimum=1),
            "seed": check_int(self.seed, "seed", minimum=0, maximum=2**64 - 1),
        }
        for name in ("record_pages", "prefill_last_logits", "step_snapshots", "fast_activations"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise RequestStateError(f"{name} must be a bool, got {value!r}")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise RequestStateError(
                f"prefix_caching must be a bool or None, got {self.prefix_caching!r}"
            )
        speculation = self.speculation
        if speculation is not None and not isinstance(speculation, SpeculationConfig):
            raise RequestStateError(
                f"speculation must be a SpeculationConfig or None, got {type(speculation)!r}"
            )
        if not isinstance(self.decode_path, str):
            raise RequestStateError(f"decode_path must be a str, got {self.decode_path!r}")
        # The budget checks prefill_chunk and prefill_stall (and keeps their normal forms).
        budget = PrefillBudget(self.prefill_chunk, prefill_stall=self.prefill_stall)
        checked["prefill_chunk"] = budget.prefill_chunk
        checked["prefill_stall"] = budget.prefill_stall
        minimums = {
            "vocab_size": 1,
            "stats_window": 1,
            "state_budget_bytes": 1,
            "state_snapshot_interval": 1,
            "state_cache_bytes": 0,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is not None:
                checked[name] = check_int(value, name, minimum=minimum)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_settings(cls, config: EngineConfig | None, settings: dict[str, Any]) -> EngineConfig:
        """``config`` with ``settings`` (field names) replacing its values.

        An unknown name raises ``TypeError`` listing the fields.
        """
        if config is not None and not isinstance(config, EngineConfig):
            raise RequestStateError(f"config must be an EngineConfig, got {type(config)!r}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(
                f"unknown engine setting(s) {', '.join(unknown)}; an EngineConfig has "
                f"{', '.join(sorted(names))}"
            )
        if config is None:
            return cls(**settings)
        return dataclasses.replace(config, **settings) if settings else config
