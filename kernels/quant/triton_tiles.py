"""What the weight-only GEMM kernels (triton_int4_gemm.py, triton_fp8_gemm.py) share: the host
side's checks and output, and the tile steps around each kernel's own weight decoding.

    prepare(x, k, n, bias, what)   x as [M, K] with unit column stride, out [M, N], BLOCK_M
    tile_offsets(M, N, ...)        a program's output rows and columns (grid: M tiles x N tiles)
    load_x(...)                    one [BLOCK_M, BLOCK_K] tile of x (zeros past M and K)
    accumulate(acc, x, w, IEEE)    acc += x @ w in fp32 (fp32 x: a full-precision dot, not
                                   TF32; fp16 / bf16 x: w rounded to x's dtype, as the reference
                                   GEMM on the dequantized weight in that dtype rounds it)
    store_out(...)                 acc (+ bias) to out in out's dtype, masked
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def prepare(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None,
            what: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    if x.shape[-1] != k:
        raise ValueError(f"{what} GEMM: x has {x.shape[-1]} inputs, the weight {k}.")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what} GEMM: activations must be fp32, fp16 or bf16, got {x.dtype}.")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{what} GEMM: bias {tuple(bias.shape)} must be [{n}].")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    return x2, out, 16 if m <= 16 else 32 if m <= 32 else 64


if triton is not None:

    @triton.jit
    def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's output rows and columns, and which of them exist."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit
    def load_x(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm):
        return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                       mask=m_ok[:, None] & k_ok[None, :], other=0.0)

    @triton.jit
    def accumulate(acc, x, w, IEEE_FP32: tl.constexpr):
        if IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
        return acc

    @triton.jit
    def store_out(out_ptr, acc, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
