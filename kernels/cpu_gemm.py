"""fp32 ``y = x W^T + b`` on CPU over the weight in a panel layout of its own (a C++
extension, AVX-512; built at worker start like cpu_fused.py):

    panels [ceil(N/16), K, 16]    panels[p, k, j] = W[16 p + j, k]   (rows past N are zero)

A step at decode batch sizes streams every weight once from memory, so the GEMM's speed is
the speed at which it reads W. In this layout a tile of 3 panels (48 output columns) reads
three contiguous streams, each k's 16 floats one 64-byte line, and every broadcast of
``x[m, k]`` feeds 3 FMAs; a tile holds 8 rows of x (24 accumulators in registers). The tiles
of one GEMM are split over torch's intra-op threads by panel group, so each thread streams
its own part of W and x stays in cache. The caller allocates the panels (pass ``out``) in
transparent huge pages (worker/cpu_memory.py), which a stream of weights wants as much as
the KV pool does.

Against oneDNN's pre-packed weights (kernels/cpu_linear.py), with the bench model's weights
streamed from memory on an AVX-512 Xeon, the panel GEMM is faster at decode batch sizes
(M up to 32) and about even beyond: at large M both are bound by the FMA units. (An
M-blocked loop order, x's rows kept in L2 across panel groups, was slower: more parallel
regions, less work in each.)
Summation over k is in order, one FMA per k, as in a plain dot product: fp32 results differ
from F.linear's in rounding only (~1e-6 relative).
Without AVX-512 the module builds but reports ``supported() == False``, and the load-time
probe (worker/layers/cpu_backend.py) never picks it.
"""

from __future__ import annotations

import torch

from .cpu_build import LazyExtension

PANEL = 16  # output columns per panel: one 512-bit vector of fp32

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>

constexpr int64_t kPanel = 16;
constexpr int kTileRows = 8;    // rows of x per tile
constexpr int kTilePanels = 3;  // panels per tile: 8 x 3 accumulators + 3 weight vectors + 1 broadcast

// y[0:MR, 0:16 NP] (+)= x[0:MR, :] . panels[0:NP]; the last panel stores only `last_mask`'s columns.
template <int MR, int NP>
static inline void tile(const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy,
                        const float* bias, __mmask16 last_mask) {
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t ps = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + p * ps + k * kPanel);
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

template <int NP>
static inline void rows(int64_t M, const float* x, int64_t ldx, int64_t K, const float* w, float* y,
                        int64_t ldy, const float* bias, __mmask16 last_mask) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<kTileRows, NP>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, bias, last_mask);
  const float* xr = x + m * ldx;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 0: break;
    case 1: tile<1, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    case 2: tile<2, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    case 3: tile<3, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    case 4: tile<4, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    case 5: tile<5, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    case 6: tile<6, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
    default: tile<7, NP>(xr, ldx, K, w, yr, ldy, bias, last_mask); break;
  }
}

// out [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . panels^T (+ bias [N]).
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
  const __mmask16 tail_mask = (__mmask16)((1u << tail) - 1u);
  const int64_t groups = (np + kTilePanels - 1) / kTilePanels;
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t p0 = g * kTilePanels, n_p = std::min<int64_t>(kTilePanels, np - p0);
      const __mmask16 mask = p0 + n_p == np ? tail_mask : (__mmask16)0xFFFF;
      const float* w = wp + p0 * K * kPanel;
      float* y = yp + p0 * kPanel;
      const float* b = bp ? bp + p0 * kPanel : nullptr;
      if (n_p == 3) rows<3>(M, xp, ldx, K, w, y, ldy, b, mask);
      else if (n_p == 2) rows<2>(M, xp, ldx, K, w, y, ldy, b, mask);
      else rows<1>(M, xp, ldx, K, w, y, ldy, b, mask);
    }
  });
}

bool supported() { return true; }
#else
void gemm(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "pagedserve's panel GEMM needs AVX-512");
}
bool supported() { return false; }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm, py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported);
}
"""

_EXT = LazyExtension("pagedserve_cpu_gemm_v1", _SOURCE, ["-O3", "-march=native"],
                     "CPU panel-GEMM", "the linear layers use oneDNN or F.linear")


def available() -> bool:
    """The extension built and this CPU has AVX-512."""
    mod = _EXT.get()
    return mod is not None and bool(mod.supported())


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    n, k = weight.shape
    return (n + PANEL - 1) // PANEL, k, PANEL


def pack_panels(weight: torch.Tensor,  # [N, K] fp32
                out: torch.Tensor | None = None) -> torch.Tensor:  # [ceil(N/16), K, 16], filled
    """W into the panel layout; ``out`` (shape ``panel_shape(W)``, zeros or not) is the
    caller's allocation, e.g. in huge pages."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels needs a 2-D fp32 CPU weight, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}.")
    n, k = weight.shape
    shape = panel_shape(weight)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"pack_panels: out must be a contiguous fp32 {shape}, got {tuple(out.shape)}.")
    full = n // PANEL
    with torch.no_grad():
        out[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
        if full < shape[0]:
            out[full].zero_()
            out[full, :, : n - full * PANEL].copy_(weight[full * PANEL:].t())
    return out


def gemm(x: torch.Tensor,  # [..., K] fp32, last dim contiguous
         panels: torch.Tensor,  # pack_panels(W), W [N, K]
         n: int,  # N: W's rows (the panels are padded to a multiple of 16)
         bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., N]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    if x2.shape[0]:
        _EXT.get().gemm(out, x2, panels, bias)
    return out.view(*lead, n)
