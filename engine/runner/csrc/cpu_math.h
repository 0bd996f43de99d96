/* Arithmetic the CPU kernels share, written so that a loop of it vectorises (no libm call inside a loop). */
#ifndef KVSCOPE_CPU_MATH_H
#define KVSCOPE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a score minus its row's maximum): Cephes' expf (a range reduction by ln 2 and a degree-6
 * polynomial, within 2 ulp of expf over this range), in plain float arithmetic so that a loop of it vectorises. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#endif
