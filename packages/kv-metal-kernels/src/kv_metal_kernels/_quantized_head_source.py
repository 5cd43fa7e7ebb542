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
#: (not the thread count, nor the other rows). Built for AVX2 without AVX-512, where a
#: 16-lane accumulator takes two of the 16 registers, the tiles are 4 x 2, 2 x 4 and 1 x 4
#: and run each 8-lane half of the chunks in turn, with the same bits (Gemma 3 270M's 8-bit
#: head on a 2-core AMD EPYC: 23.7 / 30.9 / 52.8 ms at 1 / 4 / 8 rows against 35.8 / 139.7
#: / about 260 as spilled 16-lane tiles; MKL's float32 product 62 / 85 / 138).
#: Under Intel's OpenMP runtime the calling thread's team spins for at most 2 ms after a
#: product. Returns 0, or -1 when its scratch cannot be allocated. Needs D and G multiples
#: of 16 and G dividing D.
#:
#: ``kv_qhead_greedy(x, B, D, codes, scales, biases, V, G, bits, <the screen's layout>,
#: out)``: ``out (B,)`` the argmax of each row of ``kv_qhead``'s logits (as float token ids),
#: through an integer screen over ``kv_qhead_screen_layout``'s copy of the codes and a
#: rigorous bound, the candidates recomputed by ``kv_qhead``'s own tile (the comment above
#: that section in the source says how); -2 where the build has no AVX-512 VNNI
#: (``kv_qhead_screen_supported``). Also needs G <= 256 and V < 2^24.
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
#elif defined(__AVX2__)
/* The same floats from two 8-lane halves (AVX2 without AVX-512); see the linear kernel. */
#include <immintrin.h>
static inline vf halves(__m256 a, __m256 b) {
  vf v; memcpy(&v, &a, 32); memcpy((char *)&v + 32, &b, 32); return v;
}
static inline vf codes8(const uint8_t *q, int c) {
  __m128i b = _mm_loadu_si128((const __m128i *)(q + c * 16));
  return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
static inline vf codes4(const uint8_t *q, int c) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * 8));
  __m128i m = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
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

#if defined(__AVX512F__) || !defined(__AVX2__)
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
#define PAIR_ROWS 8 /* input rows of the tiles that cover 2 of a tile's TJ rows at a time */
TILE(8, 2, 8) TILE(4, 4, 8) TILE(2, 4, 8) TILE(1, 4, 8)
TILE(8, 2, 4) TILE(4, 4, 4) TILE(2, 4, 4) TILE(1, 4, 4)
#else
/* AVX2 (16 registers of 8 lanes): a 16-lane accumulator is two registers, and every tile
   above spills. Here a tile runs each 8-lane half of its chunks in turn (the first half's
   accumulators set aside meanwhile), so NB * NJ + NJ + 1 registers are live: tiles of 4 x
   2, 2 x 4 and 1 x 4. Each lane adds the same products in the same order as above and the
   halves are summed as hsum sums them: the same bits as the 16-lane tiles. */
#include <immintrin.h>
static inline vf8 codes8_half(const uint8_t *q, int c, int h) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * 16 + 8 * h));
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  vf8 v; memcpy(&v, &f, 32); return v;
}
static inline vf8 codes4_half(const uint8_t *q, int c, int h) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * 8));
  __m128i n = _mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n));
  vf8 v; memcpy(&v, &f, 32); return v;
}
static inline vf8 load_f8(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum_halves(vf8 a, vf8 b) {
  a += b;
  vf4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char *)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
#define TILE(NB, NJ, BITS)                                                                \
  static void tile_##NB##_##NJ##_##BITS(const float *xp, int D, int G,                   \
                                        const uint8_t *const *q, const float *const *s,   \
                                        const float *const *bi, float *o, size_t ostride, \
                                        int rows, int pf) {                               \
    vf8 first[NB][NJ], acc[NB][NJ];                                                       \
    int nc = D / L, cpg = G / L;                                                          \
    for (int h = 0; h < 2; h++) {                                                         \
      for (int bb = 0; bb < NB; bb++)                                                     \
        for (int r = 0; r < NJ; r++) acc[bb][r] = (vf8){0};                               \
      for (int c = 0; c < nc; c++) {                                                      \
        int g = cpg == 2 ? c >> 1 : c / cpg;                                              \
        vf8 w[NJ];                                                                        \
        if (pf && h == 0 && c * 64 < TJ * D * BITS / 8)                                   \
          __builtin_prefetch(q[0] + (size_t)PF_TILES * TJ * D * BITS / 8 + c * 64, 0, 0); \
        if (pf && h == 0 && c * 64 < TJ * (D / G) * 4) {                                  \
          size_t ahead = (size_t)PF_TILES * TJ * (D / G);                                 \
          __builtin_prefetch((const char *)(s[0] + ahead) + c * 64, 0, 0);                \
          __builtin_prefetch((const char *)(bi[0] + ahead) + c * 64, 0, 0);               \
        }                                                                                 \
        for (int r = 0; r < NJ; r++) w[r] = codes##BITS##_half(q[r], c, h) * s[r][g] + bi[r][g]; \
        for (int bb = 0; bb < NB; bb++) {                                                 \
          vf8 xv = load_f8(xp + (size_t)bb * D + c * L + 8 * h);                          \
          for (int r = 0; r < NJ; r++) acc[bb][r] += xv * w[r];                           \
        }                                                                                 \
      }                                                                                   \
      if (h == 0) memcpy(first, acc, sizeof acc);                                         \
    }                                                                                     \
    for (int bb = 0; bb < NB; bb++)                                                       \
      for (int r = 0; r < rows; r++) o[bb * ostride + r] = hsum_halves(first[bb][r], acc[bb][r]); \
  }
#define PAIR_ROWS 4 /* input rows of the tiles that cover 2 of a tile's TJ rows at a time */
TILE(4, 2, 8) TILE(2, 4, 8) TILE(1, 4, 8)
TILE(4, 2, 4) TILE(2, 4, 4) TILE(1, 4, 4)
#endif

/* Intel's OpenMP runtime (MKL's): the calling thread's team sleeps 2 ms after a product
   instead of spinning for 200 ms on the cores MKL's own team needs next. Not at once: a
   decode step's linear layers call the kernel every few hundred microseconds, and waking
   sleeping workers for each call cost a 270M model's one-row step 6-8 ms. */
extern void kmp_set_blocktime(int) __attribute__((weak));
static __thread int blocktime_set;

static void set_blocktime(void) {
  if (!blocktime_set) {
    if (kmp_set_blocktime) kmp_set_blocktime(2);
    blocktime_set = 1;
  }
}

/* The input rows in the order the tiles read them (4-bit: each 16-input chunk's even
   inputs, then its odd ones), in a new buffer; NULL when it cannot be allocated. */
static float *kernel_rows(const float *x, int B, int D, int bits) {
  float *xp = (float *)malloc(sizeof(float) * (size_t)B * D + 64);
  if (xp == NULL) return NULL;
  for (int b = 0; b < B; b++)
    for (int c = 0; c < D / L; c++)
      for (int k = 0; k < L; k++) {
        int src = bits == 4 ? (k < 8 ? 2 * k : 2 * (k - 8) + 1) : k;
        xp[(size_t)b * D + c * L + k] = x[(size_t)b * D + c * L + src];
      }
  return xp;
}

/* The code, scale and bias rows of a tile of vocabulary rows j[0..rows) (the TJ - rows
   after them repeat the last). */
static void tile_rows(const uint32_t *codes, const float *scales, const float *biases,
                      size_t row_bytes, int ng, const int *j, int rows, const uint8_t **q,
                      const float **s, const float **bi) {
  for (int r = 0; r < TJ; r++) {
    int jr = j[r < rows ? r : rows - 1];
    q[r] = (const uint8_t *)codes + (size_t)jr * row_bytes;
    s[r] = scales + (size_t)jr * ng;
    bi[r] = biases + (size_t)jr * ng;
  }
}

int kv_qhead(const float *x, int B, int D, const uint32_t *codes, const float *scales,
             const float *biases, int V, int G, int bits, float *out) {
  set_blocktime();
  int ng = D / G;
  size_t row_bytes = (size_t)D * bits / 8;
  float *xp = kernel_rows(x, B, D, bits);
  if (xp == NULL) return -1;
  int tiles = (V + TJ - 1) / TJ;
#pragma omp parallel for schedule(static)
  for (int t = 0; t < tiles; t++) {
    int j0 = t * TJ, rows = V - j0 < TJ ? V - j0 : TJ;
    const uint8_t *q[TJ];
    const float *s[TJ], *bi[TJ];
    int js[TJ];
    for (int r = 0; r < TJ; r++) js[r] = j0 + r;
    tile_rows(codes, scales, biases, row_bytes, ng, js, rows, q, s, bi);
    int b = 0;
    float *o = out + j0;
#define PAIRS_OF(NB, BITS) tile_##NB##_2_##BITS
#define PAIRS(NB, BITS) PAIRS_OF(NB, BITS)
#define RUN8(BITS)                                                                      \
  for (; b + PAIR_ROWS <= B; b += PAIR_ROWS) {                                          \
    float *ob = o + (size_t)b * V;                                                      \
    const float *xb = xp + (size_t)b * D;                                               \
    PAIRS(PAIR_ROWS, BITS)(xb, D, G, q, s, bi, ob, V, rows < 2 ? rows : 2, b == 0);     \
    if (rows > 2)                                                                       \
      PAIRS(PAIR_ROWS, BITS)(xb, D, G, q + 2, s + 2, bi + 2, ob + 2, V, rows - 2, 0);   \
  }
#define RUN(NB, BITS)                                                                   \
  for (; b + NB <= B; b += NB)                                                          \
    tile_##NB##_4_##BITS(xp + (size_t)b * D, D, G, q, s, bi, o + (size_t)b * V, V, rows, b == 0);
#if PAIR_ROWS > 4
#define RUN4(BITS) RUN(4, BITS)
#else
#define RUN4(BITS)
#endif
    if (bits == 8) {
      RUN8(8) RUN4(8) RUN(2, 8) RUN(1, 8)
    } else {
      RUN8(4) RUN4(4) RUN(2, 4) RUN(1, 4)
    }
  }
  free(xp);
  return 0;
}

/* ---- The greedy head: the argmax of kv_qhead's logits without computing all of them. ----

   Screen: each group g of an input row x is rounded to 8 bits, x_i = a_g * xq_i + r_i
   (a_g = max over the group of |x| / 127, |xq| <= 127: a scale per group keeps a few large
   features from coarsening the rest), and multiplied by the head's codes in integers
   (AVX-512 VNNI: 64 byte products an instruction) in a layout of 16 vocabulary rows a
   vector, lane = vocabulary row: S_j = sum_g a_g (s_jg I_jg + b_jg Q_g), I_jg the integer
   product of group g, Q_g the sum of its xq. The logit kv_qhead computes, F_j, differs from
   S_j by at most E_j = sum_g max_g|r| N_jg + max|x| c M_j, N_jg = sum_{i in g} |q_ji s_jg +
   b_jg| (the row's L1 norm over the group), M_j = sum_i (q_ji |s_jg| + |b_jg|) and c = 2 u
   (D / 16 + 2 D / G + 16) (u = 2^-24): the first term is the rounding of x, the second
   covers the float roundings of both sums (kv_qhead's: at most D / 16 + 4 a lane; the
   screen's about D / G + 3). So the argmax lies among the rows whose S_j + E_j reaches
   L = max_k (S_k - E_k), and those (one to a few for Gemma 3 270M) are computed by
   kv_qhead's own tile, whose arithmetic for an output depends on nothing but that output's
   row and input: the same bits. Ties go to the lowest index, as MLX's argmax. A row that is
   not finite, all zero or too large for the bound to stay finite is computed whole (NaN
   first, as MLX's argmax). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#define KV_SCREEN 1
#else
#define KV_SCREEN 0
#endif
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

/* Whether this build has the screen (kv_qhead_greedy returns -2 otherwise). */
int kv_qhead_screen_supported(void) { return KV_SCREEN; }

#define SV 16 /* vocabulary rows a screen tile: the lanes of a vector */
/* While a thread's first input rows screen a tile, the tile SCREEN_AHEAD ahead (the
   thread's next ones: its tiles are consecutive) is fetched, a group's lines at a time:
   without it the screen waited on the codes (Gemma 3 270M's head at 16 rows, 2-core AMD
   EPYC: 6.0 against 11.2 ms, one row 3.9 against 4.9). */
#ifndef SCREEN_AHEAD
#define SCREEN_AHEAD 2
#endif

/* The screen's tiles of a V-row head. */
static int screen_tiles(int V) { return (V + SV - 1) / SV; }

/* The smallest float at least v (v >= 0, finite). */
static float float_up(double v) {
  float f = (float)v;
  if ((double)f < v) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u++;
    memcpy(&f, &u, 4);
  }
  return f;
}

/* The head's zero point: z where every group's bias is exactly -z times its scale (a
   symmetric head, as a GGUF's Q8_0 or Q4_0 blocks), 0 <= z < 2^bits; else -1. n: the
   number of groups (rows times groups a row). */
int kv_qhead_zero_point(const float *scales, const float *biases, size_t n, int bits) {
  double z = -1.0;
  for (size_t i = 0; i < n && z < 0.0; i++)
    if (scales[i] != 0.0f) z = __builtin_round(-(double)biases[i] / (double)scales[i]);
  if (z < 0.0) z = 0.0; /* every scale zero: symmetric only if every bias is zero too */
  if (z > (double)((1 << bits) - 1)) return -1;
  /* Exact in double: z has at most 8 significant bits and the scale 24. */
  for (size_t i = 0; i < n; i++)
    if ((double)biases[i] != -z * (double)scales[i]) return -1;
  return (int)z;
}

/* The screen's layout of a head: codes (tiles of SV rows: for each group, for each 4 inputs
   of it, 64 bytes, lane l's 4 codes at 4 l; rows past V are zero), scales, biases (not
   written for a symmetric head: zero >= 0, its kv_qhead_zero_point) and the group norms N
   (float, rounded up) [tile][group][lane], and the rows' M [tile][lane] (double). */
int kv_qhead_screen_layout(const uint32_t *codes, const float *scales, const float *biases,
                           int V, int D, int G, int bits, int zero, uint8_t *tcodes,
                           float *tscales, float *tbiases, float *tnorms, double *norms) {
  int ng = D / G, kc = G / 4, tiles = screen_tiles(V);
  size_t row_bytes = (size_t)D * bits / 8;
#pragma omp parallel for schedule(static)
  for (int t = 0; t < tiles; t++)
    for (int l = 0; l < SV; l++) {
      int j = t * SV + l;
      const uint8_t *q = (const uint8_t *)codes + (size_t)(j < V ? j : 0) * row_bytes;
      double m = 0;
      for (int g = 0; g < ng; g++) {
        float sc = j < V ? scales[(size_t)j * ng + g] : 0.0f;
        float bc = j < V ? biases[(size_t)j * ng + g] : 0.0f;
        size_t at = ((size_t)t * ng + g) * SV + l;
        double n = 0;
        for (int i = 0; i < G; i++) {
          int d = g * G + i;
          int c = j >= V ? 0 : bits == 8 ? q[d] : (q[d >> 1] >> (4 * (d & 1))) & 15;
          tcodes[(((size_t)t * ng + g) * kc + i / 4) * 64 + l * 4 + (i & 3)] = (uint8_t)c;
          n += __builtin_fabs((double)c * sc + bc);
          m += (double)c * __builtin_fabs((double)sc) + __builtin_fabs((double)bc);
        }
        tscales[at] = sc;
        if (zero < 0) tbiases[at] = bc;
        /* Each sum's own rounding is below 2^-40 of it. */
        tnorms[at] = float_up(n * (1.0 + 0x1p-30));
      }
      norms[(size_t)t * SV + l] = m * (1.0 + 0x1p-30);
    }
  return 0;
}

#if KV_SCREEN
/* NB rows' screen values of one tile: f[b] lane l = S of row l, e[b] lane l = the sum of
   the groups' rounding bounds (float, rounded below their sum by at most ng + 1 float
   roundings). KC: 4-input steps a group (0: kc, known at run time only). Each group's
   integer products are NB independent chains of dependent VNNI instructions. SYM: the head
   is symmetric with zero point z (head_zero), and zq[b][g] = -z Q_g: a group's integer sum
   starts there, so it is I_jg - z Q_g, exact (|.| < 2^24 for groups of up to 256), and
   S_j = sum_g a_g s_jg (I_jg - z Q_g), the same value without the bias term's two float
   operations. */
#define SCREEN(NB, KC, SYM)                                                                 \
  static void screen_##NB##_##KC##_##SYM(const uint8_t *tc, const float *ts, const float *tb,\
                                 const float *tn, int ng, int kc, const int32_t *xq,         \
                                 size_t xstride, const float *qs, const float *ag,           \
                                 const float *rg, const int32_t *zq, __m512 *f, __m512 *e,  \
                                 size_t ahead) {                                             \
    __m512 sum[NB], err[NB];                                                                 \
    int steps = KC ? KC : kc;                                                                \
    for (int bb = 0; bb < NB; bb++) sum[bb] = err[bb] = _mm512_setzero_ps();                 \
    for (int g = 0; g < ng; g++) {                                                           \
      __m512i acc[NB];                                                                       \
      if (ahead) {                                                                           \
        const char *pc = (const char *)(tc + ahead * ng * steps * 64 + (size_t)g * steps * 64); \
        for (int line = 0; line < steps; line++) __builtin_prefetch(pc + line * 64, 0, 0);   \
        __builtin_prefetch(ts + ahead * ng * SV + (size_t)g * SV, 0, 0);                     \
        __builtin_prefetch(tn + ahead * ng * SV + (size_t)g * SV, 0, 0);                     \
        if (!SYM) __builtin_prefetch(tb + ahead * ng * SV + (size_t)g * SV, 0, 0);           \
      }                                                                                      \
      for (int bb = 0; bb < NB; bb++)                                                        \
        acc[bb] = SYM ? _mm512_set1_epi32(zq[(size_t)bb * ng + g]) : _mm512_setzero_si512();  \
      const uint8_t *w = tc + (size_t)g * steps * 64;                                        \
      const int32_t *xg = xq + (size_t)g * steps;                                            \
      for (int k = 0; k < steps; k++) {                                                      \
        __m512i wv = _mm512_loadu_si512((const void *)(w + k * 64));                         \
        for (int bb = 0; bb < NB; bb++)                                                      \
          acc[bb] = _mm512_dpbusd_epi32(acc[bb], wv, _mm512_set1_epi32(xg[bb * xstride + k])); \
      }                                                                                      \
      __m512 sv = _mm512_loadu_ps(ts + g * SV), bv = _mm512_loadu_ps(tb + g * SV);           \
      __m512 nv = _mm512_loadu_ps(tn + g * SV);                                              \
      for (int bb = 0; bb < NB; bb++) {                                                      \
        size_t at = (size_t)bb * ng + g;                                                     \
        __m512 part = SYM ? _mm512_mul_ps(sv, _mm512_cvtepi32_ps(acc[bb]))                   \
                          : _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(acc[bb]),                 \
                                            _mm512_mul_ps(bv, _mm512_set1_ps(qs[at])));      \
        sum[bb] = _mm512_fmadd_ps(part, _mm512_set1_ps(ag[at]), sum[bb]);                    \
        err[bb] = _mm512_fmadd_ps(nv, _mm512_set1_ps(rg[at]), err[bb]);                      \
      }                                                                                      \
    }                                                                                        \
    for (int bb = 0; bb < NB; bb++) f[bb] = sum[bb], e[bb] = err[bb];                        \
  }
SCREEN(8, 8, 0) SCREEN(4, 8, 0) SCREEN(2, 8, 0) SCREEN(1, 8, 0)
SCREEN(8, 0, 0) SCREEN(4, 0, 0) SCREEN(2, 0, 0) SCREEN(1, 0, 0)
SCREEN(8, 8, 1) SCREEN(4, 8, 1) SCREEN(2, 8, 1) SCREEN(1, 8, 1)
SCREEN(8, 0, 1) SCREEN(4, 0, 1) SCREEN(2, 0, 1) SCREEN(1, 0, 1)
#endif

typedef struct {
  int b, j;
  double upper;
} screen_hit;

/* kv_qhead's logits of row xr (in the tiles' input order) for the n <= TJ vocabulary rows
   js, into o: each output by the same arithmetic as kv_qhead's. */
static void logits_of(const float *xr, int D, int G, int bits, const uint32_t *codes,
                      const float *scales, const float *biases, const int *js, int n, float *o) {
  const uint8_t *q[TJ];
  const float *s[TJ], *bi[TJ];
  tile_rows(codes, scales, biases, (size_t)D * bits / 8, D / G, js, n, q, s, bi);
  if (bits == 8)
    tile_1_4_8(xr, D, G, q, s, bi, o, 1, n, 0);
  else
    tile_1_4_4(xr, D, G, q, s, bi, o, 1, n, 0);
}

/* Row x's argmax over all V logits (kv_qhead's), computed whole: the first NaN, else the
   first maximum. */
static int whole_argmax(const float *xr, int D, int G, int bits, const uint32_t *codes,
                        const float *scales, const float *biases, int V) {
  int best_j = 0, js[TJ];
  float best = 0.0f, o[TJ];
  for (int j0 = 0; j0 < V; j0 += TJ) {
    int rows = V - j0 < TJ ? V - j0 : TJ;
    for (int r = 0; r < TJ; r++) js[r] = j0 + r;
    logits_of(xr, D, G, bits, codes, scales, biases, js, rows, o);
    for (int r = 0; r < rows; r++) {
      if (o[r] != o[r]) return j0 + r;
      if (j0 + r == 0 || o[r] > best) best = o[r], best_j = j0 + r;
    }
  }
  return best_j;
}

/* Rounds row x's groups to 8 bits: xq, the groups' sums of xq (qs), scales (ag) and
   rounding bounds (rg, rounded up); returns max |x|, or -1 when the row is not finite. */
static float screen_row(const float *x, int D, int G, int8_t *xq, float *qs, float *ag,
                        float *rg) {
  float top = 0.0f;
  for (int g = 0; g < D / G; g++) {
    const float *xg = x + (size_t)g * G;
    float m = 0.0f;
    for (int i = 0; i < G; i++) {
      float v = __builtin_fabsf(xg[i]);
      if (!(v <= 3.0e38f)) return -1.0f;
      if (v > m) m = v;
    }
    float a = m / 127.0f;
    double rmax = 0.0;
    int sum = 0;
    for (int i = 0; i < G; i++) {
      int qi = 0;
      if (a > 0.0f) {
        float v = xg[i] / a;
        qi = (int)(v + (v >= 0.0f ? 0.5f : -0.5f));
        qi = qi > 127 ? 127 : qi < -127 ? -127 : qi;
      }
      /* Exact in double: both sides have at most 31 significant bits within 2^32 of x. */
      double r = __builtin_fabs((double)xg[i] - (double)a * qi);
      if (r > rmax) rmax = r;
      xq[g * G + i] = (int8_t)qi;
      sum += qi;
    }
    qs[g] = (float)sum;
    ag[g] = a;
    rg[g] = float_up(rmax * (1.0 + 0x1p-30));
    if (m > top) top = m;
  }
  return top;
}

int kv_qhead_greedy(const float *x, int B, int D, const uint32_t *codes, const float *scales,
                    const float *biases, int V, int G, int bits, const uint8_t *tcodes,
                    const float *tscales, const float *tbiases, const float *tnorms,
                    const double *norms, int zero, float *out) {
#if !KV_SCREEN
  (void)x, (void)B, (void)D, (void)codes, (void)scales, (void)biases, (void)V, (void)G;
  (void)bits, (void)tcodes, (void)tscales, (void)tbiases, (void)tnorms, (void)norms;
  (void)zero, (void)out;
  return -2;
#else
  set_blocktime();
  int ng = D / G, kc = G / 4, tiles = screen_tiles(V), threads = omp_get_max_threads();
  size_t xstride = (size_t)D / 4;
  double c = 2.0 * (D / 16 + 2 * ng + 16) * 0x1p-24;
  /* The float sum of the groups' bounds is below the exact one by at most (ng + 1) u. */
  double grow = 1.0 + 2.0 * (ng + 2) * 0x1p-24;
  int32_t *xq = (int32_t *)malloc((size_t)B * D + 64);
  float *qs = malloc(sizeof(float) * (size_t)B * ng), *ag = malloc(sizeof(float) * (size_t)B * ng);
  float *rg = malloc(sizeof(float) * (size_t)B * ng);
  int32_t *zq = malloc(sizeof(int32_t) * (size_t)B * ng);
  double *ex = malloc(sizeof(double) * B);
  double *lows = malloc(sizeof(double) * (size_t)threads * B);
  int *whole = malloc(sizeof(int) * B), *counts = calloc(threads, sizeof(int));
  screen_hit **hits = calloc(threads, sizeof(screen_hit *));
  float *xp = kernel_rows(x, B, D, bits);
  size_t *starts = NULL;
  screen_hit *byrow = NULL;
  int status = 0;
  if (!xq || !qs || !ag || !rg || !zq || !ex || !lows || !whole || !counts || !hits || !xp) {
    status = -1;
    goto done;
  }
  for (int b = 0; b < B; b++) {
    size_t at = (size_t)b * ng;
    int8_t *qb = (int8_t *)xq + (size_t)b * D;
    float m = screen_row(x + (size_t)b * D, D, G, qb, qs + at, ag + at, rg + at);
    whole[b] = !(m > 0.0f) || m > 1.0e30f;
    if (whole[b]) {
      memset(qb, 0, (size_t)D);
      for (int g = 0; g < ng; g++) qs[at + g] = ag[at + g] = rg[at + g] = 0.0f;
    }
    ex[b] = whole[b] ? 0.0 : (double)m * c;
    for (int g = 0; g < ng; g++) zq[at + g] = zero > 0 ? -zero * (int32_t)qs[at + g] : 0;
  }
  /* Every thread's slots start empty: a team may have fewer threads than the maximum. */
  for (size_t i = 0; i < (size_t)threads * B; i++) lows[i] = -__builtin_inf();
#pragma omp parallel
  {
    int tid = omp_get_thread_num();
    double *low = lows + (size_t)tid * B;
    screen_hit *mine = NULL;
    int n = 0, cap = 0, failed = 0;
    __m512 f[8], e[8];
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
      size_t tg = (size_t)t * ng * SV;
      const uint8_t *tc = tcodes + (size_t)t * ng * kc * 64;
      const float *ts = tscales + tg, *tb = tbiases + tg, *tn = tnorms + tg;
      const double *mt = norms + (size_t)t * SV;
      __m512d mlo = _mm512_loadu_pd(mt), mhi = _mm512_loadu_pd(mt + 8);
      int valid = V - t * SV < SV ? V - t * SV : SV;
      __mmask8 vlo = valid >= 8 ? 0xff : (__mmask8)((1u << valid) - 1);
      __mmask8 vhi = valid <= 8 ? 0 : (__mmask8)((1u << (valid - 8)) - 1);
      for (int b0 = 0; b0 < B;) {
        int nb = B - b0 >= 8 ? 8 : B - b0 >= 4 ? 4 : B - b0 >= 2 ? 2 : 1;
        const int32_t *xb = xq + (size_t)b0 * xstride;
        size_t at = (size_t)b0 * ng;
#define SCREEN_ARGS tc, ts, tb, tn, ng, kc, xb, xstride, qs + at, ag + at, rg + at, zq + at, f, e, \
                    b0 == 0 && t + SCREEN_AHEAD < tiles ? (size_t)SCREEN_AHEAD : 0
#define SCREEN_CALL(KC, SYM)                                                                \
  if (nb == 8)                                                                              \
    screen_8_##KC##_##SYM(SCREEN_ARGS);                                                     \
  else if (nb == 4)                                                                         \
    screen_4_##KC##_##SYM(SCREEN_ARGS);                                                     \
  else if (nb == 2)                                                                         \
    screen_2_##KC##_##SYM(SCREEN_ARGS);                                                     \
  else                                                                                      \
    screen_1_##KC##_##SYM(SCREEN_ARGS);
        if (zero >= 0) {
          if (kc == 8) {
            SCREEN_CALL(8, 1)
          } else {
            SCREEN_CALL(0, 1)
          }
        } else if (kc == 8) {
          SCREEN_CALL(8, 0)
        } else {
          SCREEN_CALL(0, 0)
        }
        for (int bb = 0; bb < nb; bb++) {
          int b = b0 + bb;
          if (whole[b]) continue;
          __m512d slo = _mm512_cvtps_pd(_mm512_castps512_ps256(f[bb]));
          __m512d shi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f[bb], 1));
          __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(e[bb]));
          __m512d ehi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(e[bb], 1));
          __m512d kg = _mm512_set1_pd(grow), rx = _mm512_set1_pd(ex[b]);
          elo = _mm512_fmadd_pd(elo, kg, _mm512_mul_pd(rx, mlo));
          ehi = _mm512_fmadd_pd(ehi, kg, _mm512_mul_pd(rx, mhi));
          __m512d ninf = _mm512_set1_pd(-__builtin_inf());
          __m512d llo = _mm512_mask_sub_pd(ninf, vlo, slo, elo);
          __m512d lhi = _mm512_mask_sub_pd(ninf, vhi, shi, ehi);
          double m = _mm512_reduce_max_pd(_mm512_max_pd(llo, lhi));
          if (m > low[b]) low[b] = m;
          __m512d ulo = _mm512_add_pd(slo, elo), uhi = _mm512_add_pd(shi, ehi);
          __m512d lb = _mm512_set1_pd(low[b]);
          unsigned hit = (unsigned)_mm512_mask_cmp_pd_mask(vlo, ulo, lb, _CMP_GE_OQ) |
                         ((unsigned)_mm512_mask_cmp_pd_mask(vhi, uhi, lb, _CMP_GE_OQ) << 8);
          double ups[SV];
          if (hit) {
            _mm512_storeu_pd(ups, ulo);
            _mm512_storeu_pd(ups + 8, uhi);
          }
          while (hit && !failed) {
            int l = __builtin_ctz(hit);
            hit &= hit - 1;
            if (n == cap) {
              int grown = cap ? 2 * cap : 256;
              screen_hit *more = realloc(mine, sizeof(screen_hit) * (size_t)grown);
              if (!more) {
                failed = 1;
                break;
              }
              mine = more, cap = grown;
            }
            mine[n].b = b, mine[n].j = t * SV + l, mine[n].upper = ups[l];
            n++;
          }
        }
        b0 += nb;
      }
    }
    hits[tid] = mine;
    counts[tid] = failed ? -1 : n;
  }
  size_t total = 0;
  for (int t = 0; t < threads; t++) {
    if (counts[t] < 0) status = -1;
    else total += (size_t)counts[t];
  }
  /* The hits by row (each thread's are in vocabulary order). */
  starts = calloc((size_t)B + 1, sizeof(size_t));
  byrow = malloc(sizeof(screen_hit) * (total ? total : 1));
  if (status || !starts || !byrow) {
    status = -1;
    goto done;
  }
  for (int t = 0; t < threads; t++)
    for (int h = 0; h < counts[t]; h++) starts[hits[t][h].b + 1]++;
  for (int b = 0; b < B; b++) starts[b + 1] += starts[b];
  for (int t = 0; t < threads; t++)
    for (int h = 0; h < counts[t]; h++) {
      screen_hit e = hits[t][h];
      byrow[starts[e.b]++] = e;
    }
  for (int b = B; b > 0; b--) starts[b] = starts[b - 1];
  starts[0] = 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (int b = 0; b < B; b++) {
    const float *xr = xp + (size_t)b * D;
    int best_j = -1, fallback = whole[b], js[TJ], nj = 0;
    float best = 0.0f, o[TJ];
    double floor_b = -__builtin_inf();
    for (int t = 0; t < threads; t++)
      if (lows[(size_t)t * B + b] > floor_b) floor_b = lows[(size_t)t * B + b];
    for (size_t h = starts[b]; h <= starts[b + 1] && !fallback; h++) {
      int last = h == starts[b + 1];
      if (!last) {
        if (!(byrow[h].upper >= floor_b)) continue;
        js[nj++] = byrow[h].j;
      }
      if (nj == TJ || (last && nj)) {
        logits_of(xr, D, G, bits, codes, scales, biases, js, nj, o);
        for (int r = 0; r < nj; r++) {
          if (!(__builtin_fabsf(o[r]) <= 3.0e38f)) fallback = 1;
          else if (best_j < 0 || o[r] > best || (o[r] == best && js[r] < best_j))
            best = o[r], best_j = js[r];
        }
        nj = 0;
      }
    }
    if (fallback || best_j < 0) best_j = whole_argmax(xr, D, G, bits, codes, scales, biases, V);
    out[b] = (float)best_j;
  }
done:
  for (int t = 0; hits && t < threads; t++) free(hits[t]);
  free(starts), free(byrow), free(hits), free(counts), free(whole), free(lows);
  free(ex), free(zq), free(rg), free(ag), free(qs), free(xq), free(xp);
  return status;
#endif
}

/* The head's rows from row0 on: its codes, scales and biases. */
static void head_rows(const void *const *in, const double *p, const uint32_t **codes,
                      const float **scales, const float **biases) {
  size_t row0 = (size_t)p[5], ng = (size_t)p[1] / (size_t)p[3];
  *codes = (const uint32_t *)((const uint8_t *)in[1] + row0 * (size_t)p[1] * (size_t)p[4] / 8);
  *scales = (const float *)in[2] + row0 * ng;
  *biases = (const float *)in[3] + row0 * ng;
}

/* The graph calls' form: inputs x, codes, scales, biases, the screen's codes, scales,
   biases, group norms and row norms; params B, D, V, G, bits, the first row of the head's
   arrays (V rows from there), the head's zero point. */
int kv_qhead_greedy_call(const void *const *in, const double *p, void *out) {
  const uint32_t *codes;
  const float *scales, *biases;
  head_rows(in, p, &codes, &scales, &biases);
  return kv_qhead_greedy((const float *)in[0], (int)p[0], (int)p[1], codes, scales, biases,
                         (int)p[2], (int)p[3], (int)p[4], (const uint8_t *)in[4],
                         (const float *)in[5], (const float *)in[6], (const float *)in[7],
                         (const double *)in[8], (int)p[6], (float *)out);
}

/* The graph calls' form (kv_metal_kernels._graph_call): inputs x, codes, scales, biases;
   params B, D, V, G, bits, the first row of the head's arrays (V rows from there). */
int kv_qhead_call(const void *const *in, const double *p, void *out) {
  const uint32_t *codes;
  const float *scales, *biases;
  head_rows(in, p, &codes, &scales, &biases);
  return kv_qhead((const float *)in[0], (int)p[0], (int)p[1], codes, scales, biases, (int)p[2],
                  (int)p[3], (int)p[4], (float *)out);
}
"""
