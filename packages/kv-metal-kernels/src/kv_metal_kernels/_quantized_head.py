"""A large affine-quantized vocabulary head projected on the CPU by a native kernel.

MLX's CPU backend computes ``mx.quantized_matmul`` several times slower than a float32
product of the same shape (Gemma 3 270M's 262144 x 640 head, 2-core x86_64 with MKL: 8-bit
150 ms for one row against 51-54 ms in float32, 2.4 s for 16 rows against 82-98 ms), so on the CPU
quantized weights cost time instead of saving it. A vocabulary head is the one product that
reads a large matrix for a few rows; it is bandwidth-bound, so reading its 8-bit codes
instead of float32 values could make it four times cheaper. :class:`CpuQuantizedHead`
(``kv_protocol.QuantizedHeadKernel``) projects rows through a C kernel
(:mod:`~kv_metal_kernels._quantized_head_source`, built by
:func:`~kv_metal_kernels._cpu_library.build_cpu_library`): on the same machine 18-19 ms
for one row and 23-24 for four at 8 bits, about even with float32 at sixteen
(``tools/bench_head.py``).

:meth:`QuantizedHeadProjection.greedy` gives the argmax of those logits without computing
them all, where the CPU has AVX-512 VNNI: each 32-odd inputs of a row are rounded to 8 bits
with their own scale and multiplied by the codes in integers (four times the products an
instruction of float32's), each logit's distance from that screen is bounded (each group's
rounding times the vocabulary row's L1 norm over the group, plus float rounding slack),
and only the rows whose bound reaches the best lower bound (one to a few) are computed by
the float32 kernel, whose result for an output does not depend on which other outputs it
computes: the same token, with the same ties, as ``mx.argmax`` of the logits. Gemma 3
270M's head on the same machine: 16 rows 14.7 against 40 ms, 4 rows 6.5-7 against 12-15,
one row about even (reading the codes bounds both).
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
from ._quantized_head_source import QUANTIZED_HEAD_SOURCE

__all__ = ["CpuQuantizedHead", "QuantizedHeadProjection", "affine_layout"]

_LANES = 16
#: The bits the kernel reads.
SUPPORTED_BITS = (4, 8)
#: Vocabulary rows a tile of the greedy screen's layout (one vector's lanes).
_SCREEN_ROWS = 16
#: The largest group the screen serves (its integer group sums stay exact in float32).
_SCREEN_MAX_GROUP = 256
#: Token ids travel as float32 (the graph calls' output type): exact below 2^24.
_SCREEN_MAX_VOCAB = 1 << 24


class _ScreenLayout:
    """The greedy screen's copy of a head (the C ``kv_qhead_screen_layout``'s layout).

    Its codes 16 vocabulary rows a vector, their scales, biases and groups' L1 norms, and
    each row's bound on its sums' magnitude.
    """

    def __init__(
        self,
        library: ctypes.CDLL,
        pointers: list[int],
        *,
        vocab: int,
        hidden: int,
        group_size: int,
        bits: int,
    ) -> None:
        tiles = -(-vocab // _SCREEN_ROWS)
        groups = hidden // group_size
        per_group = (tiles * groups * _SCREEN_ROWS,)
        codes, scales, biases = (ctypes.c_void_p(p) for p in pointers)
        zero_point = library.kv_qhead_zero_point
        zero_point.restype = ctypes.c_int
        zero_point.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        #: ``z`` where every bias is exactly ``-z`` times its group's scale (a symmetric
        #: head, as a GGUF's ``Q8_0``: the screen keeps no biases and skips their term),
        #: else -1.
        self.zero = int(zero_point(scales, biases, vocab * groups, bits))
        self.arrays = [
            mx.zeros((tiles * _SCREEN_ROWS * hidden,), dtype=mx.uint8),  # codes
            mx.zeros(per_group, dtype=mx.float32),  # scales
            mx.zeros(per_group if self.zero < 0 else (1,), dtype=mx.float32),  # biases
            mx.zeros(per_group, dtype=mx.float32),  # each group's L1 norm
            mx.zeros((tiles * _SCREEN_ROWS,), dtype=mx.float64, stream=mx.cpu),  # rows' M
        ]
        mx.eval(*self.arrays)
        fn = library.kv_qhead_screen_layout
        fn.restype = ctypes.c_int
        fn(
            codes,
            scales,
            biases,
            vocab,
            hidden,
            group_size,
            bits,
            self.zero,
            *(ctypes.c_void_p(_address(a)) for a in self.arrays),
        )
        self.pointers = [_address(a) for a in self.arrays]

    @property
    def nbytes(self) -> int:
        """The bytes it holds."""
        return sum(a.nbytes for a in self.arrays)


def _address(array: mx.array) -> int:
    """The address of an evaluated, row-contiguous ``array``'s data."""
    view = memoryview(cast(Any, array))
    if not view.c_contiguous or view.nbytes != array.nbytes:
        raise ValueError("the native CPU kernel needs a row-contiguous array")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class QuantizedHeadProjection:
    """``rows (..., hidden) float32 -> (..., vocab) float32`` through the native kernel.

    Holds the head's evaluated codes, float32 scales and biases (converted once where they
    are another float type) for as long as it lives.
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
        self._fn = library.kv_qhead
        self._fn.restype = ctypes.c_int
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        # x, B, D, codes, scales, biases, V, G, bits: both entry points start so.
        head: list[Any] = [pointer, integer, integer, pointer, pointer, pointer, integer]
        head += [integer, integer]
        self._fn.argtypes = [*head, pointer]
        self.vocab = int(weight.shape[0])
        self.hidden = int(weight.shape[1]) * 32 // bits
        self.group_size = group_size
        self.bits = bits
        self._weight = mx.contiguous(weight)
        self._scales = mx.contiguous(scales.astype(mx.float32))
        self._biases = mx.contiguous(biases.astype(mx.float32))
        mx.eval(self._weight, self._scales, self._biases)
        self._pointers = [_address(a) for a in (self._weight, self._scales, self._biases)]
        self._row0 = 0  # the first of the arrays' rows this projection reads (rows())
        self._screen: _ScreenLayout | None = None
        self._greedy_graph: GraphEntry | None = None
        greedy_fn = library.kv_qhead_greedy
        greedy_fn.restype = ctypes.c_int
        # Then the screen's codes, scales, biases, group norms, row norms, the head's zero
        # point, and the tokens.
        greedy_fn.argtypes = [*head, *[pointer] * 5, ctypes.c_int, pointer]
        self._greedy_fn = greedy_fn
        supported = library.kv_qhead_screen_supported
        supported.restype = ctypes.c_int
        #: Whether :meth:`greedy` serves this head here (else it returns ``None``).
        self.screens = (
            bool(supported()) and group_size <= _SCREEN_MAX_GROUP and self.vocab < _SCREEN_MAX_VOCAB
        )

    @property
    def nbytes(self) -> int:
        """The bytes of the codes, scales and biases of its rows (and the screen's, once made).

        A :meth:`rows` view counts its own rows' share of the buffers it reads.
        """
        arrays = (self._weight, self._scales, self._biases)
        own = sum(a.nbytes * self.vocab // int(a.shape[0]) for a in arrays)
        return own + (self._screen.nbytes if self._screen is not None else 0)

    def rows(self, start: int, stop: int) -> QuantizedHeadProjection:
        """The projection onto this head's rows ``start .. stop - 1``, reading the same buffers.

        Its outputs are those columns of this projection's, bit for bit (each output is
        computed from its own row and the input alone); nothing is copied.
        """
        if not 0 <= start < stop <= self.vocab:
            raise ValueError(
                f"rows must be a non-empty range within 0 .. {self.vocab}, got {start} .. {stop}"
            )
        view = copy.copy(self)
        view.vocab = stop - start
        view._row0 = self._row0 + start
        groups = self.hidden // self.group_size
        row_bytes = (self.hidden * self.bits // 8, 4 * groups, 4 * groups)
        view._pointers = [p + start * n for p, n in zip(self._pointers, row_bytes, strict=True)]
        view._screen = None
        view.screens = self.screens and view.vocab < _SCREEN_MAX_VOCAB
        return view

    def _call_head(self, rows: int, m: int) -> tuple[int, ...]:
        """The arguments both C entry points start with: ``m`` rows at ``rows``, the head."""
        codes, scales, biases = self._pointers
        hidden, vocab, group = self.hidden, self.vocab, self.group_size
        return (rows, m, hidden, codes, scales, biases, vocab, group, self.bits)

    def _screen_layout(self) -> _ScreenLayout:
        if self._screen is None:
            self._screen = _ScreenLayout(
                self._library,
                self._pointers,
                vocab=self.vocab,
                hidden=self.hidden,
                group_size=self.group_size,
                bits=self.bits,
            )
        return self._screen

    def greedy(self, rows: mx.array) -> mx.array | None:
        """The argmax over the vocabulary of each row's logits, ``(...,)`` uint32, or ``None``.

        Exactly ``mx.argmax(self(rows), axis=-1)`` (the first maximum; the first NaN where
        there is one), through the integer screen (module docstring). ``None`` where it is
        not served: no AVX-512 VNNI in this build, a group larger than 256 or a vocabulary
        of 2^24 rows or more, or a device other than the CPU. The first call lays out the
        screen's copy of the codes (a byte a weight, with float32 scales, biases and norms
        for each group of each row, no biases for a symmetric head: 202 MiB for Gemma 3
        270M's 8-bit head). A lazy node
        where the graph calls are available, else ``rows`` are evaluated here and the
        seconds go to ``kv_protocol.EVALUATION_CLOCK``.
        """
        if not self.screens or mx.default_device().type != mx.cpu:
            return None
        if rows.ndim < 2 or rows.shape[-1] != self.hidden or rows.dtype != mx.float32:
            raise ValueError(
                f"the quantized head projects float32 rows of {self.hidden} values, "
                f"got {rows.dtype} rows of shape {tuple(rows.shape)}"
            )
        shape = tuple(rows.shape[:-1])
        m = rows.size // self.hidden
        if m == 0:
            return mx.zeros(shape, dtype=mx.uint32)
        screen = self._screen_layout()
        graph = self._greedy_graph
        if graph is None:
            graph = self._greedy_graph = graph_entry(self._library, "kv_qhead_greedy_call")
        if graph:
            calls, kernel = graph
            tokens = calls.call(
                kernel,
                "KvGreedyRows",
                [rows, self._weight, self._scales, self._biases, *screen.arrays],
                [m, self.hidden, self.vocab, self.group_size, self.bits, self._row0, screen.zero],
                shape,
            )
            return tokens.astype(mx.uint32)
        tic = time.perf_counter()
        rows = mx.contiguous(rows)
        mx.eval(rows)
        out = bytearray(4 * m)
        status = self._greedy_fn(
            *self._call_head(_address(rows), m),
            *screen.pointers,
            screen.zero,
            ctypes.addressof(ctypes.c_char.from_buffer(out)),
        )
        if status != 0:
            raise MemoryError(f"the greedy head kernel could not allocate {m} rows")
        tokens = mx.array(cast(Any, memoryview(out).cast("f", shape))).astype(mx.uint32)
        EVALUATION_CLOCK.add(time.perf_counter() - tic)
        return tokens

    def __call__(self, rows: mx.array) -> mx.array:
        """The logits of ``rows (..., hidden)``, ``(..., vocab)`` float32.

        On MLX's CPU device with the graph calls available (:mod:`~kv_metal_kernels._graph_call`)
        the result is a node of MLX's lazy graph: the kernel runs when it is evaluated, after
        what ``rows`` depends on, with no evaluation here. Otherwise ``rows`` are evaluated
        here (an evaluation point: a hand-off to MLX's CPU stream, tens of microseconds)
        and, where already row-contiguous, read where they are; the seconds from evaluating
        ``rows`` to the result then go to ``kv_protocol.EVALUATION_CLOCK``.
        """
        if rows.ndim < 2 or rows.shape[-1] != self.hidden or rows.dtype != mx.float32:
            raise ValueError(
                f"the quantized head projects float32 rows of {self.hidden} values, "
                f"got {rows.dtype} rows of shape {tuple(rows.shape)}"
            )
        shape = (*rows.shape[:-1], self.vocab)
        m = rows.size // self.hidden
        if m == 0:
            return mx.zeros(shape, dtype=mx.float32)
        graph = self._graph
        if graph is None:
            graph = self._graph = graph_entry(self._library, "kv_qhead_call")
        if graph and mx.default_device().type == mx.cpu:
            calls, kernel = graph
            return calls.call(
                kernel,
                "KvQuantizedRows",
                [rows, self._weight, self._scales, self._biases],
                [m, self.hidden, self.vocab, self.group_size, self.bits, self._row0],
                shape,
            )
        tic = time.perf_counter()
        mx.eval(rows)
        view = memoryview(cast(Any, rows))
        if not view.c_contiguous or view.nbytes != rows.nbytes:
            rows = mx.contiguous(rows)
            mx.eval(rows)
            view = memoryview(cast(Any, rows))
        out = bytearray(4 * m * self.vocab)
        target = ctypes.addressof(ctypes.c_char.from_buffer(out))
        status = self._fn(
            *self._call_head(ctypes.addressof(ctypes.c_char.from_buffer(view)), m), target
        )
        if status != 0:
            raise MemoryError(f"the quantized head kernel could not allocate {m} rows")
        result = mx.array(cast(Any, memoryview(out).cast("f", shape)))
        EVALUATION_CLOCK.add(time.perf_counter() - tic)
        return result


def affine_layout(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    lanes: int,
) -> bool:
    """Whether ``weight``, ``scales`` and ``biases`` are MLX's affine layout of 4 or 8 bits.

    Packed ``uint32`` codes, float scales and biases per group, and a group size that is a
    multiple of ``lanes`` and divides the row's width.
    """
    if bits not in SUPPORTED_BITS or weight.ndim != 2 or weight.dtype != mx.uint32:
        return False
    hidden = int(weight.shape[1]) * 32 // bits
    groups = hidden // group_size if group_size > 0 else 0
    return not (
        group_size <= 0
        or group_size % lanes
        or hidden % group_size
        or tuple(scales.shape) != (weight.shape[0], groups)
        or tuple(biases.shape) != (weight.shape[0], groups)
        or not mx.issubdtype(scales.dtype, mx.floating)
        or not mx.issubdtype(biases.dtype, mx.floating)
    )


class CpuQuantizedHead:
    """``kv_protocol.QuantizedHeadKernel`` on the CPU: a C kernel built on first use.

    :meth:`prepare` serves affine heads of 4 or 8 bits whose hidden size and group size are
    multiples of 16 (the group dividing the hidden size), when the kernel builds on this
    machine (:attr:`library` says how it was built, or why not).
    """

    name = "cpu"

    @property
    def library(self) -> CpuLibrary:
        """The built kernel library (``handle is None``: not available, with the reason)."""
        return build_cpu_library("kv_qhead", QUANTIZED_HEAD_SOURCE)

    def prepare(
        self,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        *,
        group_size: int,
        bits: int,
    ) -> QuantizedHeadProjection | None:
        """A :class:`QuantizedHeadProjection` of this head, or ``None`` where it is not served."""
        if not affine_layout(
            weight, scales, biases, group_size=group_size, bits=bits, lanes=_LANES
        ):
            return None
        handle = self.library.handle
        if handle is None:
            return None
        return QuantizedHeadProjection(
            handle, weight, scales, biases, group_size=group_size, bits=bits
        )
