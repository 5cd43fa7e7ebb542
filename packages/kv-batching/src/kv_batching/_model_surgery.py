"""Every change made to an mlx-lm model, installed and undone through one interface.

The engine serves an mlx-lm model as it is, with a few modules replaced where a replacement
computes the same function faster or reads the pool: attention wrappers, vectorised gated
MLPs, recurrent mixers that run a verification's ragged rows, and (from kv-serve) native
norms and quantized-code linears. Each kind is a :class:`ModelChange`: it probes every
candidate module and installs only what its probe accepts, reports how many modules it
holds and why it refused the rest (:class:`ChangeReport`), and puts the model's own modules
back. :class:`ModelSurgery` holds the changes installed on one model, in order, and is the
one place that undoes them (last first) and that switches on, around the engine's own
forwards, the changes that compute differently only there (:class:`EngagedChange`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import mlx.nn as nn

__all__ = ["ChangeReport", "EngagedChange", "ModelChange", "ModelSurgery"]

logger = logging.getLogger(__name__)

_Change = TypeVar("_Change", bound="ModelChange")


@dataclass(frozen=True, kw_only=True)
class ChangeReport:
    """What one change did to a model: the modules it holds, and why it refused any.

    ``reason`` is ``None`` when every candidate it probed was installed; a change that
    installed nothing always says why.
    """

    name: str
    installed: int
    reason: str | None = None

    def __str__(self) -> str:
        held = f"{self.name}: {self.installed} modules"
        return held if self.reason is None else f"{held} ({self.reason})"


@runtime_checkable
class ModelChange(Protocol):
    """One kind of change to an mlx-lm model's modules."""

    @property
    def name(self) -> str:
        """A short name for logs and reports (``"attention"``, ``"fast MLPs"``, ...)."""
        ...

    def install(self, model: nn.Module) -> ChangeReport:
        """Probe each candidate module of ``model`` and replace those the probe accepts.

        Modules this change already replaced count as installed. A change the engine
        cannot run without raises ``UnsupportedModelError`` and leaves the model as it was;
        any other refusal is the report's ``reason``.
        """
        ...

    def uninstall(self, model: nn.Module) -> int:
        """Put back the model's own modules this change replaced; returns how many."""
        ...


@runtime_checkable
class EngagedChange(ModelChange, Protocol):
    """A change whose modules compute their own way only inside the engine's forwards.

    Outside them (an mlx-lm oracle, ``mlx_lm.generate`` on the same model object) they are
    the replaced module's own call, bit for bit. MLX is lazy: what counts is when a forward
    is built, not when it is evaluated.
    """

    def engage(self, *, prefill: bool) -> None:
        """The engine builds a forward now (a prompt chunk's when ``prefill``)."""
        ...

    def disengage(self) -> None:
        """The forward is built: back to the model's own calls."""
        ...


class ModelSurgery:
    """The changes installed on one model, in the order they were installed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._installed: list[tuple[ModelChange, ChangeReport]] = []
        # The installed changes that engage, known at install: a forward's engagement does
        # no protocol checks (each runtime-checkable isinstance reads every member).
        self._engaging: list[EngagedChange] = []

    def install(self, change: ModelChange) -> ChangeReport:
        """Install ``change`` (see :meth:`ModelChange.install`) and keep it if it holds any.

        A refusal is logged with its reason; ``UnsupportedModelError`` propagates.
        """
        report = change.install(self.model)
        if report.installed:
            self._installed.append((change, report))
            if isinstance(change, EngagedChange):
                self._engaging.append(change)
        if report.reason is not None:
            logger.info("%s: %s", type(self.model).__name__, report)
        return report

    def find(self, kind: type[_Change]) -> _Change | None:
        """The installed change of type ``kind``, if any."""
        for change, _ in self._installed:
            if isinstance(change, kind):
                return change
        return None

    @property
    def reports(self) -> tuple[ChangeReport, ...]:
        """The installed changes' reports, in installation order."""
        return tuple(report for _, report in self._installed)

    def uninstall(self, kind: type[ModelChange]) -> int:
        """Undo the installed changes of type ``kind``; returns the modules put back."""
        restored = 0
        for change, report in list(self._installed):
            if isinstance(change, kind):
                restored += change.uninstall(self.model)
                self._forget(change, report)
        return restored

    def _forget(self, change: ModelChange, report: ChangeReport) -> None:
        self._installed.remove((change, report))
        if change in self._engaging:
            self._engaging.remove(change)  # type: ignore[arg-type]

    def undo(self) -> int:
        """Undo every change, last installed first; the model is as it was before them."""
        restored = 0
        while self._installed:
            change, report = self._installed[-1]
            restored += change.uninstall(self.model)
            self._forget(change, report)
        return restored

    @contextmanager
    def engaged(self, *, prefill: bool = False) -> Iterator[None]:
        """Within the block the engine builds a forward: engaged changes compute their way."""
        engaged = tuple(self._engaging)
        for change in engaged:
            change.engage(prefill=prefill)
        try:
            yield
        finally:
            for change in engaged:
                change.disengage()
