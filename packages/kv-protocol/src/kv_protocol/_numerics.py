"""Numerics every package shares: a vectorised ``exp`` of non-positive floats and gated MLPs.

MLX's CPU ``exp`` evaluates element by element (about 11.5 ns an element on a 2-core x86_64);
:func:`exp_nonpositive` builds it from adds, multiplies and shifts, which MLX vectorises. Softmax
and log-softmax only ever need ``exp`` of values at or below a row's maximum, so this one
function serves the kernels' attention softmax and the sampler's probabilities and logprobs.
:func:`sigmoid` is built on it, and :func:`gated_activation` (a gated MLP's ``act(gate) *
up``, SiLU or the tanh GELU) on that: the one definition kv-batching's MLPs compile and
native kernels (``GatedActivationKernel``) reproduce bit for bit, from
:data:`ACTIVATION_CONSTANTS`.
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = [
    "ACTIVATION_CONSTANTS",
    "GATED_ACTIVATIONS",
    "exp_nonpositive",
    "gated_activation",
    "sigmoid",
]

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
_GELU_CUBIC = 0.044715
#: ``2 * sqrt(2 / pi)``: ``0.5 * (1 + tanh(sqrt(2/pi) * u)) = sigmoid(2 * sqrt(2/pi) * u)``.
_GELU_SCALE = 2.0 * math.sqrt(2.0 / math.pi)

#: The constants of :func:`exp_nonpositive` and :func:`gated_activation`, in the order a
#: native kernel takes them: ``log2(e)``, the clamp of ``x * log2(e)`` (``-127``), the
#: rounding constant ``1.5 * 2**23`` and its float32 bits, the seven Taylor coefficients of
#: ``2**f`` from the constant term up, GELU's cubic coefficient and its sigmoid's scale.
#: Each is rounded to float32 where it meets a float32 value, as MLX rounds a Python float.
ACTIVATION_CONSTANTS: tuple[float, ...] = (
    _LOG2_E,
    _MIN_EXP2,
    _ROUND_MAGIC,
    float(_ROUND_MAGIC_BITS),
    *_EXP2_COEFFS,
    _GELU_CUBIC,
    _GELU_SCALE,
)
#: The activations :func:`gated_activation` computes.
GATED_ACTIVATIONS = ("silu", "gelu_approx")


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


def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + exp(-x))`` of a float32 ``x``, vectorised on the CPU.

    With ``e = exp(-|x|)`` (:func:`exp_nonpositive`, never overflowing) it is ``1 / (1 + e)``
    for ``x >= 0`` and ``e / (1 + e)`` below, so both tails keep their relative precision;
    ``+-inf`` give 1 and 0.
    """
    e = exp_nonpositive(-mx.abs(x))
    r = 1.0 / (1.0 + e)
    return mx.where(x >= 0, r, e * r)


def gated_activation(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    """``act(gate) * up`` of float32 arrays, ``act`` one of :data:`GATED_ACTIVATIONS`.

    Both are ``g * sigmoid(c(g))``: SiLU with ``c(g) = g``, the tanh GELU with ``c(g) =
    2 sqrt(2/pi) (g + 0.044715 g**3)`` (``0.5 (1 + tanh z) = sigmoid(2 z)``). The product
    is ``(g * sigmoid(c(g))) * up``, each operation rounded to float32 in this order.
    """
    if activation == "silu":
        return gate * sigmoid(gate) * up
    if activation == "gelu_approx":
        inner = gate + _GELU_CUBIC * (gate * gate * gate)
        return gate * sigmoid(_GELU_SCALE * inner) * up
    raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
