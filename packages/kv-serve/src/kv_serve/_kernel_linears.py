"""Linear layers that project a few rows through the native CPU kernel's quantized codes.

A decode step multiplies a handful of rows by every weight matrix of the model; on the CPU
that product is bound by reading the weights, so reading a GGUF's 4- or 8-bit codes
instead of float32 values makes it several times cheaper (``kv_metal_kernels``'
``CpuQuantizedHead``: the same kernel as the vocabulary head's). A prompt's many rows are
bound by arithmetic instead, where MKL's float32 product is faster than the kernel, so a
:class:`KernelLinear` keeps both: the layer's float32 weight for more than ``max_rows``
rows and the codes (the same values) for up to ``max_rows``. Each kernel product is an
evaluation point of MLX's lazy graph (its input is evaluated first).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from kv_protocol import QuantizedHeadKernel

from ._gguf import KERNEL_CODES_FILE

__all__ = ["KERNEL_MAX_ROWS", "KernelLinear", "attach_kernel_codes"]

#: The most rows a :class:`KernelLinear` sends to the kernel by default. Gemma 3 270M's
#: decode step on a 2-core x86_64 with MKL, engines with each limit in one process, steps
#: alternating, the kernel prefetching its next tiles: 14 rows 152 ms with 16 against 187
#: with 12 (float32 from 13 rows), 16 rows 139 against 150, 20 rows 198 with 32 against
#: 212, 24 rows 189 against 198, 32 rows 264 against 269. (Before the prefetch the kernel
#: lost from 16 rows: 186 against 175 ms.)
KERNEL_MAX_ROWS = 32


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


def attach_kernel_codes(
    model: nn.Module,
    directory: Path,
    kernel: QuantizedHeadKernel,
    *,
    max_rows: int = KERNEL_MAX_ROWS,
) -> int:
    """Replace ``model``'s float linear layers that have codes in ``directory``; returns how many.

    ``directory`` is a ``convert_gguf(keep_quantized="dual")`` conversion (no codes file:
    nothing is replaced). A layer is replaced only where it is a float32 ``nn.Linear`` whose
    weight has the codes' shape and ``kernel`` serves the codes; others stay as they are.
    """
    path = directory / KERNEL_CODES_FILE
    if not path.exists():
        return 0
    described = json.loads((directory / "kv-serve.json").read_text()).get("kernel_codes", {})
    arrays = cast(dict[str, mx.array], mx.load(str(path)))
    modules = dict(model.named_modules())
    replaced: list[tuple[str, Any]] = []
    for name, form in sorted(described.items()):
        layer = modules.get(name)
        if type(layer) is not nn.Linear or layer.weight.dtype != mx.float32:
            continue
        codes = arrays[f"{name}.codes"]
        bits, group = int(form["bits"]), int(form["group_size"])
        if (
            codes.shape[0] != layer.weight.shape[0]
            or codes.shape[1] * 32 // bits != (layer.weight.shape[1])
        ):
            continue
        projection = kernel.prepare(
            codes,
            arrays[f"{name}.scales"],
            arrays[f"{name}.biases"],
            group_size=group,
            bits=bits,
        )
        if projection is None:
            continue
        bias = layer.get("bias")
        replaced.append((name, KernelLinear(layer.weight, bias, projection, max_rows=max_rows)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)
