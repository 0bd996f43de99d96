/* Decode attention over the paged KV cache on the CPU: one query token per sequence, read straight from the
 * cache's blocks. PyTorch's ops would gather each sequence's blocks into a contiguous copy first (a write and a
 * second read of all of K and V, every layer) and pad every sequence to the longest; here each K and V row is
 * read once, where it lies, up to the sequence's own length. Plain C over raw float32 buffers, built with the other
 * CPU kernels into one library (cpu_kernels.py) and called through ctypes; the loops are written for the compiler to
 * vectorise. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* One sequence: out[H][D] from q[H][D] over its first len slots. scores: H * len floats of scratch, acc: H * D. */
static void one_sequence(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                         int64_t len, int64_t H, int64_t G, int64_t D, int64_t bs, int64_t row, float scale,
                         float *scores, float *acc, float *out) {
  /* Every head together: each slot's K (then V) row, all heads' parts side by side, is read once and whole. */
  for (int64_t t = 0; t < len; ++t) {
    const float *krow = k_cache + (table[t / bs] * bs + t % bs) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float *qv = q + h * D, *kv = krow + (h / G) * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qv[d] * kv[d];
      scores[h * len + t] = s * scale;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float *sh = scores + h * len;
    float m = sh[0], sum = 0.0f;
    for (int64_t t = 1; t < len; ++t) m = sh[t] > m ? sh[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      const float e = exp_nonpositive(sh[t] - m);
      sh[t] = e;
      sum += e;
    }
    scores[H * len + h] = 1.0f / sum; /* the row's 1 / sum, after the rows */
  }
  memset(acc, 0, sizeof(float) * H * D);
  for (int64_t t = 0; t < len; ++t) {
    const float *vrow = v_cache + (table[t / bs] * bs + t % bs) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * len + t], *vv = vrow + (h / G) * D;
      float *a = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * vv[d];
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = scores[H * len + h];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
  }
}

/* q, out: [B, H, D]; caches: [num_blocks, bs, KVH, D]; tables: [B, max_blocks]; lens: [B] (each >= 1). Sequences are
 * split over `threads` OpenMP threads (1: the calling thread alone). Returns 0, or -1 if scratch memory ran out. */
int kvscope_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                             const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                             int64_t bs, int64_t max_blocks, float scale, int threads) {
  const int64_t G = H / KVH, row = KVH * D;
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = lens[b] > longest ? lens[b] : longest;
  if (threads < 1) threads = 1;
  const int64_t per_thread = H * longest + H + H * D; /* scores and their sums, then acc */
  float *scratch = malloc(sizeof(float) * per_thread * threads);
  if (scratch == NULL) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    float *scores = scratch + per_thread * omp_get_thread_num();
    one_sequence(q + b * H * D, k_cache, v_cache, tables + b * max_blocks, lens[b], H, G, D, bs, row, scale, scores,
                 scores + H * longest + H, out + b * H * D);
  }
  free(scratch);
  return 0;
}
