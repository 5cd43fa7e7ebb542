"""A value type describing one layer's rotary position embedding."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from ._errors import ShapeMismatchError

__all__ = ["RopeConfig", "rope_config_from_module"]


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


def rope_config_from_module(module: object) -> tuple[RopeConfig | None, str]:
    """Describe a model's rope module as a :class:`kv_protocol.RopeConfig` if one fits.

    Returns ``(config, "")`` for a plain ``mlx.nn.RoPE`` (dims, traditional, base, scale),
    else ``(None, reason)``: precomputed frequencies (mlx-lm's YaRN, Llama 3, SuScaled,
    proportional RoPE keep a ``_freqs`` array), an ``mscale`` other than 1, or any other
    rope class (e.g. dynamic NTK scaling, whose frequencies depend on the offset).
    """
    cls = type(module).__name__
    if module is None:
        return None, "the attention module has no rope"
    if getattr(module, "_freqs", None) is not None:
        return None, f"{cls} uses precomputed frequencies (_freqs), not a base"
    mscale = getattr(module, "mscale", 1.0)
    if isinstance(mscale, (int, float)) and float(mscale) != 1.0:
        return None, f"{cls} scales its output by mscale={mscale}"
    if not isinstance(module, nn.RoPE) or type(module).__call__ is not nn.RoPE.__call__:
        return None, f"{cls} is not a plain mlx.nn.RoPE"
    dims = getattr(module, "dims", None)
    base = getattr(module, "base", None)
    if base is None:
        return None, f"{cls} has no base frequency"
    try:
        config = RopeConfig(
            dims=int(dims) if dims is not None else 0,
            traditional=bool(getattr(module, "traditional", False)),
            base=float(base),
            scale=float(getattr(module, "scale", 1.0)),
        )
    except ValueError as err:
        return None, f"{cls} cannot be described: {err}"
    return config, ""
