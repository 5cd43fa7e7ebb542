"""The C source of the CPU paged decode attention (:mod:`kv_metal_kernels._cpu_attention`)."""

from __future__ import annotations

__all__ = ["CPU_ATTENTION_SOURCE"]

#: ``kv_paged_attention(q, B, Hq, T, D, k_pool, v_pool, Hkv, num_slots, table, max_pages,
#: seq_lens, page_size, scale, window, sinks, out)``: float32 ``q (B, Hq, T, D)`` against
#: the head-major pools ``(Hkv, num_slots, D)``, query head ``h`` reading kv head ``h /
#: (Hq / Hkv)``. Query ``t`` of row ``b`` is at position ``p = max(seq_lens[b] - T + t, 0)``
#: and attends positions ``max(0, p - window + 1) .. p`` (``window`` 0: from 0), position
#: ``j`` held at slot ``table[b, j / page_size] * page_size + j % page_size``. ``q`` is
#: scaled first, the scores' maximum subtracted before ``expf`` and the weighted values
#: divided by the weights' sum (plus ``expf(sinks[h] - max)`` where ``sinks`` is given, the
#: maximum then taken over the sink too): the reference's order of operations. One
#: ``(row, kv head)`` pair per OpenMP iteration, its query heads reading each key and value
#: row once (one ``(row, query head)`` pair where there are fewer than two such pairs a
#: thread); nothing is gathered. Returns 0, or -1
#: when its scratch cannot be allocated. The caller has checked every page id and length.
CPU_ATTENTION_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline float dot(const float *a, const float *b, int n) {
  v8 s0 = {0}, s1 = {0};
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    v8 a0, b0, a1, b1;
    memcpy(&a0, a + d, 32); memcpy(&b0, b + d, 32);
    memcpy(&a1, a + d + 8, 32); memcpy(&b1, b + d + 8, 32);
    s0 += a0 * b0;
    s1 += a1 * b1;
  }
  s0 += s1;
  float r = ((s0[0] + s0[4]) + (s0[2] + s0[6])) + ((s0[1] + s0[5]) + (s0[3] + s0[7]));
  for (; d < n; d++) r += a[d] * b[d];
  return r;
}

/* Key and value rows are fetched ROW_AHEAD positions ahead of their use: a request's rows
   are in pages scattered over the pool, whose reads waited on memory (16 rows of 160-175
   positions in randomly placed pages, 4 query heads on one kv head of 256, 18 pools:
   3.2 against 8.5 ms on a 2-core AMD EPYC). */
#ifndef ROW_AHEAD
#define ROW_AHEAD 4
#endif

static inline void row_prefetch(const float *base, const int32_t *pages, int page_size,
                                long long j, int D) {
  size_t slot = (size_t)pages[j / page_size] * page_size + (size_t)(j % page_size);
  const char *row = (const char *)(base + slot * D);
  for (size_t line = 0; line < (size_t)D * sizeof(float); line += 64)
    __builtin_prefetch(row + line, 0, 0);
}

int kv_paged_attention(const float *q, int B, int Hq, int T, int D, const float *k_pool,
                       const float *v_pool, int Hkv, long long num_slots,
                       const int32_t *table, int max_pages, const int32_t *seq_lens,
                       int page_size, float scale, int window, const float *sinks,
                       float *out) {
  int group = Hq / Hkv, failed = 0;
  long long capacity = (long long)max_pages * page_size;
  /* Heads per work item: a kv head's whole group reads each key and value row once for
     all its query heads where there are enough (row, kv head) items to keep the threads
     busy, else one query head per item. Each head's arithmetic is the same either way. */
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  int heads = B * Hkv >= 2 * threads ? group : 1;
  int items = B * (Hq / heads);
#pragma omp parallel for schedule(dynamic, 1)
  for (int item = 0; item < items; item++) {
    int b = item / (Hq / heads), h0 = (item % (Hq / heads)) * heads, kv = h0 / group;
    const float *keys = k_pool + (size_t)kv * (size_t)num_slots * D;
    const float *vals = v_pool + (size_t)kv * (size_t)num_slots * D;
    const int32_t *pages = table + (size_t)b * max_pages;
    long long len = seq_lens[b];
    long long most = len < capacity ? len : capacity;
    size_t span = (size_t)(most > 0 ? most : 1);
    float *scores = (float *)malloc(sizeof(float) * span * heads);
    float *qs = (float *)malloc(sizeof(float) * (size_t)D * heads);
    float *acc = (float *)malloc(sizeof(float) * (size_t)D * heads);
    float peaks[heads], totals[heads];
    if (scores == NULL || qs == NULL || acc == NULL) {
#pragma omp atomic write
      failed = 1;
      free(scores); free(qs); free(acc);
      continue;
    }
    for (int t = 0; t < T; t++) {
      long long p = len - T + t;
      if (p < 0) p = 0;
      if (p > capacity - 1) p = capacity - 1;
      long long lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
      for (int i = 0; i < heads; i++) {
        const float *qt = q + (((size_t)b * Hq + h0 + i) * T + t) * D;
        for (int d = 0; d < D; d++) qs[(size_t)i * D + d] = qt[d] * scale;
        peaks[i] = -INFINITY;
      }
      for (long long j = lo; j <= p; j++) {
        size_t slot = (size_t)pages[j / page_size] * page_size + (size_t)(j % page_size);
        const float *k = keys + slot * D;
        if (j + ROW_AHEAD <= p) row_prefetch(keys, pages, page_size, j + ROW_AHEAD, D);
        for (int i = 0; i < heads; i++) {
          float s = dot(qs + (size_t)i * D, k, D);
          scores[(size_t)i * span + (size_t)(j - lo)] = s;
          if (s > peaks[i]) peaks[i] = s;
        }
      }
      for (int i = 0; i < heads; i++) {
        if (sinks != NULL && sinks[h0 + i] > peaks[i]) peaks[i] = sinks[h0 + i];
        totals[i] = 0.0f;
        for (int d = 0; d < D; d++) acc[(size_t)i * D + d] = 0.0f;
      }
      for (long long j = lo; j <= p; j++) {
        size_t slot = (size_t)pages[j / page_size] * page_size + (size_t)(j % page_size);
        const float *v = vals + slot * D;
        if (j + ROW_AHEAD <= p) row_prefetch(vals, pages, page_size, j + ROW_AHEAD, D);
        for (int i = 0; i < heads; i++) {
          float w = expf(scores[(size_t)i * span + (size_t)(j - lo)] - peaks[i]);
          float *a = acc + (size_t)i * D;
          totals[i] += w;
          for (int d = 0; d < D; d++) a[d] += w * v[d];
        }
      }
      for (int i = 0; i < heads; i++) {
        float *ot = out + (((size_t)b * Hq + h0 + i) * T + t) * D;
        float total = totals[i];
        if (sinks != NULL) total += expf(sinks[h0 + i] - peaks[i]);
        for (int d = 0; d < D; d++) ot[d] = acc[(size_t)i * D + d] / total;
      }
    }
    free(scores); free(qs); free(acc);
  }
  return failed ? -1 : 0;
}

/* The graph calls' form (kv_metal_kernels._graph_call): inputs q, k_pool, v_pool, table,
   seq_lens and, where params[10] is 1, sinks; params B, Hq, T, D, Hkv, num_slots,
   max_pages, page_size, scale, window, has_sinks. */
int kv_paged_attention_call(const void *const *in, const double *p, void *out) {
  return kv_paged_attention((const float *)in[0], (int)p[0], (int)p[1], (int)p[2], (int)p[3],
                            (const float *)in[1], (const float *)in[2], (int)p[4],
                            (long long)p[5], (const int32_t *)in[3], (int)p[6],
                            (const int32_t *)in[4], (int)p[7], (float)p[8], (int)p[9],
                            p[10] != 0.0 ? (const float *)in[5] : NULL, (float *)out);
}
"""
