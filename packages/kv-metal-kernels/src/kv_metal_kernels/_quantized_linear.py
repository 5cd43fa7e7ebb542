"""A model's affine-quantized linear layers projected on the CPU.

A decode step multiplies a few rows by every linear layer of the model. :class:`CpuQuantizedHead`
reads MLX's layout (an output row's codes together) and sums each output across a vector's
lanes; for a layer's few hundred or thousand outputs that costs a horizontal sum per output
and a code conversion per output and input row. :class:`CpuQuantizedLinear`
(``kv_protocol.QuantizedHeadKernel``) lays the layer out once, 16 output rows a vector
(:mod:`~kv_metal_kernels._quantized_linear_source`), so each input's 16 codes are converted
once for up to 8 input rows and multiplied into 16 outputs at a time, and each group's scale
and bias are applied once to the group's sum. On a 2-core x86_64 (AVX-512), a 640 x 4096
4-bit product (the shape of Gemma 3 270M's fused gate and up projections) takes 32 / 65 /
200 us at 1 / 4 / 16 rows against 64 / 134 / 465 us through the head's layout, and many rows
run faster than MLX's float32 product with MKL there (kv-serve sends prompts to it too).
Built for AVX2 without AVX-512 its tiles run as 8-lane halves
(:attr:`CpuQuantizedLinear.vector_bits`): a 2048 x 640 8-bit layer 154 / 477 / 14706 us at 1
/ 16 / 512 rows on a 2-core AMD EPYC, against 616 / 3182 / 93574 us as 16-lane vectors the
compiler split (MKL's float32 product: 193 / 749 / 11045 us).
Its outputs are the float32 product to float rounding, not the head kernel's bits (the sums
run in another order).
"""

from __future__ import annotations

import copy
import ctypes
import time
from typing import Any, cast

import mlx.core as mx

from kv_protocol import EVALUATION_CLOCK

from ._cpu_library import CpuLibrary, build_cpu_library
from ._graph_call import GraphEntry, graph_entry
from ._quantized_head import _address, affine_layout
from ._quantized_linear_source import QUANTIZED_LINEAR_SOURCE

__all__ = ["CpuQuantizedLinear", "QuantizedLinearProjection"]

#: Output rows a tile of the layout (a vector's lanes); a :meth:`~QuantizedLinearProjection.rows`
#: view starts at a multiple of it.
TILE_ROWS = 16


class QuantizedLinearProjection:
    """``rows (..., in) float32 -> (..., out) float32`` through the native kernel's layout.

    Holds the layer's codes laid out 16 output rows a vector, with float32 scales and
    biases per group (``nbytes``); the codes it was made from are not kept.
    """

    def __init__(
        self,
        library: ctypes.CDLL,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        *,
        group_size: int,
        bits: int,
    ) -> None:
        self._library = library
        self._graph: GraphEntry | None = None
        #: Output rows (the layer's ``output_dims``).
        self.vocab = int(weight.shape[0])
        #: Input width.
        self.hidden = int(weight.shape[1]) * 32 // bits
        self.group_size = group_size
        self.bits = bits
        tiles = self._tiles = -(-self.vocab // TILE_ROWS)
        groups = tiles * TILE_ROWS * (self.hidden // group_size)
        self._arrays = [
            mx.zeros((tiles * TILE_ROWS * self.hidden * bits // 8,), dtype=mx.uint8),
            mx.zeros((groups,), dtype=mx.float32),
            mx.zeros((groups,), dtype=mx.float32),
        ]
        source = [mx.contiguous(weight), mx.contiguous(scales.astype(mx.float32))]
        source.append(mx.contiguous(biases.astype(mx.float32)))
        mx.eval(*self._arrays, *source)
        layout = library.kv_qlinear_layout
        layout.restype = ctypes.c_int
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        layout.argtypes = [*[pointer] * 3, *[integer] * 4, *[pointer] * 3]
        symmetric = layout(
            *(_address(a) for a in source),
            self.vocab,
            self.hidden,
            group_size,
            bits,
            *(_address(a) for a in self._arrays),
        )
        #: Whether the bias term is computed (a symmetric layer's laid-out biases are zero).
        self.biased = not symmetric
        self._fn = library.kv_qlinear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [pointer, integer, integer, *[pointer] * 3, *[integer] * 4, pointer]
        self._tile0 = 0  # the layout's first tile this projection reads (rows())

    @property
    def nbytes(self) -> int:
        """The bytes of the layout's codes, scales and biases of its rows.

        A :meth:`rows` view counts its own tiles' share of the buffers it reads.
        """
        mine = -(-self.vocab // TILE_ROWS)
        return sum(a.nbytes for a in self._arrays) * mine // self._tiles

    def rows(self, start: int, stop: int) -> QuantizedLinearProjection:
        """The projection onto output rows ``start .. stop - 1``, reading the same buffers.

        ``start`` must be a multiple of 16 (a tile of the layout); the outputs are those
        columns of this projection's, bit for bit. Nothing is copied.
        """
        if not 0 <= start < stop <= self.vocab or start % TILE_ROWS:
            raise ValueError(
                f"rows must be a non-empty range within 0 .. {self.vocab} starting at a "
                f"multiple of {TILE_ROWS}, got {start} .. {stop}"
            )
        view = copy.copy(self)
        view.vocab = stop - start
        view._tile0 = self._tile0 + start // TILE_ROWS
        return view

    def __call__(self, rows: mx.array) -> mx.array:
        """The products of ``rows (..., hidden)``, ``(..., vocab)`` float32.

        A node of MLX's lazy graph where the graph calls are available on the CPU device
        (:mod:`~kv_metal_kernels._graph_call`); otherwise ``rows`` are evaluated here and
        the seconds go to ``kv_protocol.EVALUATION_CLOCK``.
        """
        if rows.ndim < 2 or rows.shape[-1] != self.hidden or rows.dtype != mx.float32:
            raise ValueError(
                f"the quantized linear kernel projects float32 rows of {self.hidden} values, "
                f"got {rows.dtype} rows of shape {tuple(rows.shape)}"
            )
        shape = (*rows.shape[:-1], self.vocab)
        m = rows.size // self.hidden
        if m == 0:
            return mx.zeros(shape, dtype=mx.float32)
        params = [m, self.hidden, self.vocab, self.group_size, self.bits, self._tile0]
        params.append(int(self.biased))
        graph = self._graph
        if graph is None:
            graph = self._graph = graph_entry(self._library, "kv_qlinear_call")
        if graph and mx.default_device().type == mx.cpu:
            calls, kernel = graph
            return calls.call(kernel, "KvQuantizedLinear", [rows, *self._arrays], params, shape)
        tic = time.perf_counter()
        rows = mx.contiguous(rows)
        mx.eval(rows)
        groups = self.hidden // self.group_size
        offsets = (self.hidden * self.bits // 8, 4 * groups, 4 * groups)
        buffers = [
            _address(a) + self._tile0 * TILE_ROWS * n
            for a, n in zip(self._arrays, offsets, strict=True)
        ]
        out = bytearray(4 * m * self.vocab)
        status = self._fn(
            _address(rows),
            m,
            self.hidden,
            *buffers,
            self.vocab,
            self.group_size,
            self.bits,
            int(self.biased),
            ctypes.addressof(ctypes.c_char.from_buffer(out)),
        )
        if status != 0:
            raise MemoryError(f"the quantized linear kernel could not allocate {m} rows")
        result = mx.array(cast(Any, memoryview(out).cast("f", shape)))
        EVALUATION_CLOCK.add(time.perf_counter() - tic)
        return result


class CpuQuantizedLinear:
    """``kv_protocol.QuantizedHeadKernel`` for a model's linear layers on the CPU.

    :meth:`prepare` serves affine layers of 4 or 8 bits whose group size is even and
    divides the input width, when the kernel builds on this machine (:attr:`library` says
    how it was built, or why not).
    """

    name = "cpu-linear"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return build_cpu_library("kv_qlinear", QUANTIZED_LINEAR_SOURCE)

    @property
    def vector_bits(self) -> int:
        """The width of the vectors the built kernel computes with: 512 (AVX-512), 256 (AVX2).

        0 where the kernel is not built or its vectors are the compiler's lowering (another
        CPU). How many rows the kernel is worth sending depends on it: with 512-bit vectors
        it beats MKL's float32 product at every row count measured, with 256-bit vectors
        only at decode-sized ones (``tools/bench_cpu_linear.py``).
        """
        handle = self.library.handle
        if handle is None:
            return 0
        query = handle.kv_qlinear_vector_bits
        query.restype = ctypes.c_int
        query.argtypes = []
        return int(query())

    def prepare(
        self,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        *,
        group_size: int,
        bits: int,
    ) -> QuantizedLinearProjection | None:
        """A :class:`QuantizedLinearProjection` of this layer, or ``None`` where not served."""
        layout = affine_layout(weight, scales, biases, group_size=group_size, bits=bits, lanes=2)
        if not layout or weight.shape[0] == 0:
            return None
        handle = self.library.handle
        if handle is None:
            return None
        return QuantizedLinearProjection(
            handle, weight, scales, biases, group_size=group_size, bits=bits
        )
