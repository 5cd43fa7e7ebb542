"""A value type describing one layer's rotary position embedding."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import ShapeMismatchError

__all__ = ["RopeConfig"]


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding parameters with the meaning of ``mx.fast.rope``.

    ``dims`` leading features of each head are rotated (the rest pass through);
    ``traditional=True`` rotates adjacent pairs (interleaved, GPT-J style), ``False`` rotates
    ``x[i]`` with ``x[i + dims // 2]`` (half-split, NeoX style). Position ``p`` is scaled by
    ``scale`` before the angle ``p * scale * base ** (-2 i / dims)`` is taken.
    """

    dims: int
    traditional: bool = False
    base: float = 10000.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.dims, bool) or not isinstance(self.dims, int) or self.dims < 2:
            raise ShapeMismatchError(f"rope dims must be an int >= 2, got {self.dims!r}")
        if self.dims % 2:
            raise ShapeMismatchError(f"rope dims must be even, got {self.dims}")
        if not self.base > 0:
            raise ShapeMismatchError(f"rope base must be > 0, got {self.base!r}")
