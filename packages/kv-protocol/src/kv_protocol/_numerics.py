"""Numerics every package shares: a vectorised ``exp`` of non-positive floats.

MLX's CPU ``exp`` evaluates element by element (about 11.5 ns an element on a 2-core x86_64);
:func:`exp_nonpositive` builds it from adds, multiplies and shifts, which MLX vectorises. Softmax
and log-softmax only ever need ``exp`` of values at or below a row's maximum, so this one
function serves the kernels' attention softmax and the sampler's probabilities and logprobs.
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["exp_nonpositive"]

#: Taylor coefficients of ``2**f = exp(f ln 2)`` for ``|f| <= 1/2``; the first omitted term
#: is below ``(ln 2 / 2)**7 / 7! ~ 1.2e-7``.
_EXP2_COEFFS = tuple((math.log(2.0) ** k) / math.factorial(k) for k in range(7))
#: ``1.5 * 2**23``: adding it to a float32 of magnitude below ``2**22`` rounds to an integer
#: held in the low mantissa bits.
_ROUND_MAGIC = 12582912.0
_ROUND_MAGIC_BITS = 0x4B400000
_LOG2_E = 1.0 / math.log(2.0)
#: ``2**-127`` has exponent bits 0: the clamp makes ``exp(-inf)`` exactly 0.
_MIN_EXP2 = -127.0


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` of a float32 ``x <= 0`` (``-inf`` gives exactly 0), vectorised on the CPU.

    ``exp(x) = 2**n * 2**f`` with ``n = round(x / ln 2)`` and ``|f| <= 1/2``: the integer is
    rounded by adding a magic constant, ``2**f`` is a degree-6 polynomial and ``2**n`` is
    built in the exponent bits. The rounding of ``x / ln 2`` bounds the relative error by
    ``2.5e-7 + 7.5e-8 * |x|``; results below ``2**-126`` flush towards 0.
    """
    t = mx.maximum(x * _LOG2_E, _MIN_EXP2)
    rounded = t + _ROUND_MAGIC
    f = t - (rounded - _ROUND_MAGIC)
    poly = mx.array(_EXP2_COEFFS[-1], dtype=mx.float32)
    for coeff in reversed(_EXP2_COEFFS[:-1]):
        poly = poly * f + coeff
    exponent = mx.view(rounded, mx.int32) - (_ROUND_MAGIC_BITS - 127)
    return poly * mx.view(mx.left_shift(exponent, 23), mx.float32)
