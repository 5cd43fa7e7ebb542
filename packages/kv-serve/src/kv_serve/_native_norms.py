"""RMS norms of a model computed as one native graph node each on MLX's CPU backend.

``mx.fast.rms_norm`` is about ten scheduled operations on MLX's CPU backend, and a decode
step of a small model runs a hundred norms: :class:`NativeNorms` (a
``kv_batching.ModelChange``: ``build_engine`` hands it to the engine, whose ``close`` puts
the model's norms back) swaps each norm module whose output ``kv_metal_kernels.CpuRmsNorm``
reproduces bit for bit (checked on a probe, with its weight as it is or plus one: Gemma's
form) for a :class:`NativeRMSNorm` holding the same ``weight`` and ``eps``. The model
computes the same values; other devices and dtypes take ``mx.fast.rms_norm``.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from kv_batching import ChangeReport
from kv_metal_kernels import CpuRmsNorm

__all__ = ["NativeNorms", "NativeRMSNorm", "attach_native_norms"]


class NativeRMSNorm(nn.Module):
    """``mx.fast.rms_norm(x, weight (+ 1), eps)``: a native node for float32 on the CPU.

    ``weight`` and ``eps`` are the replaced module's (same parameter path); ``add_one``
    scales by ``1 + weight`` as Gemma's norms do.
    """

    def __init__(self, weight: mx.array, eps: float, *, add_one: bool, kernel: CpuRmsNorm) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.weight = weight
        self.eps = eps
        self.add_one = add_one
        self._kernel = kernel

    def __call__(self, x: mx.array) -> mx.array:
        """The normalised ``x (..., dims)``."""
        weight = self.weight
        if (
            x.dtype == mx.float32
            and weight.dtype == mx.float32
            and x.ndim >= 1
            and x.shape[-1] == weight.shape[0]
            and mx.default_device().type == mx.cpu
        ):
            return self._kernel(x, weight, self.eps, add_one=self.add_one)
        return mx.fast.rms_norm(x, 1.0 + weight if self.add_one else weight, self.eps)


class NativeNorms:
    """The change that swaps a model's RMS norms for :class:`NativeRMSNorm` where bit-exact.

    Only on MLX's CPU device with the kernel available; a candidate is a module with a
    one-dimensional float32 ``weight``, a float ``eps``, no ``bias`` and a call of ``x``
    alone, swapped only where its output on a probe equals the kernel's bit for bit.
    Modules already swapped count as installed; :meth:`uninstall` puts back the ones this
    change swapped.
    """

    name = "native norms"

    def __init__(self, kernel: CpuRmsNorm | None = None) -> None:
        self.kernel = kernel
        self._originals: list[tuple[str, nn.Module]] = []

    def install(self, model: nn.Module) -> ChangeReport:
        """Swap every norm the probe accepts."""
        kernel = self.kernel = self.kernel or CpuRmsNorm()
        if mx.default_device().type != mx.cpu:
            return self._report(0, "only on MLX's CPU device")
        if not kernel.available:
            return self._report(0, "the native CPU kernels did not build here")
        held = 0
        swaps: list[tuple[str, NativeRMSNorm]] = []
        for name, module in model.named_modules():
            if isinstance(module, NativeRMSNorm):
                held += 1
                continue
            form = _probe(module, kernel)
            if form is not None and name:
                weight = module["weight"]
                swaps.append((name, NativeRMSNorm(weight, module.eps, add_one=form, kernel=kernel)))
                self._originals.append((name, module))
        if swaps:
            model.update_modules(tree_unflatten(list(swaps)))
        installed = held + len(swaps)
        return self._report(installed, None if installed else "no RMS norm matched the kernel")

    def _report(self, installed: int, reason: str | None) -> ChangeReport:
        return ChangeReport(name=self.name, installed=installed, reason=reason)

    def uninstall(self, model: nn.Module) -> int:
        """Put back the norm modules this change swapped; returns how many."""
        originals, self._originals = self._originals, []
        if originals:
            model.update_modules(tree_unflatten(originals))
        return len(originals)


def attach_native_norms(model: nn.Module, kernel: CpuRmsNorm | None = None) -> int:
    """Swap ``model``'s RMS norms the native kernel reproduces; returns how many it holds.

    :class:`NativeNorms`' install, for a model used outside an engine (kept swapped).
    """
    return NativeNorms(kernel).install(model).installed


def _takes_one_argument(module: nn.Module) -> bool:
    """Whether the module is called with ``x`` alone (a gated norm takes a second input)."""
    try:
        parameters = list(inspect.signature(module.__call__).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def _probe(module: nn.Module, kernel: CpuRmsNorm) -> bool | None:
    """``add_one`` under which the kernel equals ``module``, else ``None``."""
    weight: Any = module.get("weight")
    eps: Any = getattr(module, "eps", None)
    if (
        not isinstance(weight, mx.array)
        or weight.ndim != 1
        or weight.dtype != mx.float32
        or not isinstance(eps, float)
        or "bias" in module
        or module.children()
        or not _takes_one_argument(module)
    ):
        return None
    x = mx.random.normal((3, weight.shape[0]), key=mx.random.key(7)) * 3.0
    try:
        want = module(x)
        if not isinstance(want, mx.array) or want.shape != x.shape or want.dtype != mx.float32:
            return None
        for add_one in (False, True):
            if mx.array_equal(kernel(x, weight, eps, add_one=add_one), want).item():
                return add_one
    except Exception:  # a norm of another form (gated, two inputs): not this kernel's
        return None
    return None
