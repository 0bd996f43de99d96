/* A decoder layer's small ops on the CPU, fused: what PyTorch runs as about 20 calls a layer (each a dispatch, an
 * allocation and a pass over memory that the step's weight streaming has just evicted) in 3 kinds of call, over raw
 * float32 buffers. The Triton backend's fused_ops.py does the same on a card; the arithmetic follows the PyTorch
 * path's (cpu_fused.py says where it rounds differently). Rows are split over `threads` OpenMP threads where a step
 * has enough of them (a prefill); a decode step's few rows run on the calling thread. */
#include <omp.h>
#include <stdint.h>

#include "cpu_math.h"

#define PARALLEL_ROWS 16 /* fewer rows than this stay on one thread: a fork costs more than they take */

/* residual[T][N] (contiguous) += x (row stride sx), or holds the input already (add == 0); then
 * out[T][N] = residual * rsqrt(mean(residual^2) + eps) * w, PyTorch's F.rms_norm in float32. */
void kvscope_add_rms_norm(const float *x, int64_t sx, float *residual, int add, const float *w, float *out, int64_t T,
                          int64_t N, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && T >= PARALLEL_ROWS) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float *r = residual + t * N, *o = out + t * N;
    const float *xr = x + t * sx;
    float ss = 0.0f;
    if (add) {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) {
        const float h = r[i] + xr[i];
        r[i] = h;
        ss += h * h;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += r[i] * r[i];
    }
    const float inv = 1.0f / sqrtf(ss / (float)N + eps);
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) o[i] = (r[i] * inv) * w[i];
  }
}

/* One head of D, rotated NeoX style (transformers' rotate_half) by cos c[D/2] and sin s[D/2], into dst: exactly the
 * PyTorch path's x * cos + roll(x) * signed_sin (a product and a sum, each rounded: no fused multiply-add). */
__attribute__((optimize("fp-contract=off"))) static inline void rotate(const float *x, const float *c,
                                                                          const float *s, float *dst, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
    dst[i] = a - b;
    dst[i + half] = e + f;
  }
}

/* q [T][H][D] rotated in place; k [T][KVH][D] rotated into the cache and v copied beside it, at slots[t]
 * (block * block_size + offset; -1: nothing stored). Strides: (token, head) for each of q, k, v; the caches are
 * [num_blocks * block_size][KVH][D], contiguous. cos_sin [max_pos][D]: cos then sin, D/2 each. */
__attribute__((optimize("fp-contract=off"))) void kvscope_rope_and_store(
    float *q, int64_t sqt, int64_t sqh, const float *k, int64_t skt, int64_t skh, const float *v, int64_t svt,
    int64_t svh, const float *cos_sin, const int64_t *positions, const int64_t *slots, float *k_cache,
    float *v_cache, int64_t T, int64_t H, int64_t KVH, int64_t D, int threads) {
  const int64_t half = D / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && T >= PARALLEL_ROWS) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos_sin + positions[t] * D, *s = c + half;
    for (int64_t h = 0; h < H; ++h) {
      float *qh = q + t * sqt + h * sqh;
      rotate(qh, c, s, qh, half); /* in place: each pair is read before it is written */
    }
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    float *kd = k_cache + slot * KVH * D, *vd = v_cache + slot * KVH * D;
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(k + t * skt + h * skh, c, s, kd + h * D, half);
      const float *vh = v + t * svt + h * svh;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) vd[h * D + i] = vh[i];
    }
  }
}

/* out[T][I] = silu(gate) * up, gate_up [T][2I] (row stride sx): gate in the first I columns, up in the last. The
 * sigmoid from exp(-|g|) <= 1, so that one polynomial serves both signs and the loop vectorises. */
void kvscope_silu_and_mul(const float *gate_up, int64_t sx, float *out, int64_t T, int64_t I, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && T >= PARALLEL_ROWS) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float *g = gate_up + t * sx, *u = g + I;
    float *o = out + t * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float x = g[i];
      const float e = exp_nonpositive(-fabsf(x)), inv = 1.0f / (1.0f + e);
      const float sigmoid = x < 0.0f ? e * inv : inv;
      o[i] = (x * sigmoid) * u[i];
    }
  }
}
