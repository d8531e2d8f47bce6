"""The elementwise parts of a Llama layer on CPU, one C++ loop each (a torch C++ extension,
built on first use like cpu_decode_attention.py):

    rms_norm(x, w, eps)                   x / sqrt(mean(x^2) + eps) * w      per row
    add_rms_norm(x, residual, w, eps)     x += residual; (rms_norm(x), x)    x updated in place
    silu_and_mul(x)                       silu(x[:, :d]) * x[:, d:]          x [n, 2d] -> [n, d]
    rotary(x, cos, sin)                   x*cos + rotate_half(x)*sin         x [n, heads, D], any strides

In torch each of these is 4-8 ops, each a dispatch (a fixed Python-side cost) and a pass
over memory; at decode batch sizes the dispatches are most of the cost (RMSNorm alone runs
17 times a step on the bench model; BENCHMARKS.md has the timings). fp32 only
(the CPU engine's dtype for exactness against transformers): the same formulas in the same
order as transformers' (HF's rsqrt as 1/sqrt, rotary's two products then the sum, built
with -ffp-contract=off so no product is fused into an add); only the sum of squares runs
in another order (~1e-7 relative), and silu's exp is a polynomial of its own (within a few
ulp of expf, so that its loop vectorizes). The ``*_ref`` functions are the torch formulas,
used whenever the extension or the dtype does not fit.
"""

from __future__ import annotations

import torch

from .cpu_build import LazyExtension

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>

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

// exp(x), branch-free so that the silu loop vectorizes (std::exp is one scalar libm call per
// element; -fno-trapping-math lets GCC turn the clamps into vector min / max): Cephes' expf, x = n ln 2 + r with ln 2 in two parts, exp(r) = 1 + r + r^2 P(r) with
// P of degree 5, then 2^n put in the exponent field; within a few ulp of expf. x is clamped
// to where 2^n is a normal float (exp(-87.3) ~ 1e-38, exp(88) ~ 2e38), which moves silu's
// result by far less than its rounding; NaN passes through the clamps.
static inline float exp_clamped(float x) {
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  float r = fmaf(n, -0.693359375f, x);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
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
"""

_EXT = LazyExtension("pagedserve_cpu_fused_v2", _SOURCE,
                     ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"],
                     "CPU fused-op", "using the torch formulas")
_load = _EXT.get
available = _EXT.available


def _fits(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts) and _load() is not None


# ---------------------------------------------------------------- torch references
def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, op for op: fp32 statistics, cast back, then scale.
    h = x.to(torch.float32)
    inv_rms = h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (h * inv_rms).to(x.dtype).mul_(w)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D], cos / sin [n, 1, D]; HF's x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


# ---------------------------------------------------------------- the fused ops
def rms_norm(x: torch.Tensor,  # [n, d], rows contiguous
             w: torch.Tensor,  # [d]
             eps: float) -> torch.Tensor:  # [n, d] new
    if x.dim() != 2 or x.stride(1) != 1 or not w.is_contiguous() or not _fits(x, w):
        return rms_norm_ref(x, w, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    _load().rms_norm(out, x, w, float(eps))
    return out


def add_rms_norm(x: torch.Tensor,  # [n, d] contiguous; becomes x + residual
                 residual: torch.Tensor,  # [n, d] contiguous
                 w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (x.dim() != 2 or not x.is_contiguous() or not residual.is_contiguous() or x.shape != residual.shape
            or not w.is_contiguous() or not _fits(x, residual, w)):
        s = x.add_(residual)
        return rms_norm_ref(s, w, eps), s
    out = torch.empty(x.shape, dtype=x.dtype)
    _load().add_rms_norm(out, x, residual, w, float(eps))
    return out, x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2 or not _fits(x):
        return silu_and_mul_ref(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    _load().silu_and_mul(out, x)
    return out


def rotary(x: torch.Tensor,  # [n, heads, D], last dim contiguous (a view of qkv is fine)
           cos: torch.Tensor,  # [n, 1, D]
           sin: torch.Tensor) -> torch.Tensor:  # [n, heads, D] new, contiguous
    if (x.dim() != 3 or x.stride(2) != 1 or x.shape[-1] % 2 or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.shape[0] != x.shape[0] or not _fits(x, cos, sin)):
        return rotary_ref(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype)
    _load().rotary(out, x, cos, sin)
    return out
