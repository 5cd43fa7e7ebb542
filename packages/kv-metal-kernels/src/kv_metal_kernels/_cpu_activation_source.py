"""The C source of the CPU gated activation (:mod:`kv_metal_kernels._cpu_activation`)."""

from __future__ import annotations

__all__ = ["CPU_ACTIVATION_SOURCE"]

#: ``kv_gated_call`` in the graph calls' form (:mod:`kv_metal_kernels._graph_call`): inputs
#: float32 ``gate`` and ``up`` of ``n`` values each; params ``n``, the activation (0 SiLU, 1
#: the tanh GELU) and ``kv_protocol.ACTIVATION_CONSTANTS``. Each value is
#: ``kv_protocol.gated_activation``'s: the same operations in the same order, each rounded
#: to float32 (no multiply-add may be fused: the function turns contraction off), so the
#: bits are those of MLX's operations; the loop vectorises.
CPU_ACTIVATION_SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#define KV_NO_CONTRACT
#elif defined(__GNUC__)
#define KV_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KV_NO_CONTRACT
#endif

typedef struct {
  float log2e, min_exp2, magic, c[7], cubic, gelu_scale;
  int32_t magic_bits;
} kv_constants;

/* kv_protocol.sigmoid: e = exp(-|x|) from 2**n * 2**f, then 1 / (1 + e) or e / (1 + e). */
KV_NO_CONTRACT
static inline float kv_sigmoid(float x, const kv_constants *k) {
  float a = -fabsf(x);
  float t = a * k->log2e;
  t = (t != t) ? t : (t > k->min_exp2 ? t : k->min_exp2);
  float rounded = t + k->magic;
  float f = t - (rounded - k->magic);
  float poly = k->c[6];
  for (int j = 5; j >= 0; j--) {
    float product = poly * f;
    poly = product + k->c[j];
  }
  int32_t bits;
  memcpy(&bits, &rounded, 4);
  uint32_t shifted = (uint32_t)(bits - (k->magic_bits - 127)) << 23;
  float two_n;
  memcpy(&two_n, &shifted, 4);
  float e = poly * two_n;
  float r = 1.0f / (1.0f + e);
  return x >= 0.0f ? r : e * r;
}

KV_NO_CONTRACT
int kv_gated_call(const void *const *in, const double *p, void *out) {
  const float *gate = (const float *)in[0];
  const float *up = (const float *)in[1];
  float *y = (float *)out;
  long long n = (long long)p[0];
  int gelu = p[1] != 0.0;
  kv_constants k;
  k.log2e = (float)p[2];
  k.min_exp2 = (float)p[3];
  k.magic = (float)p[4];
  k.magic_bits = (int32_t)p[5];
  for (int j = 0; j < 7; j++) k.c[j] = (float)p[6 + j];
  k.cubic = (float)p[13];
  k.gelu_scale = (float)p[14];
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (long long i = 0; i < n; i++) {
    float g = gate[i];
    float z = g;
    if (gelu) {
      float square = g * g;
      float cube = square * g;
      float term = k.cubic * cube;
      float inner = g + term;
      z = k.gelu_scale * inner;
    }
    float act = g * kv_sigmoid(z, &k);
    y[i] = act * up[i];
  }
  return 0;
}
"""
