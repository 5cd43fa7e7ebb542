"""Compile the CUDA kernel bodies with nvcc where it exists (no GPU needed).

MLX wraps a ``mx.fast.cuda_kernel`` body in a generated ``__global__`` function inside
``namespace mlx::core::cu``: one ``const T*`` parameter per input (plus ``<name>_shape`` when
the body uses it), one ``T*`` per output, and the template arguments as ``constexpr`` /
``using`` lines. This test builds the same wrapper for every dtype and a few template
values and compiles it, so a syntax or type error in a kernel body is caught on any machine
with the CUDA toolkit, long before a GPU run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kv_metal_kernels._sources import (
    CUDA_PAGED_QUANTIZED_SOURCE,
    CUDA_PAGED_SOURCE,
    CUDA_ROPE_SOURCE,
)

NVCC = shutil.which("nvcc")

HEADER = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
namespace cg = cooperative_groups;
"""

Param = tuple[str, str, bool]


def _wrap(
    name: str,
    inputs: list[Param],
    outputs: list[tuple[str, str]],
    template: list[tuple[str, object]],
    body: str,
) -> str:
    params = []
    for arg, ctype, with_shape in inputs:
        params.append(f"const {ctype}* {arg}")
        if with_shape:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
    params += [f"{ctype}* {arg}" for arg, ctype in outputs]
    lines = []
    for key, value in template:
        if isinstance(value, bool):
            lines.append(f"constexpr bool {key} = {str(value).lower()};")
        elif isinstance(value, int):
            lines.append(f"constexpr int {key} = {value};")
        else:
            lines.append(f"using {key} = {value};")
    return f"__global__ void {name}({', '.join(params)}) {{\n{chr(10).join(lines)}\n{body}\n}}\n"


@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")
def test_cuda_kernel_bodies_compile(tmp_path: Path) -> None:
    assert NVCC is not None
    parts = [HEADER]
    for i, ctype in enumerate(["float", "__half", "__nv_bfloat16"]):
        parts.append(
            _wrap(
                f"rope_{i}",
                [
                    ("q", ctype, False),
                    ("k", ctype, False),
                    ("positions", "int32_t", True),
                    ("params", "float", False),
                    ("meta", "int32_t", False),
                ],
                [("q_rot", ctype), ("k_rot", ctype)],
                [("T", ctype), ("D", 80)],
                CUDA_ROPE_SOURCE,
            )
        )
        parts.append(
            _wrap(
                f"paged_{i}",
                [
                    ("q", ctype, False),
                    ("k_pool", ctype, True),
                    ("v_pool", ctype, True),
                    ("page_table", "int32_t", True),
                    ("seq_lens", "int32_t", False),
                    ("params", "float", False),
                    ("meta", "int32_t", False),
                ],
                [("part_m", "float"), ("part_l", "float"), ("part_acc", "float")],
                [("T", ctype), ("D", 64 * (i + 1)), ("G", 4 // (i + 1))],
                CUDA_PAGED_SOURCE,
            )
        )
        for bits in (4, 8):
            parts.append(
                _wrap(
                    f"paged_quantized_{i}_{bits}",
                    [
                        ("q", ctype, False),
                        ("k_data", "uint32_t", True),
                        ("k_scales", ctype, False),
                        ("k_biases", ctype, False),
                        ("v_data", "uint32_t", False),
                        ("v_scales", ctype, False),
                        ("v_biases", ctype, False),
                        ("page_table", "int32_t", True),
                        ("seq_lens", "int32_t", False),
                        ("params", "float", False),
                        ("meta", "int32_t", False),
                    ],
                    [("part_m", "float"), ("part_l", "float"), ("part_acc", "float")],
                    [("T", ctype), ("D", 64 * (i + 1)), ("G", 2), ("BITS", bits), ("GS", 32)],
                    CUDA_PAGED_QUANTIZED_SOURCE,
                )
            )
    parts.append("}\n")
    source = tmp_path / "kernels.cu"
    source.write_text("".join(parts))
    cccl = Path(NVCC).resolve().parent.parent / "include" / "cccl"
    cmd = [NVCC, "-std=c++17", "-arch=sm_80", "-c", str(source), "-o", str(tmp_path / "k.o")]
    if cccl.is_dir():
        cmd.insert(1, f"-I{cccl}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
