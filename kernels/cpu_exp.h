// exp_clamped: a vectorizable expf for the SwiGLU loops of cpu_fused.cpp and cpu_moe.cpp.
#ifndef PAGEDSERVE_CPU_EXP_H
#define PAGEDSERVE_CPU_EXP_H

#include <cmath>
#include <cstdint>

// exp(x), branch-free so that the silu loop vectorizes (std::exp is one scalar libm call per
// element; -fno-trapping-math lets GCC turn the clamps into vector min / max): Cephes' expf, x = n ln 2 + r with ln 2 in two parts, exp(r) = 1 + r + r^2 P(r) with
// P of degree 5, then 2^n put in the exponent field; within a few ulp of expf. x is clamped
// to where 2^n is a normal float (exp(-87.3) ~ 1e-38, exp(88) ~ 2e38), which moves silu's
// result by far less than its rounding; NaN passes through the clamps.
static inline float exp_clamped(float x) {
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  float r = fmaf(n, -0.693359375f, x);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#endif  // PAGEDSERVE_CPU_EXP_H
