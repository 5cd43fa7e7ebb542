"""The C source of the CPU RMS normalisation (:mod:`kv_metal_kernels._cpu_norm`)."""

from __future__ import annotations

__all__ = ["CPU_NORM_SOURCE"]

#: ``kv_rms_norm_call`` in the graph calls' form (:mod:`kv_metal_kernels._graph_call`):
#: inputs float32 ``x (rows, dim)`` and ``weight (dim,)``; params ``rows, dim, eps,
#: add_one``. Row ``r`` becomes ``(x * (1 / sqrt(ss * (1 / dim) + eps))) * w`` with ``ss``
#: the squares summed in order from 0 and ``w`` the weight (plus 1 where ``add_one``): the
#: operations MLX's CPU backend composes ``mx.fast.rms_norm`` of, each rounded to float32 in
#: the same order (its reductions are sequential on this backend), so the results are the
#: same bits. No multiply-add may be fused: the functions turn contraction off.
#:
#: ``kv_norm_rope_call`` (``kv_protocol.NormRopeKernel``) normalises each head's row the same
#: way and rotates it in halves, as kv-batching's ``rope_rows`` composes RoPE from MLX's
#: operations.
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

/* One row of mx.fast.rms_norm's CPU composition; y may not alias x. */
KV_NO_CONTRACT
static void kv_norm_row(const float *xr, const float *w, float *yr, int dim, float eps,
                        float inverse, int add_one) {
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
    kv_norm_row(x + (size_t)r * dim, w, y + (size_t)r * dim, dim, eps, inverse, add_one);
  }
  return 0;
}

/* Inputs: float32 rows (batch, heads * dim), cos_both and sin_signed (batch, dim), and the
   norm's weight (dim) where params[3] says there is a norm; params batch, heads, dim,
   has_norm, eps, add_one. Each head's row is normalised (as kv_rms_norm_call), then
   rotated in halves: out = y * cos_both + [y2, y1] * sin_signed, each product and the sum
   rounded to float32 as MLX's separate operations round them. */
KV_NO_CONTRACT
int kv_norm_rope_call(const void *const *in, const double *p, void *out) {
  const float *x = (const float *)in[0];
  const float *cos_both = (const float *)in[1];
  const float *sin_signed = (const float *)in[2];
  float *y = (float *)out;
  long long batch = (long long)p[0];
  int heads = (int)p[1];
  int dim = (int)p[2];
  int has_norm = p[3] != 0.0;
  const float *w = has_norm ? (const float *)in[3] : NULL;
  float eps = (float)p[4];
  int add_one = p[5] != 0.0;
  int half = dim / 2;
  float inverse = (float)(1.0 / (double)dim);
  long long rows = batch * heads;
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
  for (long long r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * dim;
    float *yr = y + (size_t)r * dim;
    const float *c = cos_both + (size_t)(r / heads) * dim;
    const float *s = sin_signed + (size_t)(r / heads) * dim;
    if (has_norm) {
      kv_norm_row(xr, w, yr, dim, eps, inverse, add_one);
    } else {
      for (int i = 0; i < dim; i++) yr[i] = xr[i];
    }
    for (int i = 0; i < half; i++) {
      float a = yr[i];
      float b = yr[i + half];
      float a_cos = a * c[i];
      float b_sin = b * s[i];
      float b_cos = b * c[i + half];
      float a_sin = a * s[i + half];
      yr[i] = a_cos + b_sin;
      yr[i + half] = b_cos + a_sin;
    }
  }
  return 0;
}
"""
