"""Linear layers that project a few rows through the native CPU kernel's quantized codes.

A decode step multiplies a handful of rows by every weight matrix of the model; on the CPU
that product is bound by reading the weights, so reading a GGUF's 4- or 8-bit codes
instead of float32 values makes it several times cheaper (:func:`linear_kernel`:
``kv_metal_kernels``' ``CpuQuantizedLinear``, which lays each layer out 16 output rows a
vector, or where that does not build, ``CpuQuantizedHead``, the vocabulary head's kernel,
which reads the codes as they are). A prompt's many rows are bound by arithmetic instead:
there the head kernel is slower than MKL's float32 product, ``CpuQuantizedLinear`` faster
(:data:`LINEAR_MAX_ROWS`). A :class:`KernelLinear` keeps both: the layer's float32 weight
for more than ``max_rows`` rows (and other dtypes) and the codes (the same values) for up
to ``max_rows``. Each kernel product is a node of MLX's lazy graph where the graph calls
build, else an evaluation point.

Sibling layers that read the same input in one forward (attention's ``q_proj``, ``k_proj``
and ``v_proj``; a gated MLP's ``gate_proj`` and ``up_proj``) share one kernel product over
their codes stacked (:class:`SiblingRows`): one call instead of three or two, whose outputs
are the separate products' bits (the kernel computes each output from its own row and the
input alone). Gemma 3 270M, 2-core x86_64, a layer's q/k/v at 1 / 4 / 16 rows 77 / 112 /
352 us against 120 / 161 / 413 separately, gate/up 118 / 292 / 1018 against 134 / 305 / 1091.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from kv_batching import ChangeReport, ModelSurgery
from kv_metal_kernels import CpuQuantizedHead, CpuQuantizedLinear
from kv_protocol import QuantizedHeadKernel

from ._gguf import KERNEL_CODES_FILE

__all__ = [
    "KERNEL_MAX_ROWS",
    "LINEAR_MAX_ROWS",
    "SIBLING_LAYERS",
    "KernelCodes",
    "KernelLinear",
    "SiblingRows",
    "attach_kernel_codes",
    "kernel_max_rows",
    "linear_kernel",
]

#: Names of sibling linear layers under one module that mlx-lm's forwards call in this order
#: on the same input: their kernel products are computed together (:class:`SiblingRows`).
SIBLING_LAYERS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)

#: The most rows a :class:`KernelLinear` sends to the kernel by default. Gemma 3 270M's
#: decode step on a 2-core x86_64 with MKL, engines with each limit in one process, steps
#: alternating, the kernel prefetching its next tiles: 14 rows 152 ms with 16 against 187
#: with 12 (float32 from 13 rows), 16 rows 139 against 150, 20 rows 198 with 32 against
#: 212, 24 rows 189 against 198, 32 rows 264 against 269. (Before the prefetch the kernel
#: lost from 16 rows: 186 against 175 ms.)
KERNEL_MAX_ROWS = 32

#: The most rows a :class:`KernelLinear` sends to ``CpuQuantizedLinear`` (every prompt
#: chunk). With AVX-512 it is faster than MLX's float32 product with MKL at every row count
#: measured (2-core AMD EPYC with AVX-512, where MKL runs its AVX2 code: Gemma 3 270M's 640
#: x 4096 8-bit layer 234 / 877 / 3420 / 7052 us at 16 / 64 / 256 / 512 rows against 717 /
#: 2100 / 6929 / 15464 us; its 16 x 128-token prompts 1042 against 601 tok/s, the same
#: tokens). With AVX2 alone (2-core AMD EPYC) it wins up to about 64 rows and is 1.2-1.3x
#: slower from 128 (``tools/bench_cpu_linear.py``), but a whole 1,024-token Gemma 3 270M
#: prompt runs about as fast as with the float32 layers from 16 rows (245-294 against
#: 284-356 tok/s, noisy) and the float32 weights need not be held: one limit for both.
LINEAR_MAX_ROWS = 1 << 16


class KernelLinear(nn.Linear):
    """``nn.Linear``'s product, through quantized codes for up to ``max_rows`` float32 rows.

    ``weight`` (and ``bias``) are the layer's float32 parameters, used for larger products
    and other dtypes; ``projection`` maps ``(M, input_dims)`` float32 rows to
    ``(M, output_dims)`` through codes of the same values (``QuantizedHeadKernel.prepare``).
    An ``nn.Linear`` to everything that inspects it; :attr:`max_rows` tells kv-batching's
    fused forms (``FastGatedMLP``) which products are ``nn.Linear``'s own.
    """

    def __init__(
        self,
        weight: mx.array,
        bias: mx.array | None,
        projection: Callable[[mx.array], mx.array],
        *,
        max_rows: int = KERNEL_MAX_ROWS,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would draw random weights first
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self._projection = projection
        self._max_rows = max_rows

    @property
    def max_rows(self) -> int:
        """The most rows the kernel projects; more rows are ``nn.Linear``'s product."""
        return self._max_rows

    @property
    def codes_nbytes(self) -> int:
        """The bytes the kernel's codes take beside the float32 weight (0 if unknown)."""
        return int(getattr(self._projection, "nbytes", 0))

    def __call__(self, x: mx.array) -> mx.array:
        """``x @ weight.T + bias``; up to ``max_rows`` float32 rows through the kernel."""
        width = x.shape[-1] if x.ndim >= 2 else 0
        rows = x.size // width if width else 0
        if 0 < rows <= self._max_rows and x.dtype == mx.float32:
            out = self._projection(x)
            return out + self["bias"] if "bias" in self else out
        return super().__call__(x)


class SiblingRows:
    """One kernel product for sibling layers that read the same input: their rows stacked.

    ``fused`` projects the siblings' codes stacked in order (``bounds[i]``: sibling ``i``'s
    output columns of it), ``parts[i]`` sibling ``i``'s codes alone (views of the same
    buffers). :meth:`project` for sibling 0 computes the stacked product and keeps it with
    its input (called again on that input, it takes it again); the next siblings called
    on that same input object take their columns of it, in order. A sibling called on
    another input, or out of order, computes its own rows alone, and when the
    stacked product was not used up by every sibling before sibling 0 came again (a
    forward that skips a sibling, as layers sharing another layer's K/V), the siblings
    project apart from then on: nothing is computed twice, nothing for nothing twice.
    Like MLX's own graph, it trusts that an array is not written in place while held.
    """

    def __init__(
        self,
        fused: Callable[[mx.array], mx.array],
        parts: Sequence[Callable[[mx.array], mx.array]],
        bounds: Sequence[tuple[int, int]],
    ) -> None:
        if len(parts) != len(bounds) or len(parts) < 2:
            raise ValueError("siblings need a part and bounds each, at least two of them")
        self._fused = fused
        self._parts = list(parts)
        self._bounds = list(bounds)
        self._together = True
        # The stacked product's input and value, and the next sibling expected to use it.
        self._held: tuple[mx.array, mx.array, int] | None = None

    @property
    def together(self) -> bool:
        """Whether the siblings still share one product (else each projects its own rows)."""
        return self._together

    def nbytes(self, index: int) -> int:
        """The bytes of sibling ``index``'s codes."""
        return int(getattr(self._parts[index], "nbytes", 0))

    def project(self, index: int, x: mx.array) -> mx.array:
        """Sibling ``index``'s product of ``x`` (``(..., in) -> (..., out_index)``)."""
        held = self._held
        if index == 0 and self._together:
            if held is not None and held[0] is x:  # the same input again: the same product
                self._held = (x, held[1], 1)
                return self._column(held[1], 0)
            if held is not None:  # the last stacked product was not used up
                self._together = False
                self._held = None
                return self._parts[0](x)
            out = self._fused(x)
            self._held = (x, out, 1)
            return self._column(out, 0)
        if held is not None and held[0] is x and held[2] == index:
            self._held = None if index + 1 == len(self._parts) else (x, held[1], index + 1)
            return self._column(held[1], index)
        return self._parts[index](x)

    def _column(self, out: mx.array, index: int) -> mx.array:
        start, stop = self._bounds[index]
        return out[..., start:stop]


class _Sibling:
    """Sibling ``index`` of a :class:`SiblingRows` as a ``KernelLinear`` projection."""

    def __init__(self, rows: SiblingRows, index: int) -> None:
        self._rows = rows
        self._index = index

    @property
    def nbytes(self) -> int:
        """The bytes of this sibling's codes."""
        return self._rows.nbytes(self._index)

    def __call__(self, x: mx.array) -> mx.array:
        return self._rows.project(self._index, x)


def _sibling_sets(names: Sequence[str]) -> list[list[str]]:
    """The groups of ``names`` that are one module's :data:`SIBLING_LAYERS`, all present."""
    present = set(names)
    found: list[list[str]] = []
    parents = sorted({name.rpartition(".")[0] for name in names})
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for children in SIBLING_LAYERS:
            full = [prefix + child for child in children]
            if all(name in present for name in full):
                found.append(full)
    return found


def linear_kernel() -> CpuQuantizedLinear | CpuQuantizedHead:
    """The kernel that projects the linear layers' codes here.

    ``kv_metal_kernels.CpuQuantizedLinear`` where it builds (a 640 x 4096 4-bit layer, the
    shape of Gemma 3 270M's fused gate and up projections, on a 2-core x86_64: 32 / 65 /
    200 us at 1 / 4 / 16 rows against 64 / 134 / 465 us through the head kernel), else
    ``CpuQuantizedHead``.
    """
    linear = CpuQuantizedLinear()
    return linear if linear.library.handle is not None else CpuQuantizedHead()


def kernel_max_rows(kernel: QuantizedHeadKernel) -> int:
    """The most rows the linear layers send to ``kernel`` (its measured crossover).

    :data:`LINEAR_MAX_ROWS` for ``CpuQuantizedLinear``, :data:`KERNEL_MAX_ROWS` for another
    kernel (the head's).
    """
    return LINEAR_MAX_ROWS if isinstance(kernel, CpuQuantizedLinear) else KERNEL_MAX_ROWS


class KernelCodes:
    """The change that replaces a model's float linear layers by :class:`KernelLinear` ones.

    A ``kv_batching.ModelChange``: ``directory`` is a ``convert_gguf(keep_quantized="dual")``
    conversion (no codes file: nothing is replaced). A layer is replaced only where it is a
    float32 ``nn.Linear`` whose weight has the codes' shape and ``kernel`` serves the codes;
    others stay as they are, and a :class:`KernelLinear` already there counts as installed.
    ``max_rows`` (default :func:`kernel_max_rows`) is the most rows the kernel projects.
    :meth:`uninstall` puts plain ``nn.Linear`` layers back, holding the same weight and bias.
    """

    name = "kernel linears"

    def __init__(
        self, directory: Path, kernel: QuantizedHeadKernel, *, max_rows: int | None = None
    ) -> None:
        self.directory = directory
        self.kernel = kernel
        self.max_rows = kernel_max_rows(kernel) if max_rows is None else max_rows
        self._replaced: list[str] = []

    def _report(self, installed: int, reason: str | None) -> ChangeReport:
        return ChangeReport(name=self.name, installed=installed, reason=reason)

    def install(self, model: nn.Module) -> ChangeReport:
        """Replace every layer that has codes the kernel serves."""
        directory, kernel = self.directory, self.kernel
        path = directory / KERNEL_CODES_FILE
        if not path.exists():
            return self._report(0, f"no {KERNEL_CODES_FILE} in the model directory")
        described = json.loads((directory / "kv-serve.json").read_text()).get("kernel_codes", {})
        arrays = cast(dict[str, mx.array], mx.load(str(path)))
        modules = dict(model.named_modules())
        usable: dict[str, tuple[int, int]] = {}  # name -> (bits, group size)
        held = []
        for name, form in sorted(described.items()):
            layer = modules.get(name)
            if isinstance(layer, KernelLinear):
                held.append(name)  # replaced already: counts as installed
                continue
            if type(layer) is not nn.Linear or layer.weight.dtype != mx.float32:
                continue
            codes = arrays[f"{name}.codes"]
            bits, group = int(form["bits"]), int(form["group_size"])
            if (
                codes.shape[0] != layer.weight.shape[0]
                or codes.shape[1] * 32 // bits != (layer.weight.shape[1])
            ):
                continue
            usable[name] = (bits, group)
        projections: dict[str, Callable[[mx.array], mx.array]] = {}
        for names in _sibling_sets(list(usable)):
            forms = {usable[name] for name in names}
            widths = {int(modules[name].weight.shape[1]) for name in names}
            if len(forms) == 1 and len(widths) == 1:
                projections.update(_siblings(names, arrays, kernel, *forms.pop()))
        for name, (bits, group) in usable.items():
            if name not in projections:
                single = kernel.prepare(
                    arrays[f"{name}.codes"],
                    arrays[f"{name}.scales"],
                    arrays[f"{name}.biases"],
                    group_size=group,
                    bits=bits,
                )
                if single is not None:
                    projections[name] = single
        replaced: list[tuple[str, Any]] = []
        for name, projection in sorted(projections.items()):
            layer = modules[name]
            bias = layer.get("bias")
            replaced.append(
                (name, KernelLinear(layer.weight, bias, projection, max_rows=self.max_rows))
            )
        if replaced:
            model.update_modules(tree_unflatten(replaced))
        self._replaced += [*held, *(name for name, _ in replaced)]
        left = len(described) - len(self._replaced)
        reason = f"{left} layers with codes kept their float product" if left else None
        return self._report(len(self._replaced), reason)

    def uninstall(self, model: nn.Module) -> int:
        """Put plain ``nn.Linear`` layers back (the same weight and bias); returns how many."""
        modules = dict(model.named_modules())
        restored: list[tuple[str, Any]] = []
        for name in self._replaced:
            layer = modules.get(name)
            if isinstance(layer, KernelLinear):
                plain = nn.Linear(1, 1, bias="bias" in layer)
                plain.weight = layer.weight
                if "bias" in layer:
                    plain.bias = layer["bias"]
                restored.append((name, plain))
        if restored:
            model.update_modules(tree_unflatten(restored))
        self._replaced = []
        return len(restored)


def attach_kernel_codes(
    model: nn.Module,
    directory: Path,
    kernel: QuantizedHeadKernel,
    *,
    max_rows: int | None = None,
) -> int:
    """Replace ``model``'s float linear layers that have codes in ``directory``; returns how many.

    :class:`KernelCodes`' install through a ``kv_batching.ModelSurgery`` (what ``load_model``
    does with a dual conversion): the loaded model keeps them.
    """
    return ModelSurgery(model).install(KernelCodes(directory, kernel, max_rows=max_rows)).installed


def _siblings(
    names: Sequence[str],
    arrays: dict[str, mx.array],
    kernel: QuantizedHeadKernel,
    bits: int,
    group: int,
) -> dict[str, Callable[[mx.array], mx.array]]:
    """The projections of sibling layers ``names`` sharing one :class:`SiblingRows` (or none).

    The stacked codes are one buffer; each sibling's own projection is a view of its rows
    (``QuantizedHeadProjection.rows``; another kernel's projections are not stacked).
    """
    stacked = [
        mx.concatenate([arrays[f"{name}.{part}"] for name in names])
        for part in ("codes", "scales", "biases")
    ]
    fused = kernel.prepare(*stacked, group_size=group, bits=bits)
    view: Any = getattr(fused, "rows", None)
    if fused is None or not callable(view):
        return {}
    bounds: list[tuple[int, int]] = []
    start = 0
    for name in names:
        stop = start + int(arrays[f"{name}.codes"].shape[0])
        bounds.append((start, stop))
        start = stop
    try:
        parts = [view(*b) for b in bounds]
    except ValueError:  # a sibling's rows do not start where the kernel's views can
        return {}
    rows = SiblingRows(fused, parts, bounds)
    return {name: _Sibling(rows, index) for index, name in enumerate(names)}
