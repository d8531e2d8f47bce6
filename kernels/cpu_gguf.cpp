// The CPU extension of kernels/cpu_gguf.py: y = x W^T + b with W kept in GGUF's quantized
// blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), repacked once at load so that 8 output rows
// (a group) share each block position (that module's docstring has the layout). The weights
// are dequantized in registers and multiplied with fp32 activations. Compiled at run time by
// kernels/cpu_build.py, with this folder's headers (#include "...") inlined.
#include "cpu_prelude.h"
#include "cpu_borrowed_cores.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 8;  // output rows interleaved in a packed block (one 256-bit vector of fp32)
constexpr int64_t kDirectRows = 4;  // rows of x up to which the weights are dequantized in registers

// ggml's type ids (ggml.h, GGMLQuantizationType in the gguf package).
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Format {
  int64_t block;  // weights of one row a block holds (along K)
  int64_t raw;    // bytes of one row's block in the file
  int64_t packed; // bytes of one group's block after packing (kGroup rows)
};

// Packed block layouts, kGroup = 8 rows r, byte offsets (f16: IEEE half, the file's scales):
//   Q8_0  [0,16) d[r] f16   [16,272) q[k][r] int8, k < 32
//   Q4_0  [0,16) d[r]       [16,144) q[j][r] u8, j < 16: low nibble weight j, high nibble j + 16
//   Q4_1  [0,16) d[r]       [16,32) m[r] f16          [32,160) q[j][r] as Q4_0
//   Q5_0  [0,16) d[r]       [16,48) qh[v][r] u8, v < 4: bit p the fifth bit of weight 4 v + p, bit
//         4 + p that of weight 4 v + p + 16 (p < 4)     [48,176) q[j][r] as Q4_0
//   Q5_1  [0,16) d[r]       [16,32) m[r]      [32,64) qh[v][r] as Q5_0       [64,192) q[j][r] as Q4_0
//   Q4_K  [0,16) d[r]       [16,32) dmin[r]   [32,96) sc[s][r] u8   [96,160) mn[s][r] u8 (s < 8: the
//         6-bit scales and mins unpacked)    [160,1184) q[i][l][r], i < 4, l < 32: low nibble weight
//         64 i + l (sub-block 2 i), high nibble 64 i + 32 + l (sub-block 2 i + 1)
//   Q5_K  as Q4_K, then [1184,1440) qh[l][r]: bit s is the fifth bit of weight 32 s + l
//   Q6_K  [0,16) d[r]       [16,144) sc[s][r] int8, s < 16     [144,1168) ql[h][l][r], h < 2, l < 64
//         [1168,1680) qh[h][l][r], l < 32 (ggml's bit layout, per half of 128 weights)
// Every row's bytes of one block are the file's bytes of that block, moved, never re-rounded.
Format format_of(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return {32, 34, 272};
    case kQ4_0: return {32, 18, 144};
    case kQ4_1: return {32, 20, 160};
    case kQ5_0: return {32, 22, 176};
    case kQ5_1: return {32, 24, 192};
    case kQ4_K: return {256, 144, 1184};
    case kQ5_K: return {256, 176, 1440};
    case kQ6_K: return {256, 210, 1680};
  }
  TORCH_CHECK(false, "pagedserve's GGUF kernel does not know ggml type ", qtype);
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row's file block `src` into row r of the packed group block `dst`.
void pack_block(int64_t qtype, const uint8_t* src, int64_t r, uint8_t* dst) {
  const int64_t G = kGroup;
  switch (qtype) {
    case kQ8_0:
      std::memcpy(dst + 2 * r, src, 2);
      for (int k = 0; k < 32; ++k) dst[16 + k * G + r] = src[2 + k];
      break;
    case kQ4_0:
      std::memcpy(dst + 2 * r, src, 2);
      for (int j = 0; j < 16; ++j) dst[16 + j * G + r] = src[2 + j];
      break;
    case kQ4_1:
      std::memcpy(dst + 2 * r, src, 2);
      std::memcpy(dst + 16 + 2 * r, src + 2, 2);
      for (int j = 0; j < 16; ++j) dst[32 + j * G + r] = src[4 + j];
      break;
    case kQ5_0:
    case kQ5_1: {  // the file's block: d (m), qh as a little-endian uint32 (bit j: weight j), qs as Q4_0
      const int64_t mins = qtype == kQ5_1 ? 2 : 0, hoff = 16 + 8 * mins, qoff = 48 + 8 * mins;
      std::memcpy(dst + 2 * r, src, 2);
      if (mins) std::memcpy(dst + 16 + 2 * r, src + 2, 2);
      const uint32_t qh = static_cast<uint32_t>(src[2 + mins]) | static_cast<uint32_t>(src[3 + mins]) << 8 |
                          static_cast<uint32_t>(src[4 + mins]) << 16 | static_cast<uint32_t>(src[5 + mins]) << 24;
      for (int v = 0; v < 4; ++v) {
        uint8_t h = 0;
        for (int p = 0; p < 4; ++p)
          h |= static_cast<uint8_t>(((qh >> (4 * v + p)) & 1) << p | ((qh >> (4 * v + p + 16)) & 1) << (4 + p));
        dst[hoff + v * G + r] = h;
      }
      for (int j = 0; j < 16; ++j) dst[qoff + j * G + r] = src[6 + mins + j];
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      std::memcpy(dst + 2 * r, src, 2);
      std::memcpy(dst + 16 + 2 * r, src + 2, 2);
      for (int s = 0; s < 8; ++s) scale_min_k4(s, src + 4, dst + 32 + s * G + r, dst + 96 + s * G + r);
      const uint8_t* qs = src + (qtype == kQ4_K ? 16 : 48);
      for (int b = 0; b < 128; ++b) dst[160 + b * G + r] = qs[b];
      if (qtype == kQ5_K)
        for (int l = 0; l < 32; ++l) dst[1184 + l * G + r] = src[16 + l];
      break;
    }
    case kQ6_K:
      std::memcpy(dst + 2 * r, src + 208, 2);
      for (int s = 0; s < 16; ++s) dst[16 + s * G + r] = src[192 + s];
      for (int b = 0; b < 128; ++b) dst[144 + b * G + r] = src[b];
      for (int b = 0; b < 64; ++b) dst[1168 + b * G + r] = src[128 + b];
      break;
  }
}

// Row r of a packed group block, dequantized into out[0:block] (the order and the arithmetic
// of the gguf package's dequantize: d * q, d * q + m, (d sc) q - dmin mn, (d sc)(q - 32); Q5_0
// and Q5_1 as Q4_0 and Q4_1 with the fifth bit, q - 16 and d q + m).
void dequant_block(int64_t qtype, const uint8_t* blk, int64_t r, float* out) {
  const int64_t G = kGroup;
  const float d = f16(blk + 2 * r);
  switch (qtype) {
    case kQ8_0:
      for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(static_cast<int8_t>(blk[16 + k * G + r])) * d;
      break;
    case kQ4_0:
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = blk[16 + j * G + r];
        out[j] = d * static_cast<float>((q & 0xF) - 8);
        out[j + 16] = d * static_cast<float>((q >> 4) - 8);
      }
      break;
    case kQ4_1: {
      const float m = f16(blk + 16 + 2 * r);
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = blk[32 + j * G + r];
        out[j] = d * static_cast<float>(q & 0xF) + m;
        out[j + 16] = d * static_cast<float>(q >> 4) + m;
      }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool min = qtype == kQ5_1;
      const float m = min ? f16(blk + 16 + 2 * r) : 0.f;
      const int64_t hoff = min ? 32 : 16, qoff = min ? 64 : 48;
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = blk[qoff + j * G + r], h = blk[hoff + (j / 4) * G + r];
        const int lo = (q & 0xF) | ((h >> (j % 4)) & 1) << 4, hi = (q >> 4) | ((h >> (4 + j % 4)) & 1) << 4;
        if (min) {
          out[j] = d * static_cast<float>(lo) + m;
          out[j + 16] = d * static_cast<float>(hi) + m;
        } else {
          out[j] = d * static_cast<float>(lo - 16);
          out[j + 16] = d * static_cast<float>(hi - 16);
        }
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float dmin = f16(blk + 16 + 2 * r);
      for (int s = 0; s < 8; ++s) {
        const float sc = d * static_cast<float>(blk[32 + s * G + r]);
        const float mn = dmin * static_cast<float>(blk[96 + s * G + r]);
        const int i = s / 2, hi = s % 2;
        for (int l = 0; l < 32; ++l) {
          int q = (blk[160 + (32 * i + l) * G + r] >> (4 * hi)) & 0xF;
          if (qtype == kQ5_K) q |= ((blk[1184 + l * G + r] >> s) & 1) << 4;
          out[32 * s + l] = sc * static_cast<float>(q) - mn;
        }
      }
      break;
    }
    case kQ6_K:
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk + 144 + 64 * h * G;
        const uint8_t* qh = blk + 1168 + 32 * h * G;
        float* o = out + 128 * h;
        for (int l = 0; l < 32; ++l) {
          const int a = ql[l * G + r], b = ql[(l + 32) * G + r], hb = qh[l * G + r];
          const int q[4] = {(a & 0xF) | ((hb & 3) << 4), (b & 0xF) | (((hb >> 2) & 3) << 4),
                            (a >> 4) | (((hb >> 4) & 3) << 4), (b >> 4) | (((hb >> 6) & 3) << 4)};
          for (int t = 0; t < 4; ++t) {
            const int s = 8 * h + 2 * t + l / 16;  // sub-block of 16 weights
            const float sc = d * static_cast<float>(static_cast<int8_t>(blk[16 + s * G + r]));
            o[32 * t + l] = sc * static_cast<float>(q[t] - 32);
          }
        }
      }
      break;
  }
}

void check_packed(const torch::Tensor& packed, int64_t qtype, int64_t K) {
  const Format f = format_of(qtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be a contiguous uint8 [groups, blocks, bytes] tensor");
  TORCH_CHECK(K % f.block == 0 && packed.size(1) == K / f.block && packed.size(2) == f.packed,
              "packed does not match K = ", K, " for ggml type ", qtype);
}

}  // namespace

// A GEMM of `groups` output groups on the borrowed cores (cpu_borrowed_cores.h), when helpers
// run: chunks of about a 32nd of the groups (at least one), so that a chunk a preempted helper
// holds costs the caller little to redo. False: no helper, run it with at::parallel_for.
namespace {
bool borrowed_run(const std::shared_ptr<borrowed::Job>& job, int64_t groups, int64_t M, float* y, int64_t ldy,
                  int64_t N) {
  job->units = groups, job->width = kGroup, job->cols = N, job->M = M, job->y = y, job->ldy = ldy;
  job->plan((groups + 31) / 32);
  return borrowed::Pool::get().run(job);
}
}  // namespace

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {

// The decoding loops and their consumers are inlined into one function a call (direct, the
// strip loop), so that a consumer is a local whose accumulators the compiler keeps in
// registers: through a reference it must assume every float load may alias them (__m256
// aliases anything) and stores them to memory on every FMA.
#define PS_INLINE inline __attribute__((always_inline))

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

// y[0:cols] = v (+ bias[0:cols]): one row's outputs of a group (cols < 8 in the last group).
inline void store8(__m256 v, float* y, const float* bias, int64_t cols) {
  if (cols == kGroup) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, v);
  } else {
    const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias, mk));
    _mm256_maskstore_ps(y, mk, v);
  }
}

// The decoding loops below hand their weights to a consumer, four accumulator chains A
// (0..3, constants) at a time: `scale<A>(s)` when chain A's next weights belong to a new
// sub-block of scale s (d, or d sc: 8 rows' scales in the lanes); `put<A>(slot, q, k)` per k,
// q the group's 8 rows' integer quants at k as fp32 (Q4_0's q - 8 and Q6_K's q - 32
// included); per sub-block with a min, `min(slot, mn, s)` before its weights (s: which 32
// weights; slot 0 or 1: two sub-blocks decoded side by side); `finish()` at the end.
//
// Tile: MR rows of x against the group; acc[m][a] holds 8 outputs' partial sums (the group's
// rows in the lanes), NA chains a row so that one row is not bound by the FMA latency. One
// row (a decode step) sums q x unscaled in a temporary a chain and adds scale * temporary
// once a sub-block: one FMA a weight vector, where scaling each weight first costs a multiply
// too, and both compete for the same two FMA pipes. More rows scale each weight vector once
// and feed it to every row. A min multiplies the sum of x over its 32 weights (xs, rows ldxs
// apart) once, instead of every weight.
template <int MR>
struct Tile {
  // Q4_0's q - 8 and Q5_0's q - 16 as a min (8 d, 16 d) times the block's sum of x: one
  // integer subtract a weight vector fewer.
  static constexpr bool kOffsetAsMin = true;
  static constexpr int NA = MR == 1 ? 4 : 2;
  static constexpr bool kTemps = MR == 1;
  __m256 acc[MR][NA];
  __m256 t[4], sc[4];  // per chain: the unscaled sum (one row) and the current scale
  const float* x;
  int64_t ldx;
  const float* xs;
  int64_t ldxs;

  Tile(const float* x_, int64_t ldx_, const float* xs_, int64_t ldxs_) : x(x_), ldx(ldx_), xs(xs_), ldxs(ldxs_) {
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int a = 0; a < 4; ++a) t[a] = sc[a] = _mm256_setzero_ps();
  }
  template <int A>
  PS_INLINE void scale(__m256 s) {
    if constexpr (kTemps) {
      acc[0][A] = _mm256_fmadd_ps(sc[A], t[A], acc[0][A]);
      t[A] = _mm256_setzero_ps();
    }
    sc[A] = s;
  }
  template <int A>
  PS_INLINE void put(int, __m256 q, int64_t k) {
    if constexpr (kTemps) {
      t[A] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x + k), t[A]);
    } else {
      const __m256 w = _mm256_mul_ps(q, sc[A]);
      for (int m = 0; m < MR; ++m)
        acc[m][A % NA] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * ldx + k), acc[m][A % NA]);
    }
  }
  PS_INLINE void min(int slot, __m256 mn, int64_t s) {
    for (int m = 0; m < MR; ++m)
      acc[m][slot % NA] = _mm256_fnmadd_ps(mn, _mm256_broadcast_ss(xs + m * ldxs + s), acc[m][slot % NA]);
  }
  PS_INLINE void finish() {
    if constexpr (kTemps) {
      scale<0>(_mm256_setzero_ps());
      scale<1>(_mm256_setzero_ps());
      scale<2>(_mm256_setzero_ps());
      scale<3>(_mm256_setzero_ps());
    }
  }
  inline void store(float* y, int64_t ldy, const float* bias, int64_t cols) {
    for (int m = 0; m < MR; ++m) {
      __m256 v = acc[m][0];
      for (int a = 1; a < NA; ++a) v = _mm256_add_ps(v, acc[m][a]);
      store8(v, y + m * ldy, bias, cols);
    }
  }
};

// Strip: the group dequantized into buf[k][r] (fp32, 8 rows side by side), for many rows of x:
// q * scale, then a min subtracted (d q - (-m) is d q + m): the gguf package's dequantize, op
// for op (types without a min subtract 0).
struct Strip {
  static constexpr bool kOffsetAsMin = false;  // d (q - 8): the gguf package's dequantize
  float* buf;
  __m256 sc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  template <int A>
  PS_INLINE void scale(__m256 s) { sc[A] = s; }
  template <int A>
  PS_INLINE void put(int slot, __m256 q, int64_t k) {
    _mm256_store_ps(buf + kGroup * k, _mm256_sub_ps(_mm256_mul_ps(q, sc[A]), mn[slot]));
  }
  PS_INLINE void min(int slot, __m256 m, int64_t) { mn[slot] = m; }
  PS_INLINE void finish() {}
};

// Every kernel below decodes one group (nb packed blocks from `w`, laid out as this file's top
// says) into a consumer C, and prefetches the bytes it will read some blocks ahead (past the
// group's end: the thread's next group, which follows it in memory). A thread reads its groups
// as one stream, but the hardware prefetcher alone keeps too few misses in flight for it:
// without this a decode step read its weights at a third of the bandwidth the fp32 panel GEMM
// reaches (kernels/cpu_gemm.py prefetches for the same reason).
constexpr int64_t kAheadBytes = 1024;  // ~ a memory latency of decoding at one row of x

// The lines of block [w, w + bytes) of the stream, some way ahead of it.
PS_INLINE void prefetch_ahead(const uint8_t* w, int64_t bytes) {
  const int64_t ahead = bytes < kAheadBytes ? kAheadBytes : bytes;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + off), _MM_HINT_T0);
}

// One scale for all four chains (the 32-weight types: a block's d).
template <class C>
PS_INLINE void scale_all(C& t, __m256 d) {
  t.template scale<0>(d);
  t.template scale<1>(d);
  t.template scale<2>(d);
  t.template scale<3>(d);
}

// A 32-weight block's start: its bytes prefetched, its d for every chain, and (MIN) its min m
// (the consumers subtract a min: -m).
template <bool MIN, class C>
PS_INLINE void block_start(C& t, const uint8_t* w, int64_t bytes, int64_t b, float offset = 0.f) {
  prefetch_ahead(w, bytes);
  const __m256 d = f16x8(w);
  scale_all(t, d);
  if (MIN) t.min(0, _mm256_sub_ps(_mm256_setzero_ps(), f16x8(w + 16)), b);
  else if (offset != 0.f) t.min(0, _mm256_mul_ps(d, _mm256_set1_ps(offset)), b);  // d (q - o) = d q - o d
}

template <class C>
PS_INLINE void decode_q8_0(C& t, const uint8_t* w, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, w += 272) {
    block_start<false>(t, w, 272, b);
    const uint8_t* q = w + 16;
    const int64_t k0 = 32 * b;
    for (int k = 0; k < 32; k += 4) {
      t.template put<0>(0, cvt(i8x8(q + 8 * k)), k0 + k);
      t.template put<1>(0, cvt(i8x8(q + 8 * k + 8)), k0 + k + 1);
      t.template put<2>(0, cvt(i8x8(q + 8 * k + 16)), k0 + k + 2);
      t.template put<3>(0, cvt(i8x8(q + 8 * k + 24)), k0 + k + 3);
    }
  }
  t.finish();
}

// Q4_0 (MIN false: q - 8, exact in integers) and Q4_1 (MIN: d q + m).
template <class C, bool MIN>
PS_INLINE void decode_q4(C& t, const uint8_t* w, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  constexpr int64_t bytes = MIN ? 160 : 144, qoff = MIN ? 32 : 16;
  constexpr bool sub = !MIN && !C::kOffsetAsMin;  // q - 8 per weight vector (else a min of 8 d)
  auto q4 = [&](__m256i v) { return cvt(sub ? _mm256_sub_epi32(v, eight) : v); };
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    block_start<MIN>(t, w, bytes, b, sub || MIN ? 0.f : 8.f);
    const uint8_t* q = w + qoff;
    const int64_t k0 = 32 * b;
    for (int j = 0; j < 16; j += 2) {
      const __m256i v0 = u8x8(q + 8 * j), v1 = u8x8(q + 8 * j + 8);
      t.template put<0>(0, q4(_mm256_and_si256(v0, low)), k0 + j);
      t.template put<1>(0, q4(_mm256_srli_epi32(v0, 4)), k0 + 16 + j);
      t.template put<2>(0, q4(_mm256_and_si256(v1, low)), k0 + j + 1);
      t.template put<3>(0, q4(_mm256_srli_epi32(v1, 4)), k0 + 17 + j);
    }
  }
  t.finish();
}

// Q5_0 (MIN false: q - 16, exact in integers) and Q5_1 (MIN: d q + m): Q4's nibbles, each
// with its fifth bit from qh[v][r] (bit p for weight 4 v + p, bit 4 + p for weight 4 v + p + 16).
template <int P>
PS_INLINE __m256i fifth_lo(__m256i h) {  // bit P of each lane, moved to bit 4
  const __m256i bit4 = _mm256_set1_epi32(16);
  return _mm256_and_si256(P <= 4 ? _mm256_slli_epi32(h, 4 - P) : _mm256_srli_epi32(h, P - 4), bit4);
}

template <class C, bool MIN>
PS_INLINE void decode_q5(C& t, const uint8_t* w, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), sixteen = _mm256_set1_epi32(16);
  constexpr int64_t bytes = MIN ? 192 : 176, hoff = MIN ? 32 : 16, qoff = MIN ? 64 : 48;
  constexpr bool sub = !MIN && !C::kOffsetAsMin;  // q - 16 per weight vector (else a min of 16 d)
  auto q5 = [&](__m256i v) { return cvt(sub ? _mm256_sub_epi32(v, sixteen) : v); };
  auto pair = [&](const __m256i& h, const uint8_t* q, int64_t k, auto p) __attribute__((always_inline)) {  // weights k, k + 1, k + 16, k + 17
    constexpr int P = decltype(p)::value;
    const __m256i v0 = u8x8(q), v1 = u8x8(q + 8);
    t.template put<0>(0, q5(_mm256_or_si256(_mm256_and_si256(v0, low), fifth_lo<P>(h))), k);
    t.template put<1>(0, q5(_mm256_or_si256(_mm256_srli_epi32(v0, 4), fifth_lo<P + 4>(h))), k + 16);
    t.template put<2>(0, q5(_mm256_or_si256(_mm256_and_si256(v1, low), fifth_lo<P + 1>(h))), k + 1);
    t.template put<3>(0, q5(_mm256_or_si256(_mm256_srli_epi32(v1, 4), fifth_lo<P + 5>(h))), k + 17);
  };
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    block_start<MIN>(t, w, bytes, b, sub || MIN ? 0.f : 16.f);
    const uint8_t* q = w + qoff;
    const int64_t k0 = 32 * b;
    for (int v = 0; v < 4; ++v) {
      const __m256i h = u8x8(w + hoff + 8 * v);
      pair(h, q + 8 * (4 * v), k0 + 4 * v, std::integral_constant<int, 0>());
      pair(h, q + 8 * (4 * v + 2), k0 + 4 * v + 2, std::integral_constant<int, 2>());
    }
  }
  t.finish();
}

// Q4_K and Q5_K (HIGH: the fifth bit from qh). Chunk i decodes sub-blocks 2i (low nibbles:
// chains 0 and 2, slot 0) and 2i + 1 (high nibbles: chains 1 and 3, slot 1) side by side.
template <class C, bool HIGH>
PS_INLINE void decode_q45_k(C& t, const uint8_t* w, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), bit4 = _mm256_set1_epi32(16);
  constexpr int64_t bytes = HIGH ? 1440 : 1184;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    prefetch_ahead(w, bytes);
    const __m256 d = f16x8(w), dmin = f16x8(w + 16);
    const int64_t k0 = 256 * b;
    for (int i = 0; i < 4; ++i) {
      const __m256 s0 = _mm256_mul_ps(d, cvt(u8x8(w + 32 + 16 * i))), s1 = _mm256_mul_ps(d, cvt(u8x8(w + 40 + 16 * i)));
      t.template scale<0>(s0);
      t.template scale<2>(s0);
      t.template scale<1>(s1);
      t.template scale<3>(s1);
      t.min(0, _mm256_mul_ps(dmin, cvt(u8x8(w + 96 + 16 * i))), 8 * b + 2 * i);
      t.min(1, _mm256_mul_ps(dmin, cvt(u8x8(w + 104 + 16 * i))), 8 * b + 2 * i + 1);
      const uint8_t* q = w + 160 + 32 * i * kGroup;
      const __m128i shift = _mm_cvtsi32_si128(2 * i);
      const int64_t ka = k0 + 64 * i;
      for (int l = 0; l < 32; l += 2) {
        __m256i lo[2], hi[2];
        for (int u = 0; u < 2; ++u) {
          const __m256i v = u8x8(q + 8 * (l + u));
          lo[u] = _mm256_and_si256(v, low);
          hi[u] = _mm256_srli_epi32(v, 4);
          if (HIGH) {  // bits 2i and 2i + 1 of qh[l] are the fifth bits of the two sub-blocks
            const __m256i h = _mm256_srl_epi32(u8x8(w + 1184 + 8 * (l + u)), shift);
            lo[u] = _mm256_or_si256(lo[u], _mm256_and_si256(_mm256_slli_epi32(h, 4), bit4));
            hi[u] = _mm256_or_si256(hi[u], _mm256_and_si256(_mm256_slli_epi32(h, 3), bit4));
          }
        }
        t.template put<0>(0, cvt(lo[0]), ka + l);
        t.template put<1>(1, cvt(hi[0]), ka + 32 + l);
        t.template put<2>(0, cvt(lo[1]), ka + l + 1);
        t.template put<3>(1, cvt(hi[1]), ka + 33 + l);
      }
    }
  }
  t.finish();
}

// Q6_K: per half h of 128 weights and l < 32, four weights l, l + 32, l + 64, l + 96 (chains
// 0..3, sub-blocks 8h + 2u + l / 16), their 6-bit q - 32 exact in integers.
template <class C>
PS_INLINE void decode_q6_k(C& t, const uint8_t* w, int64_t nb) {
  const __m256i low = _mm256_set1_epi32(0xF), two = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32);
  for (int64_t b = 0; b < nb; ++b, w += 1680) {
    prefetch_ahead(w, 1680);
    const __m256 d = f16x8(w);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = w + 144 + 64 * h * kGroup;
      const uint8_t* qh = w + 1168 + 32 * h * kGroup;
      const int64_t kh = 256 * b + 128 * h;
      for (int half = 0; half < 2; ++half) {
        const uint8_t* sc = w + 16 + 8 * (8 * h + half);
        t.template scale<0>(_mm256_mul_ps(d, cvt(i8x8(sc))));
        t.template scale<1>(_mm256_mul_ps(d, cvt(i8x8(sc + 16))));
        t.template scale<2>(_mm256_mul_ps(d, cvt(i8x8(sc + 32))));
        t.template scale<3>(_mm256_mul_ps(d, cvt(i8x8(sc + 48))));
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const __m256i a = u8x8(ql + 8 * l), c = u8x8(ql + 8 * (l + 32)), hb = u8x8(qh + 8 * l);
          const __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi32(hb, 4), two));
          const __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, low), _mm256_and_si256(_mm256_slli_epi32(hb, 2), two));
          const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(hb, two));
          const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_and_si256(_mm256_srli_epi32(hb, 2), two));
          t.template put<0>(0, cvt(_mm256_sub_epi32(q1, off)), kh + l);
          t.template put<1>(0, cvt(_mm256_sub_epi32(q2, off)), kh + l + 32);
          t.template put<2>(0, cvt(_mm256_sub_epi32(q3, off)), kh + l + 64);
          t.template put<3>(0, cvt(_mm256_sub_epi32(q4, off)), kh + l + 96);
        }
      }
    }
  }
  t.finish();
}

template <class C>
PS_INLINE void decode(int64_t qtype, C& t, const uint8_t* w, int64_t nb) {
  switch (qtype) {
    case kQ8_0: decode_q8_0(t, w, nb); break;
    case kQ4_0: decode_q4<C, false>(t, w, nb); break;
    case kQ4_1: decode_q4<C, true>(t, w, nb); break;
    case kQ5_0: decode_q5<C, false>(t, w, nb); break;
    case kQ5_1: decode_q5<C, true>(t, w, nb); break;
    case kQ4_K: decode_q45_k<C, false>(t, w, nb); break;
    case kQ5_K: decode_q45_k<C, true>(t, w, nb); break;
    case kQ6_K: decode_q6_k(t, w, nb); break;
  }
}

#include "cpu_gguf_int8.h"  // the int8-activation kernels

// Up to kDirectRows rows of x take the weights straight from their blocks, dequantized in
// registers (one pass over the group: a decode step, or a few rows); more rows dequantize
// each group once into a strip (L1 or L2) and run fp32 tiles over it, kRowBlock rows of x
// at a time (so that those rows stay in L2 across the thread's groups).
constexpr int kStripRows = 8;  // rows of x a strip tile holds: 8 accumulator chains
constexpr int64_t kRowBlock = 64;

template <int MR>
void direct(int64_t qtype, const uint8_t* w, int64_t nb, const float* x, int64_t ldx, const float* xs,
            int64_t ldxs, float* y, int64_t ldy, const float* bias, int64_t cols) {
  Tile<MR> t(x, ldx, xs, ldxs);
  decode(qtype, t, w, nb);
  t.store(y, ldy, bias, cols);
}

// y[0:MR, 0:8] = x[0:MR, :] . buf^T over K, each row in k order (NA chains a row when MR is small).
template <int MR>
void strip_tile(const float* buf, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                const float* bias, int64_t cols) {
  constexpr int NA = MR >= 6 ? 1 : 2;
  __m256 acc[MR][NA];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += NA) {
    for (int a = 0; a < NA; ++a) {
      const __m256 w = _mm256_load_ps(buf + kGroup * (k + a));
      for (int m = 0; m < MR; ++m) acc[m][a] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * ldx + k + a), acc[m][a]);
    }
  }
  for (int m = 0; m < MR; ++m)
    store8(NA == 1 ? acc[m][0] : _mm256_add_ps(acc[m][0], acc[m][NA - 1]), y + m * ldy, bias, cols);
}

void strip_rows(const float* buf, int64_t K, int64_t M, const float* x, int64_t ldx, float* y, int64_t ldy,
                const float* bias, int64_t cols) {
  for (int64_t m = 0; m < M;) {
    const int64_t r = std::min<int64_t>(kStripRows, M - m);
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (r) {
      case 1: strip_tile<1>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 2: strip_tile<2>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 3: strip_tile<3>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 4: strip_tile<4>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 5: strip_tile<5>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 6: strip_tile<6>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      case 7: strip_tile<7>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
      default: strip_tile<8>(buf, K, xm, ldx, ym, ldy, bias, cols); break;
    }
    m += r;
  }
}

// Groups [g0, g1) (nb blocks of `bytes` each from w) against rows [0, M) of x.
void run_groups(int64_t qtype, const uint8_t* w, int64_t nb, int64_t bytes, int64_t block, int64_t g0, int64_t g1,
                int64_t M, const float* x, int64_t ldx, const float* xs, int64_t ldxs, float* y, int64_t ldy,
                const float* bias, int64_t N) {
  const int64_t K = nb * block;
  auto cols = [&](int64_t g) { return std::min<int64_t>(kGroup, N - g * kGroup); };
  if (M <= kDirectRows) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * nb * bytes;
      float* yg = y + g * kGroup;
      const float* bg = bias ? bias + g * kGroup : nullptr;
      switch (M) {
        case 1: direct<1>(qtype, wg, nb, x, ldx, xs, ldxs, yg, ldy, bg, cols(g)); break;
        case 2: direct<2>(qtype, wg, nb, x, ldx, xs, ldxs, yg, ldy, bg, cols(g)); break;
        case 3: direct<3>(qtype, wg, nb, x, ldx, xs, ldxs, yg, ldy, bg, cols(g)); break;
        default: direct<4>(qtype, wg, nb, x, ldx, xs, ldxs, yg, ldy, bg, cols(g)); break;
      }
    }
    return;
  }
  float* buf = static_cast<float*>(std::aligned_alloc(32, static_cast<size_t>(K * kGroup) * sizeof(float)));
  TORCH_CHECK(buf != nullptr, "out of memory for a strip of ", K, " x 8 weights");
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
    for (int64_t g = g0; g < g1; ++g) {
      Strip strip{buf};
      decode(qtype, strip, w + g * nb * bytes, nb);
      strip_rows(buf, K, std::min(kRowBlock, M - m0), x + m0 * ldx, ldx, y + m0 * ldy + g * kGroup, ldy,
                 bias ? bias + g * kGroup : nullptr, cols(g));
    }
  std::free(buf);
}

// y = x W^T (+ bias) with x's rows quantized to int8, when the path takes this call.
bool gemm_int8(int64_t qtype, const uint8_t* w, int64_t nb, int64_t bytes, int64_t groups, int64_t M,
               const float* x, int64_t ldx, float* y, int64_t ldy, const float* bias, int64_t N) {
  // On AVX2, Q5_K's and Q6_K's high bits cost more to unpack than a row tile of 4 saves over
  // the fp32 strip, which decodes a group once for all rows: theirs take int8 at decode's few
  // rows only. VNNI's tile of 8 rows and cheaper sums turn that around.
  if (std::is_same_v<Int8Isa, Avx2Int8> && M > kDirectRows && (qtype == kQ5_K || qtype == kQ6_K)) return false;
  auto xq = std::make_shared<XQuant>(x, ldx, M, nb * format_of(qtype).block / 32);  // blocks of 32 whatever the type's
  if (borrowed::Pool::get().helpers()) {
    struct Int8Job : borrowed::Job {
      int64_t qtype, nb, bytes;
      const uint8_t* w;
      const float* bias;
      std::shared_ptr<XQuant> xq;  // the job's own: a helper may read it after the call returned
      void compute(int64_t g0, int64_t g1, float* out, int64_t ldo) override {
        run_groups_int8(qtype, w, nb, bytes, g0, g1, M, xq->rows.data(), out, ldo, bias, cols);
      }
    };
    auto job = std::make_shared<Int8Job>();
    job->qtype = qtype, job->nb = nb, job->bytes = bytes, job->w = w, job->bias = bias, job->xq = xq;
    if (borrowed_run(job, groups, M, y, ldy, N)) return true;
  }
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    run_groups_int8(qtype, w, nb, bytes, gb, ge, M, xq->rows.data(), y, ldy, bias, N);
  });
  return true;
}

}  // namespace
constexpr const char* kIsa = kInt8Isa;  // the int8 kernels' (the fp32 ones: AVX2 in both)
#else
namespace {
// No AVX2 + FMA + F16C: each row of each group dequantized (dequant_block) and dotted in order.
void run_groups(int64_t qtype, const uint8_t* w, int64_t nb, int64_t bytes, int64_t block, int64_t g0, int64_t g1,
            int64_t M, const float* x, int64_t ldx, const float*, int64_t, float* y, int64_t ldy,
            const float* bias, int64_t N) {
  std::vector<float> row(static_cast<size_t>(nb * block));
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = 0; r < kGroup && g * kGroup + r < N; ++r) {
      const int64_t n = g * kGroup + r;
      for (int64_t b = 0; b < nb; ++b) dequant_block(qtype, w + (g * nb + b) * bytes, r, row.data() + b * block);
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < nb * block; ++k) s += row[k] * x[m * ldx + k];
        y[m * ldy + n] = bias ? s + bias[n] : s;
      }
    }
}
bool gemm_int8(int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t,
               const float*, int64_t) {
  return false;  // no int8 path without AVX2: fp32 activations
}
}  // namespace
constexpr const char* kIsa = "scalar";
#endif

// raw [N, K / block * raw bytes] uint8 (the file's rows) -> [ceil(N / 8), K / block, packed bytes],
// rows past N zero (their scales too: they dequantize to 0).
torch::Tensor pack(torch::Tensor raw, int64_t qtype, int64_t K, torch::Tensor out) {
  const Format f = format_of(qtype);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), "raw must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % f.block == 0 && raw.size(1) == K / f.block * f.raw, "raw rows do not hold K = ", K, " weights");
  const int64_t N = raw.size(0), nb = K / f.block, groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(out.dim() == 3 && out.size(0) == groups, "out must be [ceil(N / 8), K / block, packed bytes]");
  check_packed(out, qtype, K);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t g = gb; g < ge; ++g) {
      uint8_t* og = dst + g * nb * f.packed;
      std::memset(og, 0, static_cast<size_t>(nb * f.packed));
      for (int64_t r = 0; r < kGroup && g * kGroup + r < N; ++r) {
        const uint8_t* row = src + (g * kGroup + r) * raw.size(1);
        for (int64_t b = 0; b < nb; ++b) pack_block(qtype, row + b * f.raw, r, og + b * f.packed);
      }
    }
  });
  return out;
}

// out [M, N] (rows ldy apart, columns contiguous) = x [M, K] . W^T (+ bias [N]), W packed; the
// groups split over torch's intra-op threads. int8: x's rows quantized to int8 where the
// int8 path takes the call (AVX2; gemm_int8 says which calls).
void gemm(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t qtype, c10::optional<torch::Tensor> bias,
          bool int8) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), ldx = x.stride(0), ldy = out.stride(0);
  check_packed(packed, qtype, K);
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.stride(1) == 1 && out.stride(1) == 1,
              "x and out must be fp32 with contiguous rows");
  TORCH_CHECK((N + kGroup - 1) / kGroup == packed.size(0), "packed has ", packed.size(0), " groups, out ", N, " columns");
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block, groups = packed.size(0);
  const float* xp = x.data_ptr<float>();
  if (int8 && gemm_int8(qtype, packed.data_ptr<uint8_t>(), nb, f.packed, groups, M, xp, ldx, out.data_ptr<float>(),
                        ldy, bias.has_value() ? bias->data_ptr<float>() : nullptr, N))
    return;
  // The sums of x over each 32 weights, for the types with a min (d q + m: m times the sum;
  // Q4_0's and Q5_0's offsets are one in the direct passes).
  std::vector<float> xs;
  const int64_t ldxs = K / 32;
  if (M <= kDirectRows && (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 ||
                           qtype == kQ4_K || qtype == kQ5_K)) {  // the direct passes
    xs.resize(static_cast<size_t>(M * ldxs));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < ldxs; ++s) {
        float acc = 0.f;
        for (int k = 0; k < 32; ++k) acc += xp[m * ldx + 32 * s + k];
        xs[m * ldxs + s] = acc;
      }
  }
  const float* xsp = xs.empty() ? nullptr : xs.data();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  if (borrowed::Pool::get().helpers()) {
    struct Fp32Job : borrowed::Job {
      int64_t qtype, nb, bytes, block, K;
      const uint8_t* w;
      const float* bias;
      std::vector<float> x, xs;  // the job's own copies: a helper may read them after the call returned
      void compute(int64_t g0, int64_t g1, float* o, int64_t ldo) override {
        run_groups(qtype, w, nb, bytes, block, g0, g1, M, x.data(), K, xs.empty() ? nullptr : xs.data(), K / 32, o,
                   ldo, bias, cols);
      }
    };
    auto job = std::make_shared<Fp32Job>();
    job->qtype = qtype, job->nb = nb, job->bytes = f.packed, job->block = f.block, job->K = K, job->w = wp;
    job->bias = bp, job->xs = std::move(xs);
    job->x.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) std::memcpy(job->x.data() + m * K, xp + m * ldx, static_cast<size_t>(K) * sizeof(float));
    if (borrowed_run(job, groups, M, yp, ldy, N)) return;
    xs = std::move(job->xs);
    xsp = xs.empty() ? nullptr : xs.data();
  }
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    run_groups(qtype, wp, nb, f.packed, f.block, gb, ge, M, xp, ldx, xsp, ldxs, yp, ldy, bp, N);
  });
}

// x [M, K] . W^T (+ bias) into a new [M, N] tensor: gemm with the output allocated here, one
// call from Python a linear layer (a decode step makes ~120 of them; each Python-side
// allocation and check costs about as much as a small layer's GEMM).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N, c10::optional<torch::Tensor> bias,
                     bool int8) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  torch::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0)) gemm(out, x, packed, qtype, bias, int8);
  return out;
}

// out [n, K] fp32 = rows `ids` of W, dequantized (the embedding's gather).
void dequantize_rows(torch::Tensor out, torch::Tensor packed, int64_t qtype, torch::Tensor ids) {
  const int64_t K = out.size(1), n = ids.size(0);
  check_packed(packed, qtype, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && out.is_contiguous() &&
              out.scalar_type() == at::kFloat && out.size(0) == n, "ids must be int64, out fp32 [n, K] contiguous");
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block, rows = packed.size(0) * kGroup;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row id ", ip[i], " out of range");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const uint8_t* g = wp + (ip[i] / kGroup) * nb * f.packed;
      for (int64_t b = 0; b < nb; ++b) dequant_block(qtype, g + b * f.packed, ip[i] % kGroup, op + i * K + b * f.block);
    }
  });
}

std::vector<int64_t> format(int64_t qtype) {
  const Format f = format_of(qtype);
  return {f.block, f.raw, f.packed, kGroup};
}

std::string isa() { return kIsa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, py::call_guard<py::gil_scoped_release>());
  m.def("gemm", &gemm, py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, py::call_guard<py::gil_scoped_release>());
  m.def("format", &format);
  m.def("isa", &isa);
  m.def("borrow_cores", [](std::vector<int64_t> cores, bool idle, int64_t nice, int64_t spin_us) {
    return borrowed::Pool::get().configure(cores, idle, nice, spin_us);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("borrowed_cores", [] { return borrowed::Pool::get().cores(); });
  m.def("borrowed_counts", [] {
    return std::vector<int64_t>{borrowed::Pool::get().helped(), borrowed::Pool::get().stolen()};
  });
}
