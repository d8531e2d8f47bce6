"""The elementwise parts of a Llama layer on CPU, one C++ loop each (a torch C++ extension,
built on first use like cpu_decode_attention.py):

    rms_norm(x, w, eps)                   x / sqrt(mean(x^2) + eps) * w      per row
    add_rms_norm(x, residual, w, eps)     x += residual; (rms_norm(x), x)    x updated in place
    silu_and_mul(x)                       silu(x[:, :d]) * x[:, d:]          x [n, 2d] -> [n, d]
    rotary(x, cos, sin)                   x*cos + rotate_half(x)*sin         x [n, heads, D], any strides

In torch each of these is 4-8 ops, each a dispatch (a fixed Python-side cost) and a pass
over memory; at decode batch sizes the dispatches are most of the cost (RMSNorm alone runs
17 times a step on the bench model; docs/notes/benchmarks-history.md has the timings). fp32 only
(the CPU engine's dtype for exactness against transformers): the same formulas in the same
order as transformers' (HF's rsqrt as 1/sqrt, rotary's two products then the sum, built
with -ffp-contract=off so no product is fused into an add); only the sum of squares runs
in another order (~1e-7 relative), and silu's exp is a polynomial of its own (within a few
ulp of expf, so that its loop vectorizes). The ``*_ref`` functions are the torch formulas,
used whenever the extension or the dtype does not fit. The C++ is kernels/cpu_fused.cpp.
"""

from __future__ import annotations

import torch

from .cpu_build import LazyExtension, read_source

_EXT = LazyExtension("pagedserve_cpu_fused_v3", read_source("cpu_fused.cpp"),
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
