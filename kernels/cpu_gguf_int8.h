// int8 activations on GGUF weights (llama.cpp's way for these types: its q8 dot products),
// included in cpu_gguf.cpp's AVX2 section. Each row of x is quantized in blocks of 32:
// dx = max|x| / 127, qx = round(x / dx), and a weight block's dot with it is an integer sum
// of q_w qx, times d_w dx; Q4_0's q - 8 subtracts 8 times the sum of qx, Q4_1's min m adds m
// times the block's fp32 sum of x (not of qx: one rounding fewer). Every type here (the
// K-quants per sub-block: d sc, dmin mn); any number of rows, but on AVX2 Q5_K and Q6_K up
// to kDirectRows (gemm_int8 says why). x is quantized once a call.
//
// The weights stay in the packed layout (8 rows' bytes side by side per weight position):
// one 32-byte load holds 4 positions of 8 rows, rearranged so that each row's weights sit
// side by side, the group's 8 rows in the lanes as the fp32 kernels have them. How, and how
// the integer sums are taken, is the instruction set's (a policy class below):
//   Avx2Int8  pairs of positions a row (row_pairs), u8 x s8 pairs summed in int16
//             (_mm256_maddubs_epi16), widened to int32 as often as int16 holds the type's sums
//   VnniInt8  four positions a row in one 32-bit lane (cpu_gguf_vnni.h): dpbusd sums four
//             products straight into int32
// The kernels are one template over the policy: the same unpacking and the same fp32 steps
// in the same order after exact integer sums, so the two give bit-identical results.
#pragma once

struct XQRow {
  const int8_t* q;       // [nb][32] qx
  const float* d;        // [nb] dx
  const float* sum;      // [nb] the fp32 sum of x over the block
  const int32_t* sumq;   // [nb] the sum of qx over the block
  const int32_t* sumq16; // [nb][2] the sums of qx over its halves (Q6_K's sub-blocks of 16)
};

void quantize_row(const float* x, int64_t nb, int8_t* qx, float* d, float* sum, int32_t* sumq, int32_t* sumq16) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
    int8_t* q = qx + 32 * b;
    float amax = 0.f, s = 0.f;
    for (int k = 0; k < 32; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      s += xb[k];
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sq[2] = {0, 0};
    for (int k = 0; k < 32; ++k) {
      q[k] = static_cast<int8_t>(std::nearbyint(xb[k] * inv));
      sq[k / 16] += q[k];
    }
    d[b] = amax / 127.f;
    sum[b] = s;
    sumq[b] = sq[0] + sq[1];
    sumq16[2 * b] = sq[0];
    sumq16[2 * b + 1] = sq[1];
  }
}

// x's M rows quantized (XQRow), in buffers this object owns.
struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> sumq, sumq16;
  std::vector<XQRow> rows;
  XQuant(const float* x, int64_t ldx, int64_t M, int64_t nb)
      : q(static_cast<size_t>(M * nb * 32)), d(M * nb), sum(M * nb), sumq(M * nb), sumq16(2 * M * nb), rows(M) {
    for (int64_t m = 0; m < M; ++m) {
      quantize_row(x + m * ldx, nb, q.data() + m * nb * 32, d.data() + m * nb, sum.data() + m * nb,
                   sumq.data() + m * nb, sumq16.data() + 2 * m * nb);
      rows[m] = {q.data() + m * nb * 32, d.data() + m * nb, sum.data() + m * nb, sumq.data() + m * nb,
                 sumq16.data() + 2 * m * nb};
    }
  }
};

// x's side of positions 4u .. 4u + 3 of one block (u < 8): lane 0 holds the pair (qx[4u],
// qx[4u + 1]) 8 times, lane 1 (qx[4u + 2], qx[4u + 3]); built from the block's 32 bytes as
// the kernels need them (a pattern a block and u kept for the call would not stay in L1 for
// many rows of x).
struct XPairs {
  __m256i half[2];  // qx[0:16] and qx[16:32], each in both lanes
  PS_INLINE explicit XPairs(const int8_t* q)
      : half{_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
             _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))} {}
  PS_INLINE __m256i operator()(int u) const {
    const int v = u & 3;
    const __m256i ctl = _mm256_setr_epi8(4 * v, 4 * v + 1, 4 * v, 4 * v + 1, 4 * v, 4 * v + 1, 4 * v, 4 * v + 1,
                                         4 * v, 4 * v + 1, 4 * v, 4 * v + 1, 4 * v, 4 * v + 1, 4 * v, 4 * v + 1,
                                         4 * v + 2, 4 * v + 3, 4 * v + 2, 4 * v + 3, 4 * v + 2, 4 * v + 3, 4 * v + 2,
                                         4 * v + 3, 4 * v + 2, 4 * v + 3, 4 * v + 2, 4 * v + 3, 4 * v + 2, 4 * v + 3,
                                         4 * v + 2, 4 * v + 3);
    return _mm256_shuffle_epi8(half[u >> 2], ctl);
  }
};

// Within each 128-bit lane: [(j, r0..r7) (j + 1, r0..r7)] -> [r0: j, j + 1] ... [r7: j, j + 1].
PS_INLINE __m256i row_pairs(const uint8_t* p) {
  const __m256i shuf = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                        0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), shuf);
}

// 16 int16 lanes (two halves of one sum per row) -> 8 int32, the rows in the lanes.
PS_INLINE __m256i widen_rows(__m256i s16) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16, 1)));
}

struct Avx2Int8 {
  static constexpr int kRows = 4;  // rows of x a pass over a group's weights takes (16 ymm registers)
  static PS_INLINE __m256i load(const uint8_t* p) { return row_pairs(p); }
  // The int32 sums per row of loads w[0:N] against positions 4 (v0 + i) .. + 3 of a block's
  // qx; WIDEN loads' products summed in int16 before each widening (what int16 holds of the
  // type's: 2 WIDEN products of at most max|q| x 127).
  template <int N, int WIDEN>
  static PS_INLINE __m256i dot(const __m256i* w, const int8_t* xblock, int v0) {
    const XPairs p(xblock);
    __m256i s32 = _mm256_setzero_si256();
    for (int i = 0; i < N; i += WIDEN) {
      __m256i s16 = _mm256_maddubs_epi16(w[i], p(v0 + i));
      for (int j = 1; j < WIDEN; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[i + j], p(v0 + i + j)));
      s32 = _mm256_add_epi32(s32, widen_rows(s16));
    }
    return s32;
  }
  // Q5_0 / Q5_1 load u's fifth bits, row r's qh byte u in byte r of h8: spread to bytes 2r and
  // 2r + 1 of both lanes, where lane L's byte 2r + e takes bit 2L + e (weight 4u + 2L + e) and
  // bit 4 + 2L + e (its + 16).
  static PS_INLINE void fifth(int64_t h8, __m256i& lo, __m256i& hi) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i spread = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
                                            0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i sel_lo = _mm256_setr_epi8(1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2,
                                            4, 8, 4, 8, 4, 8, 4, 8, 4, 8, 4, 8, 4, 8, 4, 8);
    const __m256i sel_hi = _mm256_slli_epi16(sel_lo, 4);
    const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi64x(h8), spread);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, sel_lo), sel_lo), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, sel_hi), sel_hi), bit4));
  }
  // Q8_0: s8 q against s8 qx, as |q| (u8) times qx with q's sign. A pair's sum (at most
  // 2 x 128 x 127) leaves no room in int16: two positions' pairs are interleaved per row and
  // widened to int32 at once (madd with ones), rows 0-3 in `lo`, 4-7 in `hi`.
  template <int MR>
  static PS_INLINE void q8(const uint8_t* w, int64_t nb, const XQRow* xq, __m256 (&acc)[MR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b, w += 272) {
      prefetch_ahead(w, 272);
      const __m256 dw = f16x8(w);
      __m256i q[8], a[8];
      for (int u = 0; u < 8; ++u) {
        q[u] = row_pairs(w + 16 + 32 * u);
        a[u] = _mm256_abs_epi8(q[u]);
      }
      for (int m = 0; m < MR; ++m) {
        const XPairs p(xq[m].q + 32 * b);
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int u = 0; u < 8; u += 2) {
          const __m256i m0 = _mm256_maddubs_epi16(a[u], _mm256_sign_epi8(p(u), q[u]));
          const __m256i m1 = _mm256_maddubs_epi16(a[u + 1], _mm256_sign_epi8(p(u + 1), q[u + 1]));
          lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(m0, m1), ones));
          hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(m0, m1), ones));
        }
        const __m256i s32 = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                             _mm256_permute2x128_si256(lo, hi, 0x31));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(dw, _mm256_set1_ps(xq[m].d[b])), acc[m]);
      }
    }
  }
};

#if !defined(PS_NO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BW__)
#include "cpu_gguf_vnni.h"
using Int8Isa = VnniInt8;
constexpr const char* kInt8Isa = "avx512vnni";
#else
using Int8Isa = Avx2Int8;
constexpr const char* kInt8Isa = "avx2";
#endif

// Q4_0, Q4_1 (MIN), Q5_0 and Q5_1 (FIFTH, MIN): load u holds positions 4u .. 4u + 3, whose
// low nibbles are weights 4u + e (w[u]) and high nibbles 16 + 4u + e (w[4 + u]): w[v] against
// positions 4v of qx. int16 holds 16 products of at most 15 x 127 (30,480), Q5's 8 of 31 x 127.
template <class I, int MR, bool MIN, bool FIFTH>
PS_INLINE void q45_int8(const uint8_t* w, int64_t nb, const XQRow* xq, __m256 (&acc)[MR]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  constexpr int64_t hoff = MIN ? 32 : 16, qoff = FIFTH ? hoff + 32 : hoff, bytes = qoff + 128;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    prefetch_ahead(w, bytes);
    const __m256 dw = f16x8(w);
    __m256i q[8];
    for (int u = 0; u < 4; ++u) {
      const __m256i t = I::load(w + qoff + 32 * u);
      q[u] = _mm256_and_si256(t, low);
      q[4 + u] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
      if constexpr (FIFTH) {
        int64_t h8;
        std::memcpy(&h8, w + hoff + 8 * u, 8);
        I::fifth(h8, q[u], q[4 + u]);
      }
    }
    const __m256 mw = MIN ? f16x8(w + 16) : _mm256_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      __m256i s32 = I::template dot<8, FIFTH ? 4 : 8>(q, xq[m].q + 32 * b, 0);
      if (!MIN) s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32((FIFTH ? 16 : 8) * xq[m].sumq[b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(dw, _mm256_set1_ps(xq[m].d[b])), acc[m]);
      if (MIN) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xq[m].sum[b]), acc[m]);
    }
  }
}

// Q4_K and Q5_K (HIGH: the fifth bit from qh): per chunk i of 64 weights, sub-blocks 2i (low
// nibbles) and 2i + 1 (high), each 32 weights against x's block 8b + s: an integer sum per row
// (int16 holds Q4_K's 16 products of at most 15 x 127, Q5_K's 8 of 31 x 127), then times
// d sc[s] dx, less dmin mn[s] times the fp32 sum of x.
template <class I, int MR, bool HIGH>
PS_INLINE void q45k_int8(const uint8_t* w, int64_t nb, const XQRow* xq, __m256 (&acc)[MR]) {
  const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  constexpr int64_t bytes = HIGH ? 1440 : 1184;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    prefetch_ahead(w, bytes);
    const __m256 d = f16x8(w), dmin = f16x8(w + 16);
    for (int i = 0; i < 4; ++i) {
      __m256i lo[8], hi[8];
      const uint8_t* q = w + 160 + 32 * i * kGroup;
      for (int v = 0; v < 8; ++v) {
        const __m256i t = I::load(q + 32 * v);
        lo[v] = _mm256_and_si256(t, low);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
        if (HIGH) {  // bits 2i and 2i + 1 of qh[l] are the fifth bits of the two sub-blocks
          const __m256i h = I::load(w + 1184 + 32 * v);
          lo[v] = _mm256_or_si256(lo[v], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * i), one), 4));
          hi[v] = _mm256_or_si256(hi[v], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * i + 1), one), 4));
        }
      }
      const __m256 s_lo = _mm256_mul_ps(d, cvt(u8x8(w + 32 + 16 * i))), s_hi = _mm256_mul_ps(d, cvt(u8x8(w + 40 + 16 * i)));
      const __m256 m_lo = _mm256_mul_ps(dmin, cvt(u8x8(w + 96 + 16 * i))), m_hi = _mm256_mul_ps(dmin, cvt(u8x8(w + 104 + 16 * i)));
      for (int m = 0; m < MR; ++m) {
        const int64_t blk = 8 * b + 2 * i;
        const __m256i sl = I::template dot<8, HIGH ? 4 : 8>(lo, xq[m].q + 32 * blk, 0);
        const __m256i sh = I::template dot<8, HIGH ? 4 : 8>(hi, xq[m].q + 32 * (blk + 1), 0);
        const __m256 dx = _mm256_set1_ps(xq[m].d[blk]), dx1 = _mm256_set1_ps(xq[m].d[blk + 1]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), _mm256_mul_ps(s_lo, dx), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), _mm256_mul_ps(s_hi, dx1), acc[m]);
        acc[m] = _mm256_fnmadd_ps(m_lo, _mm256_set1_ps(xq[m].sum[blk]), acc[m]);
        acc[m] = _mm256_fnmadd_ps(m_hi, _mm256_set1_ps(xq[m].sum[blk + 1]), acc[m]);
      }
    }
  }
}

// Q6_K: per half h of 128 weights, the four 32-weight runs r (weights 128h + 32r + l, l < 32:
// x's block 8b + 4h + r), each two sub-blocks of 16 (scale sc[8h + 2r + l / 16]); q is 6 bits
// (0..63) against qx (int16 holds 4 products of 63 x 127), its - 32 as 32 times the
// sub-block's sum of qx.
template <class I, int MR>
PS_INLINE void q6k_int8(const uint8_t* w, int64_t nb, const XQRow* xq, __m256 (&acc)[MR]) {
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  for (int64_t b = 0; b < nb; ++b, w += 1680) {
    prefetch_ahead(w, 1680);
    const __m256 d = f16x8(w);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = w + 144 + 64 * h * kGroup;
      const uint8_t* qh = w + 1168 + 32 * h * kGroup;
      __m256i q6[4][8];  // [run r][load v: l = 4v .. 4v + 3]
      for (int v = 0; v < 8; ++v) {
        const __m256i a = I::load(ql + 32 * v), c = I::load(ql + 32 * (v + 8)), hb = I::load(qh + 32 * v);
        q6[0][v] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
        q6[1][v] = _mm256_or_si256(_mm256_and_si256(c, low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
        q6[2][v] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
        q6[3][v] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
      }
      for (int r = 0; r < 4; ++r) {
        const __m256 s0 = _mm256_mul_ps(d, cvt(i8x8(w + 16 + 8 * (8 * h + 2 * r)))),
                     s1 = _mm256_mul_ps(d, cvt(i8x8(w + 16 + 8 * (8 * h + 2 * r + 1))));
        for (int m = 0; m < MR; ++m) {
          const int64_t blk = 8 * b + 4 * h + r;
          __m256i sub[2];
          for (int half = 0; half < 2; ++half)  // l in [16 half, 16 half + 16): loads 4 half .. 4 half + 3
            sub[half] = _mm256_sub_epi32(I::template dot<4, 2>(q6[r] + 4 * half, xq[m].q + 32 * blk, 4 * half),
                                         _mm256_set1_epi32(32 * xq[m].sumq16[2 * blk + half]));
          const __m256 dx = _mm256_set1_ps(xq[m].d[blk]);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub[0]), _mm256_mul_ps(s0, dx), acc[m]);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub[1]), _mm256_mul_ps(s1, dx), acc[m]);
        }
      }
    }
  }
}

template <int MR>
void direct_int8(int64_t qtype, const uint8_t* w, int64_t nb, const XQRow* xq, float* y, int64_t ldy,
                 const float* bias, int64_t cols) {
  using I = Int8Isa;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  switch (qtype) {
    case kQ8_0: I::template q8<MR>(w, nb, xq, acc); break;
    case kQ4_0: q45_int8<I, MR, false, false>(w, nb, xq, acc); break;
    case kQ4_1: q45_int8<I, MR, true, false>(w, nb, xq, acc); break;
    case kQ5_0: q45_int8<I, MR, false, true>(w, nb, xq, acc); break;
    case kQ5_1: q45_int8<I, MR, true, true>(w, nb, xq, acc); break;
    case kQ4_K: q45k_int8<I, MR, false>(w, nb, xq, acc); break;
    case kQ5_K: q45k_int8<I, MR, true>(w, nb, xq, acc); break;
    case kQ6_K: q6k_int8<I, MR>(w, nb, xq, acc); break;
  }
  for (int m = 0; m < MR; ++m) store8(acc[m], y + m * ldy, bias, cols);
}

// Groups [g0, g1) against the M quantized rows xq, Int8Isa::kRows rows at a time (a group's
// blocks stay in L1 across its row tiles; each tile decodes them again, which costs less
// than the fp32 strip's FMAs).
void run_groups_int8(int64_t qtype, const uint8_t* w, int64_t nb, int64_t bytes, int64_t g0, int64_t g1, int64_t M,
                     const XQRow* xq, float* y, int64_t ldy, const float* bias, int64_t N) {
  constexpr int64_t rows = Int8Isa::kRows;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * nb * bytes;
    const float* bg = bias ? bias + g * kGroup : nullptr;
    const int64_t cols = std::min<int64_t>(kGroup, N - g * kGroup);
    for (int64_t m = 0; m < M; m += rows) {
      float* yg = y + m * ldy + g * kGroup;
      switch (std::min(rows, M - m)) {
        case 1: direct_int8<1>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
        case 2: direct_int8<2>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
        case 3: direct_int8<3>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
        case 4: direct_int8<4>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
        default:
          if constexpr (rows == 8) {
            switch (M - m) {
              case 5: direct_int8<5>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
              case 6: direct_int8<6>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
              case 7: direct_int8<7>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
              default: direct_int8<8>(qtype, wg, nb, xq + m, yg, ldy, bg, cols); break;
            }
          }
          break;
      }
    }
  }
}
