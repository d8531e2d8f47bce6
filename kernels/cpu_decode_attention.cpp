// The CPU extension of kernels/cpu_decode_attention.py: decode attention over the paged KV
// cache, fp32 or quantised, and the write of a step's K/V rows (that module's docstring has the
// loop and its vector paths). Compiled at run time by kernels/cpu_build.py, with this folder's
// headers (#include "...") inlined.
#include "cpu_prelude.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Blocks ahead to prefetch: block ids are random, so the hardware cannot guess the next one.
#define PF 2
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PS_AVX2_BLOCK 1
#endif

// The vector exps' constants: the clamp, log2(e), ln2 split in two (Cody-Waite), and the
// degree-7 Taylor coefficients of e^r, highest first.
constexpr float kExpMin = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

// Formats: 0 fp32; 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8 (dequant_block: cpu_kv_dequant.h).
#include "cpu_kv_dequant.h"

#if defined(__AVX512F__)
// exp(x) for x <= 0 in 16 lanes: x = n ln2 + r (Cody-Waite), e^r by its degree-7 Taylor
// polynomial (|r| <= ln2 / 2: relative error ~1e-7, 1 ulp), times 2^n by scalef. Lanes
// below -87.3 come out ~1e-38, not 0: callers mask lanes that must be exactly 0.
static inline __m512 exp_neg512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}

// One block of n <= 16 tokens (n <= BS <= 16) for the G query heads of one KV head: every
// K and V row is loaded once and serves all G heads. qs [G, D] (pre-scaled), acc [G, D],
// m / l [G]; kb / vb rows `row` floats apart. D % 16 == 0, D <= 256.
static inline void block_avx512(const float* qs, const float* kb, const float* vb, int64_t row, int64_t n,
                                int64_t G, int64_t D, float* acc, float* m, float* l) {
  alignas(64) float dots[16 * 16];  // [G <= 16][16 tokens]
  const int64_t C = D / 16;
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = kb + t * row;
    __m512 k[16];
    for (int64_t c = 0; c < C; ++c) k[c] = _mm512_loadu_ps(kt + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], a);
      dots[g * 16 + t] = _mm512_reduce_add_ps(a);
    }
  }
  const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float probs[16 * 16];
  float corr[16];
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_mask_loadu_ps(ninf, live, dots + g * 16);
    const float mb = std::max(m[g], _mm512_reduce_max_ps(s));
    const __m512 p = _mm512_maskz_mov_ps(live, exp_neg512(_mm512_sub_ps(s, _mm512_set1_ps(mb))));
    _mm512_store_ps(probs + g * 16, p);
    corr[g] = std::exp(m[g] - mb);  // 0 on the first block (m = -inf)
    l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(p);
    m[g] = mb;
    float* ag = acc + g * D;
    const __m512 cg = _mm512_set1_ps(corr[g]);
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(ag + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), cg));
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = vb + t * row;
    __m512 v[16];
    for (int64_t c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vt + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(probs[g * 16 + t]);
      float* ag = acc + g * D;
      for (int64_t c = 0; c < C; ++c)
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pg, v[c], _mm512_loadu_ps(ag + 16 * c)));
    }
  }
}

// [a_0 .. a_15] (16 vectors) -> one vector whose lane t is the sum of a_t's 16 lanes: a
// transpose-and-add tree of 45 shuffles and adds, where 16 _mm512_reduce_add_ps take ~130.
static inline __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)  // 128-bit chunk j of s_i: a_2i and a_2i+1's chunk-j lanes, half summed
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // chunk j of u_i: the chunk-j sums of a_4i .. a_4i+3, in order
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));  // chunk i: a_4i .. a_4i+3
}

// block_avx512 for D = 16 C with each query head's q and accumulator in registers: per head,
// 16 scores from one reduce16, then P.V over the block's V rows (in L1 after the first head).
// block_avx512 above is compute bound where this one is not (loadtest/kernel_checks/cpu_attention.py).
template <int C>
static inline void block_avx512_regs(const float* qs, const float* kb, const float* vb, int64_t row, int64_t n,
                                     int64_t G, float* acc, float* m, float* l) {
  constexpr int64_t D = 16 * C;
  const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qs + g * D + 16 * c);
    __m512 a[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t < n) {
        const float* kt = kb + t * row;
        __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
        for (int c = 1; c < C; ++c) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), x);
        a[t] = x;
      } else {
        a[t] = _mm512_setzero_ps();
      }
    }
    const __m512 sc = _mm512_mask_mov_ps(ninf, live, reduce16(a));
    const float mb = std::max(m[g], _mm512_reduce_max_ps(sc));
    const __m512 p = _mm512_maskz_mov_ps(live, exp_neg512(_mm512_sub_ps(sc, _mm512_set1_ps(mb))));
    const float corr = std::exp(m[g] - mb);  // 0 on the first block (m = -inf)
    l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
    m[g] = mb;
    alignas(64) float probs[16];
    _mm512_store_ps(probs, p);
    float* ag = acc + g * D;
    __m512 av[C];
    const __m512 cg = _mm512_set1_ps(corr);
    for (int c = 0; c < C; ++c) av[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), cg);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = vb + t * row;
      const __m512 pt = _mm512_set1_ps(probs[t]);
      for (int c = 0; c < C; ++c) av[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 16 * c), av[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(ag + 16 * c, av[c]);
  }
}
#endif

#if defined(PS_AVX2_BLOCK)
// exp_neg512 in 8 lanes (AVX2 has no scalef: 2^n is built in the exponent field; n >= -126
// after the clamp, so it is a normal float).
static inline __m256 exp_neg256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// All lanes set below `n` (clamped to 0..8).
static inline __m256 live_lanes(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int c = (int)std::max<int64_t>(0, std::min<int64_t>(8, n));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), idx));
}

// r[0..7] (8 rows of 8) into its transpose, in place.
static inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  constexpr int kLo = _MM_SHUFFLE(1, 0, 1, 0), kHi = _MM_SHUFFLE(3, 2, 3, 2);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, kLo), s1 = _mm256_shuffle_ps(t0, t2, kHi);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, kLo), s3 = _mm256_shuffle_ps(t1, t3, kHi);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, kLo), s5 = _mm256_shuffle_ps(t4, t6, kHi);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, kLo), s7 = _mm256_shuffle_ps(t5, t7, kHi);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// The scores of HN query heads against the block's 16 token slots: s[h][t] = q[h] . k[t],
// summed over d in order (one FMA per d: a head's scores do not depend on which heads share
// its pass). kt [D][16]: the block's K transposed; 2 HN accumulators (HN <= 6).
template <int HN>
static inline void scores_avx2(const float* __restrict q, const float* __restrict kt, int64_t D,
                               float* __restrict s) {
  __m256 a[2 * HN];
#pragma GCC unroll 12
  for (int i = 0; i < 2 * HN; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * 16), k1 = _mm256_load_ps(kt + d * 16 + 8);
#pragma GCC unroll 6
    for (int h = 0; h < HN; ++h) {
      const __m256 b = _mm256_broadcast_ss(q + h * D + d);
      a[2 * h] = _mm256_fmadd_ps(b, k0, a[2 * h]);
      a[2 * h + 1] = _mm256_fmadd_ps(b, k1, a[2 * h + 1]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < 2 * HN; ++i) _mm256_storeu_ps(s + 8 * i, a[i]);
}

// acc[0:8 NV] = acc * corr + sum over t < n of p[t] v[t][0:8 NV], in registers (one FMA per
// t and lane, t in order).
template <int NV>
static inline void pv_avx2(float* __restrict acc, float corr, const float* __restrict p,
                           const float* __restrict vb, int64_t row, int64_t n) {
  __m256 a[NV];
  const __m256 c = _mm256_set1_ps(corr);
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), c);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const float* vt = vb + t * row;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), a[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// One block of n <= 16 tokens for R rows (query positions of one sequence, or one decode row)
// of G query heads each, all of one KV head, with AVX2 + FMA (AMD Zen 2, Intel before
// Skylake-SP): K is transposed once into kt, so the scores of all R G heads are broadcast
// FMAs against whole rows of 8 tokens, with no horizontal sums; each head's softmax runs on
// its row's first nr[r] tokens (nr[r] <= 0: the row has ended, it skips the block); P.V keeps
// the head's accumulator in registers. qs [R G, D] (pre-scaled), acc [R G, D], m / l [R G];
// kb / vb rows `row` floats apart; kt [D, 16] (32-byte aligned) and sc [R G, 16] scratch.
// D % 8 == 0. A head's arithmetic is the same whatever R, G and the other rows' lengths.
static inline void block_avx2(const float* qs, const float* kb, const float* vb, int64_t row, int64_t n,
                              int64_t R, const int64_t* nr, int64_t G, int64_t D, float* acc, float* m,
                              float* l, float* kt, float* sc) {
  const int64_t H = R * G;
  for (int64_t tg = 0; tg < 2; ++tg)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r8[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t t = 8 * tg + i;
        r8[i] = t < n ? _mm256_loadu_ps(kb + t * row + d0) : _mm256_setzero_ps();
      }
      transpose8(r8);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(kt + (d0 + i) * 16 + 8 * tg, r8[i]);
    }
  int64_t h0 = 0;
  for (; h0 + 6 <= H; h0 += 6) scores_avx2<6>(qs + h0 * D, kt, D, sc + h0 * 16);
  switch (H - h0) {
    case 5: scores_avx2<5>(qs + h0 * D, kt, D, sc + h0 * 16); break;
    case 4: scores_avx2<4>(qs + h0 * D, kt, D, sc + h0 * 16); break;
    case 3: scores_avx2<3>(qs + h0 * D, kt, D, sc + h0 * 16); break;
    case 2: scores_avx2<2>(qs + h0 * D, kt, D, sc + h0 * 16); break;
    case 1: scores_avx2<1>(qs + h0 * D, kt, D, sc + h0 * 16); break;
  }
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(32) float probs[16];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nv = nr[r];
    if (nv <= 0) continue;
    const __m256 live0 = live_lanes(nv), live1 = live_lanes(nv - 8);
    for (int64_t h = r * G; h < (r + 1) * G; ++h) {
      const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sc + h * 16), live0);
      const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sc + h * 16 + 8), live1);
      const float mb = std::max(m[h], hmax256(_mm256_max_ps(s0, s1)));
      const __m256 mv = _mm256_set1_ps(mb);
      const __m256 p0 = _mm256_and_ps(exp_neg256(_mm256_sub_ps(s0, mv)), live0);
      const __m256 p1 = _mm256_and_ps(exp_neg256(_mm256_sub_ps(s1, mv)), live1);
      _mm256_store_ps(probs, p0);
      _mm256_store_ps(probs + 8, p1);
      const float corr = std::exp(m[h] - mb);  // 0 on the first block (m = -inf)
      l[h] = l[h] * corr + hsum256(_mm256_add_ps(p0, p1));
      m[h] = mb;
      float* ah = acc + h * D;
      int64_t c = 0;
      for (; c + 64 <= D; c += 64) pv_avx2<8>(ah + c, corr, probs, vb + c, row, nv);
      switch ((D - c) / 8) {
        case 7: pv_avx2<7>(ah + c, corr, probs, vb + c, row, nv); break;
        case 6: pv_avx2<6>(ah + c, corr, probs, vb + c, row, nv); break;
        case 5: pv_avx2<5>(ah + c, corr, probs, vb + c, row, nv); break;
        case 4: pv_avx2<4>(ah + c, corr, probs, vb + c, row, nv); break;
        case 3: pv_avx2<3>(ah + c, corr, probs, vb + c, row, nv); break;
        case 2: pv_avx2<2>(ah + c, corr, probs, vb + c, row, nv); break;
        case 1: pv_avx2<1>(ah + c, corr, probs, vb + c, row, nv); break;
      }
    }
  }
}
#endif

// The portable block (any D, G, BS): the same online softmax, one K row per (head, token)
// and a scalar exp per score (slower than the vector blocks; loadtest/kernel_checks/cpu_attention.py).
// softcap > 0 (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap) first.
static inline void block_scalar(const float* qs, const float* kb, const float* vb, int64_t row, int64_t n,
                                int64_t G, int64_t D, int64_t BS, float* acc, float* m, float* l, float* s,
                                float softcap) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qs + g * D;
    float* sg = s + g * BS;
    float mb = m[g];
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = kb + t * row;
      float dot = 0.f;
#pragma omp simd reduction(+:dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
      if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
      sg[t] = dot;
      mb = std::max(mb, dot);
    }
    const float corr = std::exp(m[g] - mb);
    float sum = l[g] * corr;
    float* ag = acc + g * D;
    for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
    for (int64_t t = 0; t < n; ++t) {
      const float p = std::exp(sg[t] - mb);
      sum += p;
      const float* vt = vb + t * row;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
    }
    m[g] = mb;
    l[g] = sum;
  }
}

// q [S, H, D] fp32 (one decode row per sequence), caches [NB, BS, KVH, D] (fp32, or
// 1-byte codes with scale codes [NB, BS, KVH] uint8), block_table [S, MAXB] int32,
// seq_lens [S] int32, out [S, H, D] fp32. groups [NG + 1] int32 (or empty: one row each):
// rows groups[i] .. groups[i+1]-1 read one sequence, the block table of the first of them.
// window > 0 (a sliding-window layer): a row of length L reads only keys [L - window, L), and
// no block before the first of them (a hybrid KV cache may have freed those); softcap > 0:
// the scores are soft-capped (the portable block only).
template <int FMT>
static void decode_attention_impl(torch::Tensor q, const void* k_data, const void* v_data,
                                  const uint8_t* k_scales, const uint8_t* v_scales, float inv_qmax, int64_t BS,
                                  int64_t KVH,
                                  torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                  torch::Tensor out, torch::Tensor groups, int64_t window, double softcap_d) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NG = groups.numel() ? groups.numel() - 1 : S;
  const int32_t* gp = groups.numel() ? groups.data_ptr<int32_t>() : nullptr;
  const int64_t G = H / KVH, MAXB = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const float fscale = static_cast<float>(scale);
  const float softcap = static_cast<float>(softcap_d);
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0 && D <= 256 && BS <= 16 && G <= 16 && softcap <= 0.f;
#elif defined(PS_AVX2_BLOCK)
  const bool vec = D % 8 == 0 && D <= 256 && BS <= 16 && G <= 16 && softcap <= 0.f;
#endif  // else only the portable block runs
  // Too few (group, kv head) items to keep every thread busy, and groups of several rows:
  // split each group's rows into P parts, one item each (each part reads the group's blocks;
  // the second read comes from cache). A row's arithmetic is the same in any part.
  int64_t max_rows = 1;
  for (int64_t i = 0; gp && i < NG; ++i) max_rows = std::max<int64_t>(max_rows, gp[i + 1] - gp[i]);
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t P = NG * KVH >= want ? 1 : std::min<int64_t>(max_rows, (want + NG * KVH - 1) / (NG * KVH));
  at::parallel_for(0, NG * KVH * P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, m, l, s(G * BS), qs;
    std::vector<float> kbuf(FMT ? BS * D : 0), vbuf(FMT ? BS * D : 0);
#if defined(PS_AVX2_BLOCK)
    std::vector<int64_t> nrow;
    std::vector<float> sc;                       // [R G, 16] scores
    alignas(32) float kt[256 * 16];              // the block's K transposed, [D, 16]
#endif
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t grp = idx / (KVH * P), kh = idx / P % KVH, part = idx % P;
      const int64_t first_row = gp ? gp[grp] : grp, group_rows = gp ? gp[grp + 1] - first_row : 1;
      const int64_t r0 = part * group_rows / P, r1 = (part + 1) * group_rows / P;
      if (r0 == r1) continue;
      const int64_t tbl = first_row;  // the group's block table: its first row's
      const int64_t seq = first_row + r0, R = r1 - r0;
      acc.assign(R * G * D, 0.f);
      m.assign(R * G, -std::numeric_limits<float>::infinity());
      l.assign(R * G, 0.f);
      qs.resize(R * G * D);
#if defined(PS_AVX2_BLOCK)
      nrow.resize(R);
      sc.resize(R * G * 16);
#endif
      int64_t len = 0, lo = std::numeric_limits<int64_t>::max();  // lo: the earliest key any row reads
      for (int64_t r = 0; r < R; ++r) {
        len = std::max<int64_t>(len, lens[seq + r]);
        lo = std::min<int64_t>(lo, window > 0 ? std::max<int64_t>(0, lens[seq + r] - window) : 0);
        for (int64_t g = 0; g < G; ++g) {
          const float* src = qp + (seq + r) * q_stride + (kh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qs[(r * G + g) * D + d] = src[d] * fscale;
        }
      }
      const int64_t nblocks = (len + BS - 1) / BS;
      for (int64_t b = lo / BS; b < nblocks && b < MAXB; ++b) {
        const int64_t blk = bt[tbl * MAXB + b];
        const int64_t n = std::min<int64_t>(BS, len - b * BS);  // the longest row's tokens here
        const int64_t first = (blk * BS * KVH + kh) * D;
        if (b + PF < nblocks && b + PF < MAXB) {
          constexpr int64_t esz = FMT == 0 ? 4 : 1;
          const int64_t ahead = (bt[tbl * MAXB + b + PF] * BS * KVH + kh) * D * esz;
          const char* kn = static_cast<const char*>(k_data) + ahead;
          const char* vn = static_cast<const char*>(v_data) + ahead;
          for (int64_t t = 0; t < BS; ++t)
            for (int64_t c = 0; c < D * esz; c += 64) {
              __builtin_prefetch(kn + t * KVH * D * esz + c);
              __builtin_prefetch(vn + t * KVH * D * esz + c);
            }
        }
        const float* kb;
        const float* vb;
        int64_t row;
        if constexpr (FMT == 0) {
          kb = static_cast<const float*>(k_data) + first;
          vb = static_cast<const float*>(v_data) + first;
          row = KVH * D;
        } else {
          dequant_block<FMT>(static_cast<const uint8_t*>(k_data) + first, k_scales + first / D, inv_qmax, n,
                             KVH * D, D, kbuf.data());
          dequant_block<FMT>(static_cast<const uint8_t*>(v_data) + first, v_scales + first / D, inv_qmax, n,
                             KVH * D, D, vbuf.data());
          kb = kbuf.data();
          vb = vbuf.data();
          row = D;
        }
        const float* kb_blk = kb;
        const float* vb_blk = vb;
#if defined(PS_AVX2_BLOCK)
        if (vec) {  // all rows in one pass over the block
          bool straddle = false;  // a row whose window starts inside this block
          for (int64_t r = 0; r < R; ++r) {
            nrow[r] = std::min<int64_t>(n, lens[seq + r] - b * BS);
            if (window > 0 && lens[seq + r] - window > b * BS) {
              straddle = straddle || lens[seq + r] - window < b * BS + nrow[r];
              nrow[r] = 0;  // not in the shared pass: from its window's start, below
            }
          }
          block_avx2(qs.data(), kb, vb, row, n, R, nrow.data(), G, D, acc.data(), m.data(), l.data(), kt,
                     sc.data());
          for (int64_t r = 0; straddle && r < R; ++r) {
            const int64_t t0 = lens[seq + r] - window - b * BS;
            int64_t cnt = std::min<int64_t>(n, lens[seq + r] - b * BS) - t0;
            if (t0 <= 0 || cnt <= 0) continue;
            block_avx2(qs.data() + r * G * D, kb + t0 * row, vb + t0 * row, row, cnt, 1, &cnt, G, D,
                       acc.data() + r * G * D, m.data() + r * G, l.data() + r * G, kt, sc.data());
          }
          continue;
        }
#endif
        for (int64_t r = 0; r < R; ++r) {  // each row up to its own length; the block stays in cache
          // t0: the first token of the block in the row's window (0 without one)
          const int64_t t0 = window > 0 ? std::max<int64_t>(0, lens[seq + r] - window - b * BS) : 0;
          const int64_t nr = std::min<int64_t>(n, lens[seq + r] - b * BS) - t0;
          if (nr <= 0) continue;
          const float* kb = kb_blk + t0 * row;
          const float* vb = vb_blk + t0 * row;
          const float* qr = qs.data() + r * G * D;
          float* ar = acc.data() + r * G * D;
          float* mr = m.data() + r * G;
          float* lr = l.data() + r * G;
#if defined(__AVX512F__)
          if (vec) {
            if (D == 64) block_avx512_regs<4>(qr, kb, vb, row, nr, G, ar, mr, lr);
            else if (D == 128) block_avx512_regs<8>(qr, kb, vb, row, nr, G, ar, mr, lr);
            else if (D == 32) block_avx512_regs<2>(qr, kb, vb, row, nr, G, ar, mr, lr);
            else block_avx512(qr, kb, vb, row, nr, G, D, ar, mr, lr);
            continue;
          }
#endif
          block_scalar(qr, kb, vb, row, nr, G, D, BS, ar, mr, lr, s.data(), softcap);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) {
          float* dst = op + (seq + r) * o_stride + (kh * G + g) * D;
          const float inv = l[r * G + g] > 0.f ? 1.f / l[r * G + g] : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[d] = acc[(r * G + g) * D + d] * inv;
        }
    }
  });
}

void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                      torch::Tensor out, torch::Tensor groups, int64_t window, double softcap) {
  decode_attention_impl<0>(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), nullptr, nullptr, 0.0f,
                           k_cache.size(1), k_cache.size(2), block_table, seq_lens, scale, out, groups, window,
                           softcap);
}

void decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale, torch::Tensor out, int64_t fmt, double inv_qmax,
                            torch::Tensor groups, int64_t window, double softcap) {
  const void* k = k_cache.data_ptr<uint8_t>();
  const void* v = v_cache.data_ptr<uint8_t>();
  const uint8_t* ks = k_scale.data_ptr<uint8_t>();
  const uint8_t* vs = v_scale.data_ptr<uint8_t>();
  const float iq = static_cast<float>(inv_qmax);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  if (fmt == 1) decode_attention_impl<1>(q, k, v, ks, vs, iq, BS, KVH, block_table, seq_lens, scale, out, groups,
                                                  window, softcap);
  else if (fmt == 2) decode_attention_impl<2>(q, k, v, ks, vs, iq, BS, KVH, block_table, seq_lens, scale, out, groups,
                                                  window, softcap);
  else if (fmt == 3) decode_attention_impl<3>(q, k, v, ks, vs, iq, BS, KVH, block_table, seq_lens, scale, out, groups,
                                                  window, softcap);
  else TORCH_CHECK(false, "unknown quantised KV format ", fmt);
}

// This step's K and V rows into their slots: key / value [M, KVH, D] fp32 (rows any stride,
// heads D apart), caches [NB, BS, KVH, D] fp32, slots [M] int64 (< 0: skip). One call in
// place of torch's mask, check and two index_copy_ (each a dispatch, cold between GEMMs).
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  const int64_t M = key.size(0), row = key.size(1) * key.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    const int64_t slot = sp[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " past the cache's ", num_slots);
    std::memcpy(kc + slot * row, kp + i * key.stride(0), row * sizeof(float));
    std::memcpy(vc + slot * row, vp + i * value.stride(0), row * sizeof(float));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_quant", &decode_attention_quant, py::call_guard<py::gil_scoped_release>());
}
