"""The C source of the CPU quantized head product (:mod:`kv_metal_kernels._quantized_head`)."""

from __future__ import annotations

__all__ = ["QUANTIZED_HEAD_SOURCE"]

#: ``kv_qhead(x, B, D, codes, scales, biases, V, G, bits, out)``: ``out (B, V) = x (B, D) @
#: dequantize(codes, scales, biases).T`` for MLX's affine layout (``bits`` 4 or 8; element
#: ``k`` of a row in bits ``k * bits ..`` of its little-endian words; a group of ``G``
#: inputs shares a scale and a bias). Each output is one thread's: a tile of 4 vocabulary
#: rows against 1, 2 or 4 input rows, or each half of it against 8 input rows, 16 inputs at
#: a time (dequantized in registers, one fused multiply-add per input and row), summed
#: pairwise at the end, the tiles 4 ahead prefetched meanwhile. Every tiling adds an
#: output's products in the same order, so the result depends on nothing but the shapes
#: (not the thread count, nor the other rows).
#: Under Intel's OpenMP runtime the calling thread's team spins for at most 2 ms after a
#: product. Returns 0, or -1 when its scratch cannot be allocated. Needs D and G multiples
#: of 16 and G dividing D.
QUANTIZED_HEAD_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
#define L 16
#define TJ 4
/* A thread's tiles are consecutive rows, so the bytes it reads next are the next tiles'
   codes, scales and biases: each 16-input step of a tile's first pass over the input rows
   prefetches one line of the tile PF_TILES ahead. Without it a core waited on memory: the
   262144 x 640 8-bit head took 16.6 ms a row against 9.9 with it (2 cores of an AMD
   EPYC; 1.4-1.8x on a 270M model's layers at 1-4 rows, about even from 8 rows, where the
   products cost more than the reads). */
#define PF_TILES 4

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

static inline float hsum(vf v) {
  vf8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char *)&v + 32, 32); a += b;
  vf4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char *)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* Chunk c (16 inputs) of a row's codes as floats. 8-bit: in order. 4-bit: the low nibbles
   (even inputs) then the high ones (odd inputs); the input rows are permuted to match. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf codes8(const uint8_t *q, int c) {
  __m128i b = _mm_loadu_si128((const __m128i *)(q + c * 16));
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  vf v; memcpy(&v, &f, 64); return v;
}
static inline vf codes4(const uint8_t *q, int c) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * 8));
  __m128i m = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
  vf v; memcpy(&v, &f, 64); return v;
}
#else
static inline vf codes8(const uint8_t *q, int c) {
  vf v; for (int k = 0; k < L; k++) v[k] = (float)q[c * 16 + k]; return v;
}
static inline vf codes4(const uint8_t *q, int c) {
  vf v;
  for (int k = 0; k < 8; k++) {
    v[k] = (float)(q[c * 8 + k] & 15);
    v[k + 8] = (float)(q[c * 8 + k] >> 4);
  }
  return v;
}
#endif

/* NB input rows against NJ vocabulary rows: NB * NJ accumulators and NJ dequantized
   chunks in registers (8 x 2 + 2 and 4 x 4 + 4 of AVX-512's 32); the wider NB, the fewer
   times a code is converted per product (8 x 2: 13-22% faster than 4 x 4 at 8-32 rows on
   a 2-core AMD EPYC, the same at 1-4). */
#define TILE(NB, NJ, BITS)                                                                \
  static void tile_##NB##_##NJ##_##BITS(const float *xp, int D, int G,                   \
                                        const uint8_t *const *q, \
                                 const float *const *s, const float *const *bi, float *o,\
                                 size_t ostride, int rows, int pf) {                     \
    vf acc[NB][NJ];                                                                           \
    for (int bb = 0; bb < NB; bb++)                                                           \
      for (int r = 0; r < NJ; r++) acc[bb][r] = (vf){0};                                      \
    int nc = D / L, cpg = G / L;                                                              \
    for (int c = 0; c < nc; c++) {                                                            \
      int g = cpg == 2 ? c >> 1 : c / cpg;                                                    \
      vf w[NJ];                                                                               \
      if (pf && c * 64 < TJ * D * BITS / 8)                                                   \
        __builtin_prefetch(q[0] + (size_t)PF_TILES * TJ * D * BITS / 8 + c * 64, 0, 0);       \
      if (pf && c * 64 < TJ * (D / G) * 4) {                                                  \
        size_t ahead = (size_t)PF_TILES * TJ * (D / G);                                       \
        __builtin_prefetch((const char *)(s[0] + ahead) + c * 64, 0, 0);                      \
        __builtin_prefetch((const char *)(bi[0] + ahead) + c * 64, 0, 0);                     \
      }                                                                                       \
      for (int r = 0; r < NJ; r++) w[r] = codes##BITS(q[r], c) * s[r][g] + bi[r][g];          \
      for (int bb = 0; bb < NB; bb++) {                                                       \
        vf xv = load_f(xp + (size_t)bb * D + c * L);                                          \
        for (int r = 0; r < NJ; r++) acc[bb][r] += xv * w[r];                                 \
      }                                                                                       \
    }                                                                                         \
    for (int bb = 0; bb < NB; bb++)                                                           \
      for (int r = 0; r < rows; r++) o[bb * ostride + r] = hsum(acc[bb][r]);                  \
  }
TILE(8, 2, 8) TILE(4, 4, 8) TILE(2, 4, 8) TILE(1, 4, 8)
TILE(8, 2, 4) TILE(4, 4, 4) TILE(2, 4, 4) TILE(1, 4, 4)

/* Intel's OpenMP runtime (MKL's): the calling thread's team sleeps 2 ms after a product
   instead of spinning for 200 ms on the cores MKL's own team needs next. Not at once: a
   decode step's linear layers call the kernel every few hundred microseconds, and waking
   sleeping workers for each call cost a 270M model's one-row step 6-8 ms. */
extern void kmp_set_blocktime(int) __attribute__((weak));
static __thread int blocktime_set;

int kv_qhead(const float *x, int B, int D, const uint32_t *codes, const float *scales,
             const float *biases, int V, int G, int bits, float *out) {
  if (!blocktime_set) {
    if (kmp_set_blocktime) kmp_set_blocktime(2);
    blocktime_set = 1;
  }
  int ng = D / G, nc = D / L;
  size_t row_bytes = (size_t)D * bits / 8;
  float *xp = (float *)malloc(sizeof(float) * (size_t)B * D + 64);
  if (xp == NULL) return -1;
  for (int b = 0; b < B; b++)
    for (int c = 0; c < nc; c++)
      for (int k = 0; k < L; k++) {
        int src = bits == 4 ? (k < 8 ? 2 * k : 2 * (k - 8) + 1) : k;
        xp[(size_t)b * D + c * L + k] = x[(size_t)b * D + c * L + src];
      }
  int tiles = (V + TJ - 1) / TJ;
#pragma omp parallel for schedule(static)
  for (int t = 0; t < tiles; t++) {
    int j0 = t * TJ, rows = V - j0 < TJ ? V - j0 : TJ;
    const uint8_t *q[TJ];
    const float *s[TJ], *bi[TJ];
    for (int r = 0; r < TJ; r++) {
      int j = j0 + (r < rows ? r : rows - 1);
      q[r] = (const uint8_t *)codes + (size_t)j * row_bytes;
      s[r] = scales + (size_t)j * ng;
      bi[r] = biases + (size_t)j * ng;
    }
    int b = 0;
    float *o = out + j0;
#define RUN8(BITS)                                                                      \
  for (; b + 8 <= B; b += 8) {                                                          \
    float *ob = o + (size_t)b * V;                                                      \
    tile_8_2_##BITS(xp + (size_t)b * D, D, G, q, s, bi, ob, V, rows < 2 ? rows : 2, b == 0); \
    if (rows > 2)                                                                       \
      tile_8_2_##BITS(xp + (size_t)b * D, D, G, q + 2, s + 2, bi + 2, ob + 2, V, rows - 2, 0); \
  }
#define RUN(NB, BITS)                                                                   \
  for (; b + NB <= B; b += NB)                                                          \
    tile_##NB##_4_##BITS(xp + (size_t)b * D, D, G, q, s, bi, o + (size_t)b * V, V, rows, b == 0);
    if (bits == 8) {
      RUN8(8) RUN(4, 8) RUN(2, 8) RUN(1, 8)
    } else {
      RUN8(4) RUN(4, 4) RUN(2, 4) RUN(1, 4)
    }
  }
  free(xp);
  return 0;
}

/* The graph calls' form (kv_metal_kernels._graph_call): inputs x, codes, scales, biases;
   params B, D, V, G, bits. */
int kv_qhead_call(const void *const *in, const double *p, void *out) {
  return kv_qhead((const float *)in[0], (int)p[0], (int)p[1], (const uint32_t *)in[1],
                  (const float *)in[2], (const float *)in[3], (int)p[2], (int)p[3], (int)p[4],
                  (float *)out);
}
"""
