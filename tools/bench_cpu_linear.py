"""The native CPU quantized linear product against MLX's float32 product, by row count.

Run: ``uv run --no-sync python -m tools.bench_cpu_linear`` (about 30 seconds on 2 cores).

For a Gemma-3-270M-sized layer (2048 x 640, groups of 32) at 8 and 4 bits, each row count
(1 / 16 / 128 / 512: decode steps to prompt chunks) times ``CpuQuantizedLinear``'s product
and ``x @ W.T`` over the same values dequantized, the best of five evaluations each, on the
BLAS kv-serve loads. It prints the library's build (compiler, flags, OpenMP, the vector
width its tiles run at: 512-bit with AVX-512, 256-bit halves with AVX2 alone) and the CPU's
vector flags; where a product is slower than MLX's, the engine is better off without the
kernel at that row count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

import kv_serve
from kv_metal_kernels import CpuQuantizedLinear

kv_serve.load_fast_blas()


def best_us(make: Callable[[], mx.array], repeats: int = 5) -> float:
    """The fastest of ``repeats`` evaluations of ``make()``, in microseconds (after a warm-up)."""
    mx.eval(make())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(make())
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def cpu_flags() -> str:
    """The AVX-512 / AVX2 words of this CPU's flags (empty off x86 Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    words = set(line.split())
    return " ".join(sorted(w for w in words if w in {"avx2", "avx512f", "avx512_vnni", "fma"}))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; returns 1 where the kernel is not built here."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--out-features", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=640)
    args = parser.parse_args(argv)
    kernel = CpuQuantizedLinear()
    library = kernel.library
    print(f"CPU flags: {cpu_flags() or 'unknown'}")
    print(f"kernel: {library.describe()}, {kernel.vector_bits or 'compiler'}-bit vectors")
    if library.handle is None:
        return 1
    mx.random.seed(0)
    weight = mx.random.normal((args.out_features, args.in_features))
    print("bits  rows  kernel us   mlx us   kernel / mlx")
    for bits in (8, 4):
        codes, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
        projection = kernel.prepare(codes, scales, biases, group_size=32, bits=bits)
        assert projection is not None
        dense = mx.dequantize(codes, scales, biases, group_size=32, bits=bits)
        mx.eval(dense)
        for rows in args.rows:
            x = mx.random.normal((rows, args.in_features))
            mx.eval(x)
            native = best_us(lambda: projection(x))  # noqa: B023 (timed at once)
            plain = best_us(lambda: x @ dense.T)  # noqa: B023
            print(f"{bits:>4}  {rows:>4}  {native:>9.0f}  {plain:>7.0f}  {native / plain:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
