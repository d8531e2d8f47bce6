// The panel GEMM's tiles: y[rows, a group of up to 3 panels] = x[rows, :] . panels (+ bias),
// AVX-512 or AVX2 with FMA (kernels/cpu_gemm.py's docstring has the layout and the tiling).
// `group` is the entry: one group of panels over M rows, on the calling thread. Included by
// cpu_gemm.cpp (the GEMM, its groups split over threads) and cpu_moe.cpp (a layer's experts).
#ifndef PAGEDSERVE_CPU_GEMM_TILES_H
#define PAGEDSERVE_CPU_GEMM_TILES_H

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>

// AVX-512 (32 zmm registers): a tile is up to 9 rows x 3 panels, 27 accumulators + 3 weight
// vectors + 1 broadcast, so a step verifying 8 drafts (9 rows) reads the weights once.
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 9;    // rows of x per tile
constexpr int kTilePanels = 3;  // panels per tile
// Lines (k) ahead that a tile prefetches each of its panel streams: the hardware prefetcher
// alone keeps too few of a core's misses in flight to reach the memory's bandwidth.
constexpr int64_t kPrefetch = 16;

// Makes `v` a register value to the compiler, so that GCC does not fold the weight load into
// every row's FMA (see the AVX2 path below).
static inline void in_register(__m512& v) { __asm__("" : "+v"(v)); }

// y[0:MR, 0:16 NP] = x[0:MR, :] . panels[0:NP] (+ bias); the last panel stores only
// `last_mask`'s columns. `pn`: also prefetch `pn_lines` lines from there on into L2, evenly
// spread over the K k (a share of the thread's next group, fetched under this tile's FMAs).
template <int MR, int NP>
static inline void tile(const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy,
                        const float* bias, __mmask16 last_mask, const char* pn, int64_t pn_lines) {
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t ps = K * kPanel;
  const char* const pn_end = pn + 64 * pn_lines;
  int64_t pn_due = K - 1;  // a line is due each time this passes K (a counter: no division a k)
  for (int64_t k = 0; k < K; ++k) {
    if (pn) {
      pn_due += pn_lines;
      while (pn_due >= K && pn < pn_end) {
        pn_due -= K;
        _mm_prefetch(pn, _MM_HINT_T1);
        pn += 64;
      }
    }
    // A prefetch never faults: past the panel's end it only wastes a line.
    for (int p = 0; p < NP; ++p) _mm_prefetch((const char*)(w + p * ps + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) {
      wv[p] = _mm512_loadu_ps(w + p * ps + k * kPanel);
      in_register(wv[p]);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
    }
  }
  for (int p = 0; p < NP; ++p) {
    const __mmask16 mk = p == NP - 1 ? last_mask : (__mmask16)0xFFFF;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mk, bias + p * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = bias ? _mm512_add_ps(acc[m][p], b0) : acc[m][p];
      _mm512_mask_storeu_ps(y + m * ldy + p * kPanel, mk, v);
    }
  }
}

// The group's rows in as few tiles as hold them, of balanced sizes (10 rows are 5 + 5, not 9
// + 1: a 1-row tile waits on its FMAs' latency), each over the whole K: the first tile reads
// the group from memory (or from L2, where the previous group's tiles prefetched it), the
// others from L2. With two tiles or more, each prefetches a share of the thread's next group
// (`next`, null after its last), so that its stream runs under the FMAs instead of after them.
template <int NP>
static inline void rows(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                        int64_t ldy, const float* bias, __mmask16 last_mask, const float* next) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t lines = next && tiles > 1 ? kTilePanels * K : 0;  // the next group's lines
  const int64_t per = (lines + tiles - 1) / tiles;  // a tile's share of them
  for (int64_t t = 0, m = 0; m < M; ++t) {
    const int64_t off = t * per;
    const char* q = off < lines ? (const char*)next + 64 * off : nullptr;
    const int64_t n = q ? std::min<int64_t>(per, lines - off) : 0;
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    const int64_t r = (M - m) / (tiles - t);  // rows of this tile, 1 to kTileRows
    switch (r) {
      case 1: tile<1, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 2: tile<2, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 3: tile<3, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 4: tile<4, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 5: tile<5, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 6: tile<6, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 7: tile<7, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      case 8: tile<8, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
      default: tile<9, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask, q, n); break;
    }
    m += r;
  }
}

// One tile group: NP = n_p panels, the last with `last_cols` of its 16 columns; `next`: the
// panels of the thread's next group, or null after its last.
static inline void group(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                         int64_t ldy, const float* bias, int64_t n_p, int64_t last_cols, const float* next,
                         bool /*wide*/) {
  const __mmask16 mask = (__mmask16)((1u << last_cols) - 1u);
  if (n_p == 3) rows<3>(M, x, ldx, K, w, y, ldy, bias, mask, next);
  else if (n_p == 2) rows<2>(M, x, ldx, K, w, y, ldy, bias, mask, next);
  else rows<1>(M, x, ldx, K, w, y, ldy, bias, mask, next);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// AVX2 (16 ymm registers): a panel is two 8-float vectors, a tile 2 rows x 3 panels: 12
// accumulators, 12 independent FMAs per k (enough to cover the FMA latency) and 3 streams
// of weights per thread. The accumulators are one flat array over restrict pointers, every
// loop over them unrolled: written as acc[m][p][h], GCC 12 kept them in registers but also
// stored all of them to the stack on every k, which made the tile store-bound.
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 2;
constexpr int kTilePanels = 3;

// Makes `v` a register value to the compiler: without it GCC folds a weight load into each
// FMA that uses it (vfmadd231ps mem, ...), loading every weight vector once per row of the
// tile, and a 2-row tile then issues more loads than FMAs (14 for 12 a k), bound by the load
// ports instead of the FMA units.
static inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }

// The first `n` of 8 lanes (n clamped to 0..8), for the masked stores of the last panel.
static inline __m256i lanes(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::max<int64_t>(0, std::min<int64_t>(8, n))), idx);
}

// y[0:MR, 0:16 NP] = x[0:MR, :] . panels[0:NP] (+ bias) over k in [k0, k1): from zero when
// k0 == 0, else on from the partial sums y holds; the bias is added when k1 == K. The last
// panel loads and stores only `last_cols` of its 16 columns. PF: prefetch each panel
// kPrefetch k (lines) ahead, for callers that hop between panels every few k (chunked).
// PN: also prefetch `pn_lines` lines from `pn` on, `pn_rate` of them every K k, evenly spaced
// (a weight another tile reads next; see blocked).
constexpr int64_t kPrefetch = 8;

template <int MR, int NP, bool PF = false, bool PN = false>
static inline void tile(const float* __restrict x, int64_t ldx, int64_t K, const float* __restrict w,
                        float* __restrict y, int64_t ldy, const float* __restrict bias, int64_t last_cols,
                        int64_t k0, int64_t k1, const char* pn = nullptr, int64_t pn_lines = 0,
                        int64_t pn_rate = 0) {
  constexpr int NV = NP * 2;  // weight vectors per k
  __m256 acc[MR * NV];
  if (k0 == 0) {
#pragma GCC unroll 32
    for (int i = 0; i < MR * NV; ++i) acc[i] = _mm256_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const __m256i mk = lanes((j / 2 == NP - 1 ? last_cols : kPanel) - 8 * (j % 2));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) acc[m * NV + j] = _mm256_maskload_ps(y + m * ldy + 8 * j, mk);
    }
  }
  if (k1 < K) bias = nullptr;
  const int64_t ps = K * kPanel;
  const char* const pn_end = pn + 64 * pn_lines;
  int64_t pn_due = K - 1;  // a line is due each time this passes K (a counter: no division a k)
  for (int64_t k = k0; k < k1; ++k) {
    if (PN) {
      pn_due += pn_rate;
      if (pn_due >= K) {
        pn_due -= K;
        if (pn < pn_end) {
          _mm_prefetch(pn, _MM_HINT_T0);
          pn += 64;
        }
      }
    }
    if (PF) {  // a prefetch never faults: past the panel's end it only wastes a line
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) _mm_prefetch((const char*)(w + p * ps + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    }
    if constexpr (MR * NV + NV + 1 <= 16) {  // the k's weight vectors in registers, a row at a time
      __m256 wv[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) wv[j] = _mm256_loadu_ps(w + (j / 2) * ps + k * kPanel + 8 * (j % 2));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[m * NV + j] = _mm256_fmadd_ps(xb, wv[j], acc[m * NV + j]);
      }
    } else {  // too many for that: the rows' broadcasts in registers, a weight vector at a time
      __m256 xb[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        __m256 wv = _mm256_loadu_ps(w + (j / 2) * ps + k * kPanel + 8 * (j % 2));
        in_register(wv);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) acc[m * NV + j] = _mm256_fmadd_ps(xb[m], wv, acc[m * NV + j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) {
    const int64_t c0 = 8 * j;
    const int64_t cols = (j / 2 == NP - 1 ? last_cols : kPanel) - 8 * (j % 2);  // of this vector's 8
    if (cols >= 8) {
      const __m256 b = bias ? _mm256_loadu_ps(bias + c0) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + m * ldy + c0, _mm256_add_ps(acc[m * NV + j], b));
    } else {
      const __m256i mk = lanes(cols);
      const __m256 b = bias ? _mm256_maskload_ps(bias + c0, mk) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) _mm256_maskstore_ps(y + m * ldy + c0, mk, _mm256_add_ps(acc[m * NV + j], b));
    }
  }
}

// 3 to 6 rows (a step verifying 2 to 5 drafts) take one pass over the weights: per chunk of
// kChunk k, each panel of the group in turn with all the rows (up to 12 accumulators), the
// partial sums kept in y between chunks. In 2-row tiles they would take two or three passes,
// the later ones reading the panels again from L2 at the pace of the FMA units. Hopping
// between three streams every kChunk lines defeats the hardware prefetcher, so the tile
// prefetches each stream itself. The sums stay in k order: a row's result is the same bits
// whatever M.
constexpr int64_t kChunk = 16;

template <int MR, int NP>
static inline void chunked(const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy,
                           const float* bias, int64_t last_cols) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kChunk);
    for (int p = 0; p < NP; ++p)
      tile<MR, 1, true>(x, ldx, K, w + p * K * kPanel, y + p * kPanel, ldy, bias ? bias + p * kPanel : nullptr,
                        p == NP - 1 ? last_cols : kPanel, k0, k1);
  }
}

// 7 to 10 rows (a decode batch of about 8): per chunk of kChunk k, the 2-row tiles in turn
// over that chunk of the group's panels, the first streaming it from memory (prefetching),
// the others reading it from L1; the partial sums kept in y between chunks. Whole-K tiles
// would read the panels 4 or 5 times, all but the first from L2 at the pace of the FMA units.
// From 11 rows on the whole-K tiles are as fast (more FMAs per byte read).
template <int NP>
static inline void paired(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                          int64_t ldy, const float* bias, int64_t last_cols) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kChunk);
    tile<2, NP, true>(x, ldx, K, w, y, ldy, bias, last_cols, k0, k1);
    int64_t m = 2;
    for (; m + 2 <= M; m += 2) tile<2, NP>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, bias, last_cols, k0, k1);
    if (M - m == 1) tile<1, NP>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, bias, last_cols, k0, k1);
  }
}

// Rows [m, M) in whole-K 2-row tiles over the group (a 1-row tile for an odd last row).
template <int NP>
static inline void whole_k(int64_t m, int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                           int64_t ldy, const float* bias, int64_t last_cols) {
  for (; m + kTileRows <= M; m += kTileRows)
    tile<kTileRows, NP>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, bias, last_cols, 0, K);
  if (M - m == 1) tile<1, NP>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, bias, last_cols, 0, K);
}

// 11 to 48 rows (drafts verified for several sequences), and 9 or 10 of a wide weight (see
// rows): a panel at a time, its rows in blocks of 4 to 6 (8-12 accumulators, the panel's two
// vectors of a k in registers), each block over the whole K, the panel in L2 after the
// first. Whole-K 2-row tiles instead stream the group from memory at the pace of one tile
// and then compute the other rows from L2: the two phases add up. Here every block also
// prefetches its share of the next panel (the next group's first after the last), so the
// stream runs under the FMAs of the current one. The rows that 5- and 6-row blocks cannot
// cover (13, 14 and 19: one or two) take whole-K tiles over the group after its blocks.
// From about 64 rows on the 2-row tiles are faster again.
template <int NP>
static inline void blocked(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                           int64_t ldy, const float* bias, int64_t last_cols, const float* next) {
  const int64_t in_blocks = (M == 13 || M == 14 || M == 19) ? M - M % 6 : M;
  const int64_t blocks = (in_blocks + 5) / 6, ps = K * kPanel;
  for (int p = 0; p < NP; ++p) {
    const float* wp = w + p * ps;
    const char* pn = (const char*)(p + 1 < NP ? wp + ps : next);
    const int64_t per = pn ? (K + blocks - 1) / blocks : 0;  // next-panel lines per block
    const int64_t cols = p == NP - 1 ? last_cols : kPanel;
    const float* bp = bias ? bias + p * kPanel : nullptr;
    int64_t m = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = (in_blocks - m) / (blocks - b);  // 5 or 6 (4 for the first of 9 rows)
      const char* q = pn ? pn + 64 * b * per : nullptr;
      const int64_t n = pn ? std::min<int64_t>(per, K - b * per) : 0;
      if (r == 4)
        tile<4, 1, false, true>(x + m * ldx, ldx, K, wp, y + m * ldy + p * kPanel, ldy, bp, cols, 0, K, q, n, per);
      else if (r == 5)
        tile<5, 1, false, true>(x + m * ldx, ldx, K, wp, y + m * ldy + p * kPanel, ldy, bp, cols, 0, K, q, n, per);
      else
        tile<6, 1, false, true>(x + m * ldx, ldx, K, wp, y + m * ldy + p * kPanel, ldy, bp, cols, 0, K, q, n, per);
      m += r;
    }
  }
  whole_k<NP>(in_blocks, M, x, ldx, K, w, y, ldy, bias, last_cols);
}

// `wide`: the weight has many groups per thread. Then 9 and 10 rows go in blocks too: a
// thread's first group streams without the previous one's prefetch, which a few groups a
// thread (the model's square and down projections) cannot amortise and many can.
template <int NP>
static inline void rows(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                        int64_t ldy, const float* bias, int64_t last_cols, const float* next, bool wide) {
  if ((M >= 11 || (wide && M >= 9)) && M <= 48) return blocked<NP>(M, x, ldx, K, w, y, ldy, bias, last_cols, next);
  if (M >= 7 && M <= 10) return paired<NP>(M, x, ldx, K, w, y, ldy, bias, last_cols);
  switch (M) {
    case 3: return chunked<3, NP>(x, ldx, K, w, y, ldy, bias, last_cols);
    case 4: return chunked<4, NP>(x, ldx, K, w, y, ldy, bias, last_cols);
    case 5: return chunked<5, NP>(x, ldx, K, w, y, ldy, bias, last_cols);
    case 6: return chunked<6, NP>(x, ldx, K, w, y, ldy, bias, last_cols);
  }
  whole_k<NP>(0, M, x, ldx, K, w, y, ldy, bias, last_cols);
}

// `next`: the panels of the thread's next group, or null after its last.
static inline void group(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                         int64_t ldy, const float* bias, int64_t n_p, int64_t last_cols, const float* next,
                         bool wide) {
  if (n_p == 3) rows<3>(M, x, ldx, K, w, y, ldy, bias, last_cols, next, wide);
  else if (n_p == 2) rows<2>(M, x, ldx, K, w, y, ldy, bias, last_cols, next, wide);
  else rows<1>(M, x, ldx, K, w, y, ldy, bias, last_cols, next, wide);
}
#endif

#endif  // PAGEDSERVE_CPU_GEMM_TILES_H
