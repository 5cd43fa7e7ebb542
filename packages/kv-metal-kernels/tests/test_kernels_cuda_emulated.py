"""Run the CUDA kernel bodies on the CPU under a small emulation of the CUDA execution model.

No GPU is needed: each kernel body is compiled with g++ as a plain function; a block's 256
threads are ``std::thread``s, ``__syncthreads`` is a block barrier, ``__shfl_xor_sync`` a
per-warp exchange through memory between two warp barriers, and ``__shared__`` arrays are
function statics (blocks run one after another). The results are compared with the dense
float64 oracle (paged attention) and the reference backend (RoPE), so the kernels' indexing,
page-table walk, online softmax, warp merge, sinks and windows are checked on any machine
with a C++20 compiler. The Metal bodies follow the same algorithm line for line.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_kernels_paged_attention import Batch, dense_oracle, make_batch

from kv_metal_kernels import ReferenceRopeScatter
from kv_metal_kernels._native import merge_partials
from kv_metal_kernels._sources import (
    CUDA_PAGED_QUANTIZED_SOURCE,
    CUDA_PAGED_SOURCE,
    CUDA_ROPE_SOURCE,
    PAGED_SIMD_GROUPS,
    paged_group_size,
)
from kv_protocol import KVQuantization, RopeConfig

GXX = shutil.which("g++")

HARNESS_HEAD = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>
using std::max;
using std::min;
using Shape = std::array<int32_t, 8>;
struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim;
static std::barrier<>* block_bar;
static std::vector<std::barrier<>*> warp_bars;
static float warp_buf[NSG_][32];
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline void emu_sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
#define sincosf emu_sincosf
inline float __shfl_xor_sync(unsigned, float v, int off) {
  int w = threadIdx.x / 32, l = threadIdx.x % 32;
  warp_bars[w]->arrive_and_wait();
  warp_buf[w][l] = v;
  warp_bars[w]->arrive_and_wait();
  return warp_buf[w][l ^ off];
}
#define __syncthreads() block_bar->arrive_and_wait()
#define __shared__ static
"""

# After the kernel bodies: file I/O and the launch of the paged kernel's grid.
HARNESS_SUPPORT = r"""
template <class T> std::vector<T> rd(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(f)), {});
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}
template <class T> void wr(const std::string& p, const std::vector<T>& v) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
// Every block of the paged kernel's grid, one after another; a block's threads in parallel.
template <class Call> void launch_paged(int batch, Call call) {
  blockDim = {32 * NSG_, 1, 1};
  std::barrier<> bb(32 * NSG_);
  block_bar = &bb;
  for (int w = 0; w < NSG_; ++w) warp_bars.push_back(new std::barrier<>(32));
  for (int b = 0; b < batch * S_; ++b) {
    for (int h = 0; h < HQ_ / G_; ++h) {
      std::vector<std::thread> ts;
      for (int t = 0; t < 32 * NSG_; ++t) {
        ts.emplace_back([&, t, b, h] {
          threadIdx = {t, 0, 0};
          blockIdx = {0, h, b};
          call();
        });
      }
      for (auto& th : ts) th.join();
    }
  }
  for (auto* w : warp_bars) delete w;
  warp_bars.clear();
}
"""

HARNESS_MAIN = r"""
int main(int argc, char** argv) {
  std::string dir = argv[1];
  auto ii = rd<int32_t>(dir + "/ints.bin");
  int B = ii[0], MAXP = ii[1], NS = ii[2], NT = ii[3];
  auto q = rd<float>(dir + "/q.bin");
  auto k = rd<float>(dir + "/k.bin");
  auto v = rd<float>(dir + "/v.bin");
  auto pt = rd<int32_t>(dir + "/pt.bin");
  auto sl = rd<int32_t>(dir + "/sl.bin");
  auto prm = rd<float>(dir + "/params.bin");
  auto meta = rd<int32_t>(dir + "/meta.bin");
  Shape ks{}; ks[0] = HKV_; ks[1] = NS; ks[2] = D_;
  Shape ps{}; ps[0] = B; ps[1] = MAXP;
  std::vector<float> part_m(B * S_ * HQ_, -999.f), part_l(B * S_ * HQ_, -999.f);
  std::vector<float> part_acc(B * S_ * HQ_ * D_, -999.f);
  launch_paged(B, [&] {
    paged(q.data(), k.data(), ks, v.data(), pt.data(), ps, sl.data(), prm.data(), meta.data(),
          part_m.data(), part_l.data(), part_acc.data());
  });
  wr(dir + "/part_m.bin", part_m);
  wr(dir + "/part_l.bin", part_l);
  wr(dir + "/part_acc.bin", part_acc);
  auto rq = rd<float>(dir + "/rq.bin");
  auto rk = rd<float>(dir + "/rk.bin");
  auto pos = rd<int32_t>(dir + "/pos.bin");
  auto rp = rd<float>(dir + "/rparams.bin");
  auto rmeta = rd<int32_t>(dir + "/rmeta.bin");
  std::vector<float> qo(rq.size(), -999.f), ko(rk.size(), -999.f);
  Shape pshape{}; pshape[0] = NT;
  blockDim = {D_ / 2, 1, 1};
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < HQ_ + HKV_; ++h)
      for (int j = 0; j < D_ / 2; ++j) {
        threadIdx = {j, 0, 0};
        blockIdx = {0, h, t};
        rope(rq.data(), rk.data(), pos.data(), pshape, rp.data(), rmeta.data(), qo.data(),
             ko.data());
      }
  wr(dir + "/qo.bin", qo);
  wr(dir + "/ko.bin", ko);
}
"""


def _function(name: str, params: str, template: dict[str, object], body: str) -> str:
    lines = [f"void {name}({params}) {{"]
    for key, value in template.items():
        if isinstance(value, str):
            lines.append(f"  using {key} = {value};")
        else:
            lines.append(f"  constexpr int {key} = {int(value)};")  # type: ignore[call-overload]
    return "\n".join([*lines, body, "}\n"])


def run_paged_emulation(
    tmp_path: Path, consts: dict[str, int], program: str, b: int, batch: Batch
) -> np.ndarray:
    """Build and run one emulated program; the paged kernel's merged output ``(B, Hq, 1, D)``.

    ``program`` follows :data:`HARNESS_HEAD` (kernel bodies, support, a ``main`` reading the
    inputs from ``tmp_path``); ``consts`` are its compile-time sizes (``NSG_`` is added).
    """
    assert GXX is not None
    values = ", ".join(f"{k} = {v}" for k, v in {**consts, "NSG_": PAGED_SIMD_GROUPS}.items())
    source = tmp_path / "emu.cpp"
    source.write_text(f"constexpr int {values};\n" + HARNESS_HEAD + program)
    exe = tmp_path / "emu"
    build = [GXX, "-std=c++20", "-O1", "-pthread", str(source), "-o", str(exe)]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    subprocess.run([str(exe), str(tmp_path)], check=True, timeout=120)
    splits, hq, d = consts["S_"], consts["HQ_"], consts["D_"]
    part_m = np.fromfile(tmp_path / "part_m.bin", np.float32).reshape(b, splits, hq)
    part_l = np.fromfile(tmp_path / "part_l.bin", np.float32).reshape(b, splits, hq)
    part_acc = np.fromfile(tmp_path / "part_acc.bin", np.float32).reshape(b, splits, hq, d)
    out = merge_partials(mx.array(part_m), mx.array(part_l), mx.array(part_acc), batch.sinks)
    return np.array(out)[:, :, None, :]


CASES = [
    # lens, hkv, ratio, d, page_size, window, sinks, rope dims, traditional, grouped, splits
    ([1, 37, 100, 5], 2, 2, 64, 16, None, True, 64, False, True, 1),
    ([70, 3, 129], 1, 4, 80, 4, 17, False, 40, True, True, 3),
    ([33, 2, 150], 2, 4, 64, 8, None, True, 64, False, False, 4),
]


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernels_under_cpu_emulation(case: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    lens, hkv, ratio, d, page_size, window, sinks, dims, traditional, grouped, splits = case
    rng = np.random.default_rng(d)
    batch = make_batch(
        rng,
        lens=lens,
        hkv=hkv,
        ratio=ratio,
        d=d,
        page_size=page_size,
        window=window,
        with_sinks=sinks,
        dtype_name="float32",
    )
    hq = hkv * ratio
    group = paged_group_size(hq, hkv, d) if grouped else 1
    capacity = batch.page_table.shape[1] * page_size
    bound = capacity if window is None else min(window, capacity)
    chunk = -(-bound // splits)
    nt = 5
    rq = rng.standard_normal((nt, hq, d)).astype(np.float32)
    rk = rng.standard_normal((nt, hkv, d)).astype(np.float32)
    positions = rng.integers(0, 3000, nt).astype(np.int32)
    rope = RopeConfig(dims=dims, traditional=traditional, base=10000.0, scale=0.5)
    files = {
        "ints": np.array([len(lens), batch.page_table.shape[1], batch.k_pool.shape[1], nt]),
        "q": np.array(batch.q),
        "k": np.array(batch.k_pool),
        "v": np.array(batch.v_pool),
        "pt": np.array(batch.page_table),
        "sl": np.array(batch.seq_lens),
        "params": np.array([batch.scale]),
        "meta": np.array([hq, hkv, page_size, window or 0, splits, chunk]),
        "rq": rq,
        "rk": rk,
        "pos": positions,
        "rparams": np.array([rope.scale, np.log2(rope.base)]),
        "rmeta": np.array([dims, hq, hkv, int(traditional)]),
    }
    for name, arr in files.items():
        dtype = np.int32 if arr.dtype.kind in "iu" else np.float32
        np.ascontiguousarray(arr, dtype=dtype).tofile(tmp_path / f"{name}.bin")
    paged = _function(
        "paged",
        "const float* q, const float* k_pool, Shape k_pool_shape, const float* v_pool, "
        "const int32_t* page_table, Shape page_table_shape, const int32_t* seq_lens, "
        "const float* params, const int32_t* meta, float* part_m, float* part_l, "
        "float* part_acc",
        {"T": "float", "D": d, "G": group},
        CUDA_PAGED_SOURCE,
    )
    rope_fn = _function(
        "rope",
        "const float* q, const float* k, const int32_t* positions, Shape positions_shape, "
        "const float* params, const int32_t* meta, float* q_rot, float* k_rot",
        {"T": "float", "D": d},
        CUDA_ROPE_SOURCE,
    )
    consts = {"HQ_": hq, "HKV_": hkv, "D_": d, "G_": group, "S_": splits}
    out = run_paged_emulation(
        tmp_path, consts, paged + rope_fn + HARNESS_SUPPORT + HARNESS_MAIN, len(lens), batch
    )
    np.testing.assert_allclose(out, dense_oracle(batch), atol=2e-5, rtol=2e-5)

    pool = mx.zeros((hkv, 4, d))
    no_write = mx.full((nt,), -1, mx.int32)
    q_rot, k_rot, _, _ = ReferenceRopeScatter()(
        mx.array(rq),
        mx.array(rk),
        mx.array(rk),
        mx.array(positions),
        no_write,
        pool,
        pool,
        rope=rope,
    )
    q_out = np.fromfile(tmp_path / "qo.bin", np.float32).reshape(rq.shape)
    k_out = np.fromfile(tmp_path / "ko.bin", np.float32).reshape(rk.shape)
    # Angles up to 1500 rad: float32 sin/cos implementations differ by ~1e-4.
    np.testing.assert_allclose(q_out, np.array(q_rot), atol=5e-4)
    np.testing.assert_allclose(k_out, np.array(k_rot), atol=5e-4)


QUANTIZED_MAIN = r"""
int main(int argc, char** argv) {
  std::string dir = argv[1];
  auto ii = rd<int32_t>(dir + "/ints.bin");
  int B = ii[0], MAXP = ii[1], NS = ii[2];
  auto q = rd<float>(dir + "/q.bin");
  auto kd = rd<uint32_t>(dir + "/kd.bin");
  auto ks = rd<float>(dir + "/ks.bin");
  auto kb = rd<float>(dir + "/kb.bin");
  auto vd = rd<uint32_t>(dir + "/vd.bin");
  auto vs = rd<float>(dir + "/vs.bin");
  auto vb = rd<float>(dir + "/vb.bin");
  auto pt = rd<int32_t>(dir + "/pt.bin");
  auto sl = rd<int32_t>(dir + "/sl.bin");
  auto prm = rd<float>(dir + "/params.bin");
  auto meta = rd<int32_t>(dir + "/meta.bin");
  Shape kds{}; kds[0] = HKV_; kds[1] = NS; kds[2] = D_ * BITS_ / 32;
  Shape ps{}; ps[0] = B; ps[1] = MAXP;
  std::vector<float> part_m(B * S_ * HQ_, -999.f), part_l(B * S_ * HQ_, -999.f);
  std::vector<float> part_acc(B * S_ * HQ_ * D_, -999.f);
  launch_paged(B, [&] {
    paged(q.data(), kd.data(), kds, ks.data(), kb.data(), vd.data(), vs.data(), vb.data(),
          pt.data(), ps, sl.data(), prm.data(), meta.data(), part_m.data(), part_l.data(),
          part_acc.data());
  });
  wr(dir + "/part_m.bin", part_m);
  wr(dir + "/part_l.bin", part_l);
  wr(dir + "/part_acc.bin", part_acc);
}
"""

QUANTIZED_CASES = [
    # lens, hkv, ratio, d, page_size, window, sinks, bits, group size, splits
    ([1, 37, 100, 5], 2, 2, 64, 16, None, True, 8, 64, 1),
    ([70, 3, 129], 1, 4, 128, 4, 17, False, 4, 32, 3),
    ([33, 2, 150], 2, 4, 64, 8, None, True, 4, 64, 2),
]


@pytest.mark.skipif(GXX is None, reason="g++ not installed")
@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_cuda_quantized_paged_kernel_under_cpu_emulation(case: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """The kernel that unpacks quantized pages as it loads them == softmax over their values."""
    lens, hkv, ratio, d, page_size, window, sinks, bits, group_size, splits = case
    batch = make_batch(
        np.random.default_rng(d + bits),
        lens=lens,
        hkv=hkv,
        ratio=ratio,
        d=d,
        page_size=page_size,
        window=window,
        with_sinks=sinks,
        dtype_name="float32",
    )
    quant = KVQuantization(bits=bits, group_size=group_size)
    assert isinstance(batch.k_pool, mx.array) and isinstance(batch.v_pool, mx.array)
    k, v = quant.quantize(batch.k_pool), quant.quantize(batch.v_pool)
    hq = hkv * ratio
    group = paged_group_size(hq, hkv, d)
    capacity = batch.page_table.shape[1] * page_size
    bound = capacity if window is None else min(window, capacity)
    chunk = -(-bound // splits)
    files = {
        "ints": np.array([len(lens), batch.page_table.shape[1], batch.k_pool.shape[1]]),
        "q": np.array(batch.q),
        "kd": np.array(k.data),
        "ks": np.array(k.scales),
        "kb": np.array(k.biases),
        "vd": np.array(v.data),
        "vs": np.array(v.scales),
        "vb": np.array(v.biases),
        "pt": np.array(batch.page_table),
        "sl": np.array(batch.seq_lens),
        "params": np.array([batch.scale]),
        "meta": np.array([hq, hkv, page_size, window or 0, splits, chunk]),
    }
    for name, arr in files.items():
        dtype = {"u": np.uint32, "i": np.int32}.get(arr.dtype.kind, np.float32)
        np.ascontiguousarray(arr, dtype=dtype).tofile(tmp_path / f"{name}.bin")
    paged = _function(
        "paged",
        "const float* q, const uint32_t* k_data, Shape k_data_shape, const float* k_scales, "
        "const float* k_biases, const uint32_t* v_data, const float* v_scales, "
        "const float* v_biases, const int32_t* page_table, Shape page_table_shape, "
        "const int32_t* seq_lens, const float* params, const int32_t* meta, float* part_m, "
        "float* part_l, float* part_acc",
        {"T": "float", "D": d, "G": group, "BITS": bits, "GS": group_size},
        CUDA_PAGED_QUANTIZED_SOURCE,
    )
    consts = {"HQ_": hq, "HKV_": hkv, "D_": d, "G_": group, "S_": splits, "BITS_": bits}
    out = run_paged_emulation(
        tmp_path, consts, paged + HARNESS_SUPPORT + QUANTIZED_MAIN, len(lens), batch
    )
    dense = replace(batch, k_pool=k.dequantize(), v_pool=v.dequantize())
    np.testing.assert_allclose(out, dense_oracle(dense), atol=5e-5, rtol=5e-5)
