// The int8 kernels' AVX-512 VNNI policy (cpu_gguf_int8.h), for CPUs with VNNI, VL, VBMI and
// BW (Intel Ice Lake and later server parts, AMD Zen 4 and later), chosen at build time
// (-march=native; cpu_build.py builds per CPU kind).
//
// The AVX2 policy multiplies u8 weights by s8 activations two at a time (maddubs: pairs summed
// in int16), then widens to int32. VNNI's dpbusd sums four u8 x s8 products straight into an
// int32 lane: one instruction where AVX2 takes two or three, and no int16 to overflow. It
// wants a row's four consecutive weights in one 32-bit lane; the packed layout has four
// positions of 8 rows in one 32-byte load, so one byte permutation (vpermb) makes lane r hold
// row r's four weights. x's side is its four qx broadcast to every lane. With 32 vector
// registers a pass over a group's weights takes 8 rows of x.
#pragma once

// [(j, r0..r7) (j + 1, ..) (j + 2, ..) (j + 3, ..)] -> lane r: [(j, r) (j + 1, r) (j + 2, r) (j + 3, r)].
PS_INLINE __m256i row_quads(const uint8_t* p) {
  const __m256i idx = _mm256_setr_epi8(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                                       4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
  return _mm256_permutexvar_epi8(idx, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// qx[0:4] in every 32-bit lane.
PS_INLINE __m256i x_quad(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

struct VnniInt8 {
  static constexpr int kRows = 8;
  static PS_INLINE __m256i load(const uint8_t* p) { return row_quads(p); }
  // Two chains of dpbusd (its latency is several cycles), added at the end; WIDEN: not needed.
  template <int N, int WIDEN>
  static PS_INLINE __m256i dot(const __m256i* w, const int8_t* xblock, int v0) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < N; ++i) s[i & 1] = _mm256_dpbusd_epi32(s[i & 1], w[i], x_quad(xblock + 4 * (v0 + i)));
    return _mm256_add_epi32(s[0], s[1]);
  }
  // Q5 load u's fifth bits: row r's qh byte u (byte r of h8) in lane r's four bytes; byte e
  // takes bit e (weight 4u + e) and bit 4 + e (its + 16).
  static PS_INLINE void fifth(int64_t h8, __m256i& lo, __m256i& hi) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                            4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    const __m256i h = _mm256_permutexvar_epi8(spread, _mm256_set1_epi64x(h8));
    lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(h, _mm256_set1_epi32(0x08040201)), lo, bit4);
    hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(h, _mm256_set1_epi32(static_cast<int>(0x80402010u))), hi,
                              bit4);
  }
  // Q8_0: s8 q as the u8 q + 128 (its sign bit flipped), then 128 times the block's sum of qx off.
  template <int MR>
  static PS_INLINE void q8(const uint8_t* w, int64_t nb, const XQRow* xq, __m256 (&acc)[MR]) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b, w += 272) {
      prefetch_ahead(w, 272);
      const __m256 dw = f16x8(w);
      __m256i q[8];
      for (int u = 0; u < 8; ++u) q[u] = _mm256_xor_si256(row_quads(w + 16 + 32 * u), flip);
      for (int m = 0; m < MR; ++m) {
        const __m256i s32 = _mm256_sub_epi32(dot<8, 8>(q, xq[m].q + 32 * b, 0),
                                             _mm256_set1_epi32(128 * xq[m].sumq[b]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(dw, _mm256_set1_ps(xq[m].d[b])), acc[m]);
      }
    }
  }
};
