// The CPU extension of kernels/cpu_fused.py: rms_norm, add_rms_norm, silu_and_mul and rotary,
// one loop each (that module's docstring has the formulas and why). Compiled at run time by
// kernels/cpu_build.py, with this folder's headers (#include "...") inlined.
#include "cpu_prelude.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_exp.h"

// Rows per parallel chunk: ~16k floats, below which a thread hand-off costs more than it saves.
static inline int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_floats)); }

static inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+:ss)
  for (int64_t k = 0; k < d; ++k) ss += x[k] * x[k];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t k = 0; k < d; ++k) out[k] = w[k] * (x[k] * inv);
}

// x [n, d] (rows `stride` apart), w [d], out [n, d] contiguous.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t n = x.size(0), d = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm_row(xp + i * stride, wp, op + i * d, d, static_cast<float>(eps));
  });
}

// x += residual (in place, x and residual [n, d] contiguous), out = rms_norm(x) * w.
void add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const int64_t n = x.size(0), d = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = xp + i * d;
      const float* r = rp + i * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) row[k] = row[k] + r[k];
      norm_row(row, wp, op + i * d, d, static_cast<float>(eps));
    }
  });
}

// x [n, 2d] contiguous: out [n, d] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  const int64_t n = x.size(0), d = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(2 * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = xp + i * 2 * d;
      const float* u = g + d;
      float* o = op + i * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) o[k] = (g[k] / (1.f + exp_clamped(-g[k]))) * u[k];
    }
  });
}

// x [n, H, D] (strides sx0, sx1, 1), cos / sin [n, D] contiguous, out [n, H, D] contiguous:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1].
void rotary(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const int64_t n = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(H * D), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cp + i * D;
      const float* s = sp + i * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* r = xp + i * s0 + h * s1;
        float* o = op + (i * H + h) * D;
#pragma omp simd
        for (int64_t k = 0; k < half; ++k) o[k] = r[k] * c[k] + (-r[k + half]) * s[k];
#pragma omp simd
        for (int64_t k = half; k < D; ++k) o[k] = r[k] * c[k] + r[k - half] * s[k];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, py::call_guard<py::gil_scoped_release>());
}
