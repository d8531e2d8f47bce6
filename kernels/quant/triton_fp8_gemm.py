"""``out = (x W8^T) * scale + b`` with W8 an Fp8Weight's e4m3 bytes (kernels/quant/fp8.py).

One program computes a [BLOCK_M, BLOCK_N] tile of out. The weight's bytes are read as uint8
and decoded to fp32 with integer operations (e4m3fn: sign, 4 exponent bits biased by 7,
3 mantissa bits; exponent 0 is subnormal, m x 2^-9), the same on every GPU and under the
interpreter; every e4m3 value is exact in fp16 and bf16, so the tile goes to tl.dot in the
activations' dtype unchanged. The row scale multiplies each output's sum once, after the
loop (a scale per row commutes with the sum over inputs). The one NaN code (0x7f / 0xff)
decodes as 480: checkpoints hold none.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant.triton_tiles import prepare, triton

if triton is not None:
    import triton.language as tl

    from pagedserve.kernels.quant.triton_tiles import accumulate, load_x, store_out, tile_offsets

    @triton.jit
    def _fp8_gemm_kernel(
        x_ptr,  # [M, K] fp32 / fp16 / bf16, row stride stride_xm, unit column stride
        w_ptr,  # [N, K] uint8 (the e4m3fn bytes), contiguous
        scale_ptr,  # [N] fp32
        bias_ptr,  # [N] (read only when HAS_BIAS)
        out_ptr,  # [M, N], row stride stride_om, unit column stride
        M, N, K,
        stride_xm, stride_om,
        HAS_BIAS: tl.constexpr,
        IEEE_FP32: tl.constexpr,  # fp32 activations: a full-precision dot (not TF32)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = load_x(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm)
            b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]
            e = (b >> 3) & 0xF
            mant = b & 0x7
            normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
            v = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)
            w = tl.where((b & 0x80) != 0, -v, v)
            acc = accumulate(acc, x, w, IEEE_FP32)
        acc *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        store_out(out_ptr, acc, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)


def fp8_gemm_triton(x: torch.Tensor,  # [..., K]
                    w,  # Fp8Weight, W [N, K]
                    bias: torch.Tensor | None = None,  # [N]
                    ) -> torch.Tensor:  # [..., N], x's dtype
    n, k = w.weight.shape
    if not w.weight.is_contiguous() or w.weight.device != x.device or w.scale.device != x.device:
        raise ValueError(f"fp8 GEMM: the weight must be contiguous on {x.device}.")
    x2, out, block_m = prepare(x, k, n, bias, "fp8")
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        x2, w.weight.view(torch.uint8), w.scale, bias if bias is not None else out, out,
        m, n, k, x2.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*x.shape[:-1], n)
