"""The C source of the CPU quantized linear product (:mod:`kv_metal_kernels._quantized_linear`)."""

from __future__ import annotations

__all__ = ["QUANTIZED_LINEAR_SOURCE"]

#: ``kv_qlinear_layout(codes, scales, biases, V, D, G, bits, lcodes, lscales, lbiases)``:
#: an affine ``(V, D)`` layer (MLX's layout: ``bits`` 4 or 8, a scale and a bias per group
#: of ``G`` inputs) laid out 16 output rows a tile, lane = output row: for each input (8
#: bits: the code minus 128 as a signed byte; 4 bits: a byte per lane for each two inputs,
#: the first in its low nibble) the tile's 16 codes side by side, then each group's 16
#: scales and 16 biases (8 bits: ``b + 128 s``, rounded once from double). Rows past V are
#: zero. Returns 1 where every laid-out bias is zero (a symmetric layer: its bias term is
#: skipped), else 0.
#:
#: ``kv_qlinear(x, B, D, lcodes, lscales, lbiases, V, G, bits, bias, out)``: ``out (B, V) =
#: x (B, D) @ W.T``. Each tile is one thread's; for each group its codes are converted to
#: floats once for up to 8 input rows, multiplied into a group sum per lane (the input
#: broadcast: no horizontal sums), scaled by the group's scales, and the bias times the
#: group's input sum added: ``sum_g s_g (sum_i q_i x_i) + b_g (sum_i x_i)``. An output's
#: arithmetic depends on nothing but its row and input (not the thread count, nor the other
#: rows). Returns 0, or -1 when its scratch cannot be allocated. Built for AVX2 without
#: AVX-512, a tile runs as two 8-lane halves (the 16-lane form's accumulators spill
#: AVX2's 16 registers), with each lane's arithmetic unchanged.
#:
#: ``kv_qlinear_vector_bits()``: 512 (AVX-512), 256 (AVX2) or 0, the vectors of this build.
QUANTIZED_LINEAR_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef float lvf __attribute__((vector_size(64)));
#define LANES 16
/* While a thread's first input rows run through a tile, the tile LINEAR_AHEAD ahead (the
   thread's next ones: its tiles are consecutive) is fetched, a group's lines at a time. */
#ifndef LINEAR_AHEAD
#define LINEAR_AHEAD 2
#endif

/* Intel's OpenMP runtime (MKL's): the team sleeps 2 ms after a product, not 200 (the next
   product of a decode step comes a few hundred microseconds later; MKL needs the cores). */
extern void kmp_set_blocktime(int) __attribute__((weak));
static __thread int linear_blocktime_set;

static void linear_blocktime(void) {
  if (!linear_blocktime_set) {
    if (kmp_set_blocktime) kmp_set_blocktime(2);
    linear_blocktime_set = 1;
  }
}

static inline lvf lane_load(const float *p) { lvf v; memcpy(&v, p, sizeof v); return v; }

/* A tile's 16 codes of an 8-bit input (signed bytes), and of a 4-bit pair of inputs (the
   first input's codes in lo, the second's in hi), as floats. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline lvf lane_codes8(const uint8_t *c) {
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
  lvf v; memcpy(&v, &f, 64); return v;
}
static inline void lane_codes4(const uint8_t *c, lvf *lo, lvf *hi) {
  __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
  __m512 a = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
  __m512 b = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
  memcpy(lo, &a, 64); memcpy(hi, &b, 64);
}
#else
static inline lvf lane_codes8(const uint8_t *c) {
  lvf v; for (int l = 0; l < LANES; l++) v[l] = (float)(int8_t)c[l]; return v;
}
static inline void lane_codes4(const uint8_t *c, lvf *lo, lvf *hi) {
  for (int l = 0; l < LANES; l++) (*lo)[l] = (float)(c[l] & 15), (*hi)[l] = (float)(c[l] >> 4);
}
#endif

int kv_qlinear_layout(const uint32_t *codes, const float *scales, const float *biases, int V,
                      int D, int G, int bits, uint8_t *lcodes, float *lscales, float *lbiases) {
  int ng = D / G, tiles = (V + LANES - 1) / LANES, zero = 1;
  size_t row_bytes = (size_t)D * bits / 8, tile_bytes = (size_t)D * LANES * bits / 8;
#pragma omp parallel for schedule(static) reduction(&& : zero)
  for (int t = 0; t < tiles; t++)
    for (int l = 0; l < LANES; l++) {
      int j = t * LANES + l;
      const uint8_t *q = (const uint8_t *)codes + (size_t)j * row_bytes;
      uint8_t *c = lcodes + (size_t)t * tile_bytes + l;
      for (int i = 0; i < D; i++) {
        if (bits == 8)
          c[(size_t)i * LANES] = j < V ? (uint8_t)(q[i] ^ 0x80) : 0; /* q - 128 as int8 */
        else if ((i & 1) == 0)
          c[(size_t)(i / 2) * LANES] = j < V ? q[i / 2] : 0; /* MLX's byte: i low, i + 1 high */
      }
      for (int g = 0; g < ng; g++) {
        size_t at = ((size_t)t * ng + g) * LANES + l;
        float s = j < V ? scales[(size_t)j * ng + g] : 0.0f;
        float b = j < V ? biases[(size_t)j * ng + g] : 0.0f;
        lscales[at] = s;
        lbiases[at] = bits == 8 ? (float)((double)b + 128.0 * (double)s) : b;
        zero = zero && lbiases[at] == 0.0f;
      }
    }
  return zero;
}

/* The sum of a group's n inputs: 16 lanes at a time, then across the lanes (a serial sum
   of a 16-row decode step's groups cost each call 10-15 us of one thread). */
static inline float group_sum(const float *x, int n) {
  lvf acc = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES) acc += lane_load(x + i);
  float s = 0.0f;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; i < n; i++) s += x[i];
  return s;
}

/* NB input rows (stride xs) against one tile: codes c, scales sc and biases bc of its ng
   groups; input sums xsum[b * ng + g] (read only with a bias term). */
#if defined(__AVX512F__) || !defined(__AVX2__)
#define LINEAR_TILE(NB, BITS)                                                               \
  static void linear_##NB##_##BITS(const uint8_t *c, const float *sc, const float *bc,     \
                                   int D, int G, int bias, const float *x, size_t xs,      \
                                   const float *xsum, float *o, size_t os, int valid,      \
                                   int ahead) {                                            \
    lvf acc[NB];                                                                            \
    int ng = D / G;                                                                         \
    for (int b = 0; b < NB; b++) acc[b] = (lvf){0};                                         \
    for (int g = 0; g < ng; g++) {                                                          \
      lvf part[NB];                                                                         \
      for (int b = 0; b < NB; b++) part[b] = (lvf){0};                                      \
      const float *xg = x + (size_t)g * G;                                                  \
      if (ahead) {                                                                          \
        size_t gb = (size_t)G * LANES * BITS / 8, tb = (size_t)D * LANES * BITS / 8;        \
        for (size_t line = 0; line < gb; line += 64)                                        \
          __builtin_prefetch(c + LINEAR_AHEAD * tb + (size_t)g * gb + line, 0, 0);          \
        __builtin_prefetch(sc + (size_t)(LINEAR_AHEAD * ng + g) * LANES, 0, 0);             \
        __builtin_prefetch(bc + (size_t)(LINEAR_AHEAD * ng + g) * LANES, 0, 0);             \
      }                                                                                     \
      if (BITS == 4) {                                                                      \
        const uint8_t *cg = c + (size_t)g * (G / 2) * LANES;                                \
        for (int p = 0; p < G / 2; p++) {                                                   \
          lvf lo, hi;                                                                       \
          lane_codes4(cg + (size_t)p * LANES, &lo, &hi);                                    \
          for (int b = 0; b < NB; b++) {                                                    \
            part[b] += xg[(size_t)b * xs + 2 * p] * lo;                                     \
            part[b] += xg[(size_t)b * xs + 2 * p + 1] * hi;                                 \
          }                                                                                 \
        }                                                                                   \
      } else {                                                                              \
        const uint8_t *cg = c + (size_t)g * G * LANES;                                      \
        for (int i = 0; i < G; i++) {                                                       \
          lvf w = lane_codes8(cg + (size_t)i * LANES);                                      \
          for (int b = 0; b < NB; b++) part[b] += xg[(size_t)b * xs + i] * w;               \
        }                                                                                   \
      }                                                                                     \
      lvf s = lane_load(sc + (size_t)g * LANES);                                            \
      for (int b = 0; b < NB; b++) acc[b] += part[b] * s;                                   \
      if (bias) {                                                                           \
        lvf bv = lane_load(bc + (size_t)g * LANES);                                         \
        for (int b = 0; b < NB; b++) acc[b] += xsum[(size_t)b * ng + g] * bv;               \
      }                                                                                     \
    }                                                                                       \
    size_t n = (size_t)(valid < LANES ? valid : LANES) * sizeof(float);                     \
    for (int b = 0; b < NB; b++) memcpy(o + (size_t)b * os, &acc[b], n);                    \
  }
#else
/* AVX2 (16 vector registers of 8 lanes): each tile is run as two 8-lane halves, so a half's
   NB accumulators, NB group sums, its codes and the broadcast input fit the registers.
   Each lane's arithmetic is the 16-lane form's, in the same order. */
#include <immintrin.h>
typedef float hvf __attribute__((vector_size(32)));
static inline hvf half_load(const float *p) { hvf v; memcpy(&v, p, sizeof v); return v; }
static inline hvf half_codes8(const uint8_t *c) {
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
  hvf v; memcpy(&v, &f, 32); return v;
}
static inline void half_codes4(const uint8_t *c, hvf *lo, hvf *hi) {
  __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
  __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
  __m256 b = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  memcpy(lo, &a, 32); memcpy(hi, &b, 32);
}
#define LINEAR_TILE(NB, BITS)                                                               \
  static void linear_##NB##_##BITS(const uint8_t *c, const float *sc, const float *bc,     \
                                   int D, int G, int bias, const float *x, size_t xs,      \
                                   const float *xsum, float *o, size_t os, int valid,      \
                                   int ahead) {                                            \
    int ng = D / G;                                                                         \
    for (int h = 0; h < 2; h++) {                                                           \
      int lanes = valid - 8 * h;                                                            \
      if (lanes <= 0) break;                                                                \
      hvf acc[NB];                                                                          \
      for (int b = 0; b < NB; b++) acc[b] = (hvf){0};                                       \
      for (int g = 0; g < ng; g++) {                                                        \
        hvf part[NB];                                                                       \
        for (int b = 0; b < NB; b++) part[b] = (hvf){0};                                    \
        const float *xg = x + (size_t)g * G;                                                \
        if (ahead && h == 0) {                                                              \
          size_t gb = (size_t)G * LANES * BITS / 8, tb = (size_t)D * LANES * BITS / 8;      \
          for (size_t line = 0; line < gb; line += 64)                                      \
            __builtin_prefetch(c + LINEAR_AHEAD * tb + (size_t)g * gb + line, 0, 0);        \
          __builtin_prefetch(sc + (size_t)(LINEAR_AHEAD * ng + g) * LANES, 0, 0);           \
          __builtin_prefetch(bc + (size_t)(LINEAR_AHEAD * ng + g) * LANES, 0, 0);           \
        }                                                                                   \
        if (BITS == 4) {                                                                    \
          const uint8_t *cg = c + (size_t)g * (G / 2) * LANES + 8 * h;                      \
          for (int p = 0; p < G / 2; p++) {                                                 \
            hvf lo, hi;                                                                     \
            half_codes4(cg + (size_t)p * LANES, &lo, &hi);                                  \
            for (int b = 0; b < NB; b++) {                                                  \
              part[b] += xg[(size_t)b * xs + 2 * p] * lo;                                   \
              part[b] += xg[(size_t)b * xs + 2 * p + 1] * hi;                               \
            }                                                                               \
          }                                                                                 \
        } else {                                                                            \
          const uint8_t *cg = c + (size_t)g * G * LANES + 8 * h;                            \
          for (int i = 0; i < G; i++) {                                                     \
            hvf w = half_codes8(cg + (size_t)i * LANES);                                    \
            for (int b = 0; b < NB; b++) part[b] += xg[(size_t)b * xs + i] * w;             \
          }                                                                                 \
        }                                                                                   \
        hvf s = half_load(sc + (size_t)g * LANES + 8 * h);                                  \
        for (int b = 0; b < NB; b++) acc[b] += part[b] * s;                                 \
        if (bias) {                                                                         \
          hvf bv = half_load(bc + (size_t)g * LANES + 8 * h);                               \
          for (int b = 0; b < NB; b++) acc[b] += xsum[(size_t)b * ng + g] * bv;             \
        }                                                                                   \
      }                                                                                     \
      size_t n = (size_t)(lanes < 8 ? lanes : 8) * sizeof(float);                           \
      for (int b = 0; b < NB; b++) memcpy(o + (size_t)b * os + 8 * h, &acc[b], n);          \
    }                                                                                       \
  }
#endif
LINEAR_TILE(8, 4) LINEAR_TILE(4, 4) LINEAR_TILE(2, 4) LINEAR_TILE(1, 4)
LINEAR_TILE(8, 8) LINEAR_TILE(4, 8) LINEAR_TILE(2, 8) LINEAR_TILE(1, 8)

int kv_qlinear(const float *x, int B, int D, const uint8_t *lcodes, const float *lscales,
               const float *lbiases, int V, int G, int bits, int bias, float *out) {
  linear_blocktime();
  int ng = D / G, tiles = (V + LANES - 1) / LANES;
  size_t tile_bytes = (size_t)D * LANES * bits / 8;
  float *xsum = NULL;
  if (bias) {
    xsum = (float *)malloc(sizeof(float) * ((size_t)B * ng + 1));
    if (xsum == NULL) return -1;
  }
#pragma omp parallel
  {
  /* The groups' input sums, shared by every tile: the team's first work, then a barrier. */
  if (bias) {
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++)
      for (int g = 0; g < ng; g++)
        xsum[(size_t)b * ng + g] = group_sum(x + (size_t)b * D + (size_t)g * G, G);
  }
#pragma omp for schedule(static)
  for (int t = 0; t < tiles; t++) {
    const uint8_t *c = lcodes + (size_t)t * tile_bytes;
    const float *sc = lscales + (size_t)t * ng * LANES, *bc = lbiases + (size_t)t * ng * LANES;
    int valid = V - t * LANES;
    float *o = out + (size_t)t * LANES;
    int b = 0;
#define LINEAR_RUN(NB, BITS)                                                                \
  for (; b + NB <= B; b += NB)                                                              \
    linear_##NB##_##BITS(c, sc, bc, D, G, bias, x + (size_t)b * D, (size_t)D,               \
                         xsum ? xsum + (size_t)b * ng : NULL, o + (size_t)b * V, (size_t)V,  \
                         valid, b == 0 && t + LINEAR_AHEAD < tiles);
    if (bits == 4) {
      LINEAR_RUN(8, 4) LINEAR_RUN(4, 4) LINEAR_RUN(2, 4) LINEAR_RUN(1, 4)
    } else {
      LINEAR_RUN(8, 8) LINEAR_RUN(4, 8) LINEAR_RUN(2, 8) LINEAR_RUN(1, 8)
    }
  }
  }
  free(xsum);
  return 0;
}

/* The vector width the tiles run at in this build, in bits: 512 (AVX-512), 256 (AVX2's
   8-lane halves), else 0 (the compiler's lowering of 16-lane vectors). */
int kv_qlinear_vector_bits(void) {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

/* The graph calls' form (kv_metal_kernels._graph_call): inputs x, the layout's codes,
   scales and biases; params B, D, V, G, bits, the first tile of the layout (V rows from
   there), whether the bias term is computed. */
int kv_qlinear_call(const void *const *in, const double *p, void *out) {
  size_t tile0 = (size_t)p[5], D = (size_t)p[1], ng = D / (size_t)p[3];
  const uint8_t *c = (const uint8_t *)in[1] + tile0 * D * LANES * (size_t)p[4] / 8;
  const float *s = (const float *)in[2] + tile0 * ng * LANES;
  const float *b = (const float *)in[3] + tile0 * ng * LANES;
  return kv_qlinear((const float *)in[0], (int)p[0], (int)D, c, s, b, (int)p[2], (int)p[3],
                    (int)p[4], (int)p[6], (float *)out);
}
"""
