// One quantised KV block into fp32 for the CPU decode loop (cpu_decode_attention.cpp
// includes it; kernels/cpu_build.py's read_source inlines it into that extension's source).
//
// Formats (kernels/kv_quant.py): 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8 values, with a scale byte per
// (token, KV head): the row's absmax as a UE5M3 code c, fp32 bits `(c + 896) << 20` (255 is
// NaN), and scale = absmax / QMAX. A block is dequantised once per (block, KV head) into a
// [BS, D] fp32 buffer with its scales folded in, which all the group's query heads then read
// from L1, so the attention loops stay the fp32 ones.
//
// fp8 -> fp32 in integer ops the d loop vectorises: the code's exponent and mantissa bits placed
// at fp32's positions give the value times 2^-(127 - BIAS) (subnormals land on fp32 denormals,
// exactly: were they flushed (DAZ), only codes below 2^-6 of a row's step would read 0); that
// power-of-two rebias and the row's scale are one factor, so a value costs one multiply.
//
// The scale code's bias and NaN code are kv_quant.py's AMAX_CODE_BIAS and SCALE_NAN, passed by
// the build as -DPS_AMAX_CODE_BIAS=... -DPS_SCALE_NAN=... (kernels/cpu_decode_attention.py).
#ifndef PAGEDSERVE_CPU_KV_DEQUANT_H
#define PAGEDSERVE_CPU_KV_DEQUANT_H

#include <cstdint>

#if !defined(PS_AMAX_CODE_BIAS) || !defined(PS_SCALE_NAN)
#error "build with -DPS_AMAX_CODE_BIAS and -DPS_SCALE_NAN (kernels/kv_quant.py's; cpu_decode_attention.py passes them)"
#endif
constexpr uint32_t kAmaxCodeBias = PS_AMAX_CODE_BIAS;
constexpr uint8_t kScaleNan = PS_SCALE_NAN;

static inline float row_scale(uint8_t c, float inv_qmax) {
  if (c == kScaleNan) return __builtin_nanf("");
  return __builtin_bit_cast(float, (static_cast<uint32_t>(c) + kAmaxCodeBias) << 20) * inv_qmax;
}

template <int FMT>
static inline float fp8_bits(uint8_t byte) {
  constexpr uint32_t MB = FMT == 1 ? 3 : 2;
  const uint32_t b = byte;
  return __builtin_bit_cast(float, ((b & 0x80u) << 24) | ((b & 0x7Fu) << (23 - MB)));
}

template <int FMT>
static inline void dequant_block(const uint8_t* src, const uint8_t* scales, float inv_qmax, int64_t n,
                                 int64_t row_stride, int64_t D, float* dst) {
  const int64_t per_t = row_stride / D;  // scale index step from one token to the next
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* row = src + t * row_stride;
    float* d_row = dst + t * D;
    const float s = row_scale(scales[t * per_t], inv_qmax);
    if constexpr (FMT == 3) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) d_row[d] = static_cast<float>(static_cast<int8_t>(row[d])) * s;
    } else {
      constexpr float REBIAS = FMT == 1 ? 0x1p120f : 0x1p112f;
      const float f = s * REBIAS;
      if (__builtin_isfinite(f) || s != s) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) d_row[d] = fp8_bits<FMT>(row[d]) * f;
      } else {  // e4m3, absmax code 254: 2^120 x scale overflows, so rebias first
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) d_row[d] = fp8_bits<FMT>(row[d]) * REBIAS * s;
      }
    }
  }
}

#endif  // PAGEDSERVE_CPU_KV_DEQUANT_H
