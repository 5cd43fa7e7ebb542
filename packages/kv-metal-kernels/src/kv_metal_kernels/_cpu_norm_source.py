"""The C source of the CPU RMS normalisation (:mod:`kv_metal_kernels._cpu_norm`)."""

from __future__ import annotations

__all__ = ["CPU_NORM_SOURCE"]

#: ``kv_rms_norm_call`` in the graph calls' form (:mod:`kv_metal_kernels._graph_call`):
#: inputs float32 ``x (rows, dim)`` and ``weight (dim,)``; params ``rows, dim, eps,
#: add_one``. Row ``r`` becomes ``(x * (1 / sqrt(ss * (1 / dim) + eps))) * w`` with ``ss``
#: the squares summed in order from 0 and ``w`` the weight (plus 1 where ``add_one``): the
#: operations MLX's CPU backend composes ``mx.fast.rms_norm`` of, each rounded to float32 in
#: the same order (its reductions are sequential on this backend), so the results are the
#: same bits. No multiply-add may be fused: the function turns contraction off.
CPU_NORM_SOURCE = r"""
#include <math.h>
#include <stddef.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#define KV_NO_CONTRACT
#elif defined(__GNUC__)
#define KV_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KV_NO_CONTRACT
#endif

KV_NO_CONTRACT
int kv_rms_norm_call(const void *const *in, const double *p, void *out) {
  const float *x = (const float *)in[0];
  const float *w = (const float *)in[1];
  float *y = (float *)out;
  long long rows = (long long)p[0];
  int dim = (int)p[1];
  float eps = (float)p[2];
  int add_one = p[3] != 0.0;
  float inverse = (float)(1.0 / (double)dim);
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (long long r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * dim;
    float *yr = y + (size_t)r * dim;
    float total = 0.0f;
    for (int i = 0; i < dim; i++) {
      float square = xr[i] * xr[i];
      total = total + square;
    }
    float mean = total * inverse;
    float shifted = mean + eps;
    float scale = 1.0f / sqrtf(shifted);
    for (int i = 0; i < dim; i++) {
      float weight = add_one ? 1.0f + w[i] : w[i];
      float normed = xr[i] * scale;
      yr[i] = normed * weight;
    }
  }
  return 0;
}
"""
