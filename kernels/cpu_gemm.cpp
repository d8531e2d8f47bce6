// The CPU extension of kernels/cpu_gemm.py: fp32 y = x W^T + b over the weight's panel layout
// (that module's docstring has the layout and the tiling). Compiled at run time by
// kernels/cpu_build.py, with this folder's headers (#include "...") inlined.
// The tiles themselves are cpu_gemm_tiles.h (shared with cpu_moe.cpp).
#include "cpu_prelude.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#include "cpu_gemm_tiles.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// out [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . panels^T (+ bias [N]); the tile
// groups are split over torch's intra-op threads.
void gemm(torch::Tensor out, torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), ldx = x.stride(0), ldy = out.stride(0);
  const int64_t np = panels.size(0);
  TORCH_CHECK(panels.size(1) == K && panels.size(2) == kPanel && (N + kPanel - 1) / kPanel == np,
              "panels do not match x and out");
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t tail = N - (np - 1) * kPanel;  // columns of the last panel, 1..16
  const int64_t groups = (np + kTilePanels - 1) / kTilePanels;
  const bool wide = groups >= 16 * static_cast<int64_t>(at::get_num_threads());
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t p0 = g * kTilePanels, n_p = std::min<int64_t>(kTilePanels, np - p0);
      group(M, xp, ldx, K, wp + p0 * K * kPanel, yp + p0 * kPanel, ldy, bp ? bp + p0 * kPanel : nullptr, n_p,
            p0 + n_p == np ? tail : kPanel, g + 1 < ge ? wp + (p0 + kTilePanels) * K * kPanel : nullptr, wide);
    }
  });
}

bool supported() { return true; }
#else
void gemm(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "pagedserve's panel GEMM needs AVX-512 or AVX2 with FMA");
}
bool supported() { return false; }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
}
