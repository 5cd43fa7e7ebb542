"""Gated MLPs with their activation from vectorised arithmetic, for MLX's CPU backend.

mlx-lm's gated MLPs compute ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (``swiglu``:
Llama, Qwen, Mistral, ...) or the tanh GELU (``gelu_approx``: Gemma). On MLX's CPU backend
``exp`` and ``tanh`` evaluate element by element: Gemma 3 270M's ``gelu_approx`` over a
512-token prefill chunk (512 x 2048) takes 28 ms, more than the layer's three matrix products
together with MKL, about a third of a prefill. Both activations are ``x * sigmoid(c(x))``
(``0.5 * (1 + tanh(z)) = sigmoid(2 z)``), and :func:`kv_protocol.gated_activation` builds
them on :func:`kv_protocol.sigmoid` (adds, multiplies and shifts, which MLX vectorises),
compiled here: 8.7 against 28.6 ms (GELU) and 7.7 against 16.7 ms (SiLU) at 512 x 2048, to
a relative error of about ``1e-6`` against float64 (MLX's own tanh GELU loses up to
``2.5e-4`` relative where ``1 + tanh`` cancels). Where the engine's kernel set carries a
``gated_activation`` (``kv_protocol.GatedActivationKernel``) it computes the same bits as
one operation instead of the compiled function's seven.

:class:`FastMLPs` (a :class:`~kv_batching._model_surgery.ModelChange`) swaps such a module
for a :class:`FastGatedMLP` only where it pays and is the same function: on the CPU, float32
activations, a gate at least :data:`FAST_MLP_MIN_WIDTH` wide, and a probe whose outputs
equal the module's own (to float rounding) for one of the two activations. Anything else
keeps the model's own call, and so does a swapped module until the change is engaged (the
engine's :class:`~kv_batching._model_surgery.ModelSurgery` engages it around its forwards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import GATED_ACTIVATIONS, GatedActivationKernel, find_layers, gated_activation

from ._model_surgery import ChangeReport
from ._patching import unwrap_layer_children

__all__ = [
    "FAST_MLP_MIN_WIDTH",
    "FastGatedMLP",
    "FastMLPs",
    "fast_mlps",
    "patch_model_mlps",
    "unpatch_model_mlps",
]

#: Narrowest gate (``gate_proj`` output features) for which the MLP is swapped; narrower
#: activations cost little and keep the model's own (bit-identical to mlx-lm) call.
FAST_MLP_MIN_WIDTH = 1024

#: Names under which mlx-lm decoder layers hold their MLP.
_MLP_CHILD_NAMES = ("mlp", "feed_forward")


@contextmanager
def fast_mlps(*modules: nn.Module, kernel: GatedActivationKernel | None = None) -> Iterator[None]:
    """Within the block, the :class:`FastGatedMLP` modules in ``modules`` compute their way.

    For a module or model used outside an engine (a benchmark, a test); the engine engages
    its own through its :class:`~kv_batching._model_surgery.ModelSurgery`. ``kernel`` (a
    kernel set's ``gated_activation``) computes the activations it serves.
    """
    found = [
        m for module in modules for _, m in module.named_modules() if isinstance(m, FastGatedMLP)
    ]
    for module in found:
        module.engage(kernel)
    try:
        yield
    finally:
        for module in found:
            module.disengage()


# Compiled, each product is one fused CPU kernel; shapes are traced as they come (the bit
# casts of the exponent do not compile shapeless).
_COMPILED: dict[str, Callable[[mx.array, mx.array], mx.array]] = {}


def _gated(activation: str) -> Callable[[mx.array, mx.array], mx.array]:
    fn = _COMPILED.get(activation)
    if fn is None:
        fn = _COMPILED[activation] = cast(
            Callable[[mx.array, mx.array], mx.array],
            mx.compile(partial(gated_activation, activation=activation)),
        )
    return fn


def _activate(
    activation: str, gate: mx.array, up: mx.array, kernel: GatedActivationKernel | None
) -> mx.array:
    """``act(gate) * up``: ``kernel``'s where it serves, else the compiled function."""
    if kernel is not None:
        out = kernel(gate, up, activation=activation)
        if out is not None:
            return out
    return _gated(activation)(gate, up)


class FastGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` of a wrapped mlx-lm MLP, ``act`` vectorised in float32.

    ``activation`` is ``"silu"`` or ``"gelu_approx"``. Holds the module it replaces as its
    one child (``inner``: the weights are counted once, under ``inner``). Until
    :meth:`engage` (and after :meth:`disengage`), and for input of another dtype than
    float32, it is ``inner``'s call.
    """

    def __init__(self, inner: nn.Module, activation: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {list(GATED_ACTIVATIONS)}, got {activation!r}"
            )
        self.inner = inner
        self.activation = activation
        self._engaged = False
        self._kernel: GatedActivationKernel | None = None

    def engage(self, kernel: GatedActivationKernel | None = None) -> None:
        """Compute the vectorised form from now on (``kernel``: the activation's, if any)."""
        self._engaged = True
        self._kernel = kernel

    def disengage(self) -> None:
        """Back to ``inner``'s own call."""
        self._engaged = False
        self._kernel = None

    @property
    def engaged(self) -> bool:
        """Whether calls compute the vectorised form now."""
        return self._engaged

    def __call__(self, x: mx.array) -> mx.array:
        """The MLP's output for ``x`` (``(..., hidden)``)."""
        inner: Any = self.inner
        if not self._engaged:
            return cast(mx.array, inner(x))
        projections = (inner.gate_proj, inner.up_proj, inner.down_proj)
        rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        if x.dtype == mx.float32 and all(_plain_product(p, rows) for p in projections):
            return self._transposed(x, *projections)
        gate = inner.gate_proj(x)
        if gate.dtype != mx.float32:
            return cast(mx.array, inner(x))
        activated = _activate(self.activation, gate, inner.up_proj(x), self._kernel)
        return cast(mx.array, inner.down_proj(activated))

    def _transposed(self, x: mx.array, gate: Any, up: Any, down: Any) -> mx.array:
        """The product with tokens as columns: ``W @ x.T``, MKL's faster order here.

        Gemma 3 270M, 2-core x86_64: a 1024-token prefill 2.12-2.33 against 2.47-2.49 s,
        a 16-row decode step 152-159 against 159-169 ms (the vocabulary head's order of
        :func:`kv_batching._model_forward.project_rows`, for the same reason).
        """
        columns = x.reshape(-1, x.shape[-1]).T
        g = gate.weight @ columns
        u = up.weight @ columns
        if "bias" in gate:
            g = g + gate.bias[:, None]
        if "bias" in up:
            u = u + up.bias[:, None]
        out = (down.weight @ _activate(self.activation, g, u, self._kernel)).T
        if "bias" in down:
            out = out + down.bias
        return cast(mx.array, out.reshape(*x.shape[:-1], out.shape[-1]))


def _plain_product(module: object, rows: int) -> bool:
    """Whether ``module`` computes ``rows`` rows as ``nn.Linear`` does (its weight's product).

    An ``nn.Linear`` subclass with an integer ``max_rows`` (kv-serve's ``KernelLinear``)
    computes up to that many rows its own way and more rows as ``nn.Linear``.
    """
    if type(module) is nn.Linear:
        return True
    limit = getattr(module, "max_rows", None)
    return isinstance(module, nn.Linear) and isinstance(limit, int) and rows > limit


def _linear(module: object) -> bool:
    return type(module) in (nn.Linear, nn.QuantizedLinear) or _plain_product(module, 1 << 62)


def _gate_width(module: Any) -> int:
    gate = module.gate_proj
    if type(gate) is nn.QuantizedLinear:
        return int(gate.scales.shape[0])
    return int(gate.weight.shape[0])


def _hidden_width(module: Any) -> int:
    gate = module.gate_proj
    weight = gate.weight
    if type(gate) is nn.QuantizedLinear:
        return int(weight.shape[1] * 32 // gate.bits)
    return int(weight.shape[1])


def _probe(module: Any) -> str | None:
    """Which activation makes :class:`FastGatedMLP` equal ``module`` on probe inputs, if any."""
    hidden = _hidden_width(module)
    key = mx.random.key(20261205)
    x = mx.random.normal((2, 3, hidden), key=key)
    # Inputs at a few scales put the gate's pre-activations across both tails and the knee.
    probes = [x * scale for scale in (0.25, 1.0, 4.0)]
    try:
        expected = [module(p) for p in probes]
        mx.eval(expected)
        if any(
            e.dtype != mx.float32 or e.shape != p.shape
            for e, p in zip(expected, probes, strict=True)
        ):
            return None
        for activation in GATED_ACTIVATIONS:
            candidate = FastGatedMLP(module, activation)
            candidate.engage()
            got = [candidate(p) for p in probes]
            if all(
                bool(
                    mx.allclose(
                        g, e, rtol=1e-4, atol=1e-5 * float(cast(float, mx.abs(e).max().item()))
                    )
                )
                for g, e in zip(got, expected, strict=True)
            ):
                return activation
    except Exception:  # a module the gated form does not fit keeps its own call
        return None
    return None


def _mlp_child(layer: Any) -> tuple[str, Any] | None:
    for name in _MLP_CHILD_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, FastGatedMLP) or (
            child is not None
            and all(_linear(getattr(child, p, None)) for p in ("gate_proj", "up_proj", "down_proj"))
        ):
            return name, child
    return None


class FastMLPs:
    """The change that swaps a model's gated MLPs for :class:`FastGatedMLP` modules.

    See the module docstring for where a swap is made; ``kernel`` (the engine kernel set's
    ``gated_activation``) computes the activations while the change is engaged.
    """

    name = "fast MLPs"

    def __init__(
        self,
        *,
        min_width: int = FAST_MLP_MIN_WIDTH,
        kernel: GatedActivationKernel | None = None,
    ) -> None:
        self.min_width = min_width
        self.kernel = kernel
        self._held: list[FastGatedMLP] = []

    def install(self, model: nn.Module) -> ChangeReport:
        """Swap each gated MLP of ``model``'s decoder layers its probe accepts."""
        if mx.default_device().type != mx.cpu:
            return self._report(0, "only on MLX's CPU device")
        try:
            layers = find_layers(model)
        except Exception as error:
            return self._report(0, f"no decoder layers found ({error})")
        refused: list[str] = []
        self._held = []  # what the model holds now, counted once however often installed
        for index, layer in enumerate(layers):
            found = _mlp_child(layer)
            if found is None:
                continue
            name, child = found
            if isinstance(child, FastGatedMLP):
                self._held.append(child)
                continue
            if _gate_width(child) < self.min_width:
                refused.append(f"layer {index}: gate narrower than {self.min_width}")
                continue
            activation = _probe(child)
            if activation is None:
                refused.append(f"layer {index}: neither SiLU nor tanh-GELU matches its output")
                continue
            swapped = FastGatedMLP(child, activation)
            setattr(layer, name, swapped)
            self._held.append(swapped)
        if not refused and not self._held:
            refused.append("no gated MLP (gate_proj, up_proj, down_proj) found")
        return self._report(len(self._held), "; ".join(refused[:3]) or None)

    def _report(self, installed: int, reason: str | None) -> ChangeReport:
        return ChangeReport(name=self.name, installed=installed, reason=reason)

    def uninstall(self, model: nn.Module) -> int:
        """Put the original MLP modules back; returns how many were restored."""
        self._held.clear()
        return unpatch_model_mlps(model)

    def engage(self, *, prefill: bool) -> None:
        """The swapped MLPs compute the vectorised form (in prompt chunks and decode steps)."""
        for module in self._held:
            module.engage(self.kernel)

    def disengage(self) -> None:
        """The swapped MLPs are their modules' own calls again."""
        for module in self._held:
            module.disengage()


def patch_model_mlps(model: nn.Module, *, min_width: int = FAST_MLP_MIN_WIDTH) -> int:
    """Swap each gated MLP of ``model``'s decoder layers for a :class:`FastGatedMLP`.

    :class:`FastMLPs`' install, for use outside an engine; returns how many layers hold a
    :class:`FastGatedMLP` afterwards.
    """
    return FastMLPs(min_width=min_width).install(model).installed


def unpatch_model_mlps(model: nn.Module) -> int:
    """Put the original MLP modules back; returns how many were restored."""
    try:
        return unwrap_layer_children(model, _MLP_CHILD_NAMES, FastGatedMLP)
    except Exception:  # a model without decoder layers holds no swapped MLP
        return 0
