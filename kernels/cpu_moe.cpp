// The CPU extension of kernels/moe/cpu_experts.py: one mixture-of-experts layer's experts over
// the rows routed to them, in two parallel passes over the panel GEMM's tiles (cpu_gemm_tiles.h).
// Compiled at run time by kernels/cpu_build.py, with this folder's headers inlined.
//
//   rows of expert e: [offsets[e], offsets[e + 1])   (x's rows grouped by expert by the caller)
//   pass 1, items (e, a group of 3 panels of I):  h[r, cols] = silu(x[r] . gate_e[cols]) * (x[r] . up_e[cols])
//   pass 2, items (e, a group of 3 panels of H):  y[r, cols] = h[r] . down_e[cols]
//
// w13 [E, 2, PI, H, 16]: each expert's gate panels, then its up panels (PI = ceil(I / 16));
// w2 [E, PH, I, 16]. An item reads its weight group once for all its expert's rows (in
// chunks of up to 48 rows, the tiles' range, the group then in L2), and an expert with no
// rows is never read. The items of a pass are split over torch's threads in contiguous
// ranges of about equal cost (a weight group's read plus its rows' FMAs), so one pass is one
// parallel region, whatever the number of experts.
#include "cpu_prelude.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_exp.h"
#include "cpu_gemm_tiles.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

constexpr int64_t kGroupCols = kTilePanels * kPanel;  // columns of one item
constexpr int64_t kRowChunk = 48;                     // rows a tile call takes (the tiles' range)

struct Item {
  int64_t expert, group;
};

// Items of every expert with rows, in expert order, and the cost prefix over them.
static void plan(const int64_t* off, int64_t E, int64_t groups, std::vector<Item>& items,
                 std::vector<double>& prefix) {
  items.clear();
  prefix.assign(1, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows <= 0) continue;
    for (int64_t g = 0; g < groups; ++g) {
      items.push_back({e, g});
      prefix.push_back(prefix.back() + 4.0 + static_cast<double>(rows));  // a read, then FMAs a row
    }
  }
}

// Runs fn(item) for every item, the items split over the threads by cost.
template <typename F>
static void run(const std::vector<Item>& items, const std::vector<double>& prefix, const F& fn) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const double total = prefix.back();
  at::parallel_for(0, T, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      // this thread's items: those whose cost midpoint falls in [t, t + 1) / T of the total
      auto first = std::lower_bound(prefix.begin(), prefix.end() - 1, total * t / T) - prefix.begin();
      auto last = std::lower_bound(prefix.begin(), prefix.end() - 1, total * (t + 1) / T) - prefix.begin();
      if (t == T - 1) last = n;
      for (int64_t i = first; i < last; ++i) fn(items[i]);
    }
  });
}

}  // namespace

void experts(torch::Tensor y, torch::Tensor h, torch::Tensor x, torch::Tensor offsets, torch::Tensor w13,
             torch::Tensor w2) {
  const int64_t P = x.size(0), H = x.size(1), I = h.size(1), E = w13.size(0);
  const int64_t PI = w13.size(2), PH = w2.size(1);
  TORCH_CHECK(x.is_contiguous() && h.is_contiguous() && y.is_contiguous() && w13.is_contiguous() &&
                  w2.is_contiguous() && offsets.is_contiguous(), "experts: tensors must be contiguous");
  TORCH_CHECK(w13.dim() == 5 && w13.size(1) == 2 && w13.size(3) == H && w13.size(4) == kPanel &&
                  (I + kPanel - 1) / kPanel == PI, "experts: w13 panels do not match x and h");
  TORCH_CHECK(w2.dim() == 4 && w2.size(0) == E && w2.size(2) == I && w2.size(3) == kPanel &&
                  (H + kPanel - 1) / kPanel == PH, "experts: w2 panels do not match h and y");
  TORCH_CHECK(h.size(0) == P && y.size(0) == P && y.size(1) == H && offsets.size(0) == E + 1,
              "experts: row counts do not agree");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == P, "experts: offsets must run from 0 to the number of rows");
  const float* xp = x.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<Item> items;
  std::vector<double> prefix;

  // Pass 1: gate and up of the same columns, then the SwiGLU, per item.
  const int64_t g1 = (PI + kTilePanels - 1) / kTilePanels;
  plan(off, E, g1, items, prefix);
  run(items, prefix, [&](const Item& it) {
    alignas(64) float gate[kRowChunk * kGroupCols];
    alignas(64) float up[kRowChunk * kGroupCols];
    const int64_t p0 = it.group * kTilePanels, n_p = std::min<int64_t>(kTilePanels, PI - p0);
    const int64_t c0 = p0 * kPanel, cols = std::min<int64_t>(kGroupCols, I - c0);
    const int64_t last = p0 + n_p == PI ? I - (PI - 1) * kPanel : kPanel;
    const float* wg = w13p + ((it.expert * 2 + 0) * PI + p0) * H * kPanel;
    const float* wu = w13p + ((it.expert * 2 + 1) * PI + p0) * H * kPanel;
    for (int64_t r0 = off[it.expert]; r0 < off[it.expert + 1]; r0 += kRowChunk) {
      const int64_t M = std::min<int64_t>(kRowChunk, off[it.expert + 1] - r0);
      group(M, xp + r0 * H, H, H, wg, gate, kGroupCols, nullptr, n_p, last, nullptr, false);
      group(M, xp + r0 * H, H, H, wu, up, kGroupCols, nullptr, n_p, last, nullptr, false);
      for (int64_t m = 0; m < M; ++m) {
        float* dst = hp + (r0 + m) * I + c0;
        const float* g = gate + m * kGroupCols;
        const float* u = up + m * kGroupCols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dst[c] = (g[c] / (1.f + exp_clamped(-g[c]))) * u[c];  // as silu_and_mul
      }
    }
  });

  // Pass 2: down.
  const int64_t g2 = (PH + kTilePanels - 1) / kTilePanels;
  plan(off, E, g2, items, prefix);
  run(items, prefix, [&](const Item& it) {
    const int64_t p0 = it.group * kTilePanels, n_p = std::min<int64_t>(kTilePanels, PH - p0);
    const int64_t last = p0 + n_p == PH ? H - (PH - 1) * kPanel : kPanel;
    const float* wd = w2p + (it.expert * PH + p0) * I * kPanel;
    for (int64_t r0 = off[it.expert]; r0 < off[it.expert + 1]; r0 += kRowChunk) {
      const int64_t M = std::min<int64_t>(kRowChunk, off[it.expert + 1] - r0);
      group(M, hp + r0 * I, I, I, wd, yp + r0 * H + p0 * kPanel, H, nullptr, n_p, last, nullptr, false);
    }
  });
}

bool supported() { return true; }
#else
void experts(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "pagedserve's CPU experts need AVX-512 or AVX2 with FMA");
}
bool supported() { return false; }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts", &experts, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
}
