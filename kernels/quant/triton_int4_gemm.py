"""``out = x W^T + b`` with W an Int4Weight (kernels/quant/int4.py), dequantized inside the GEMM.

One program computes a [BLOCK_M, BLOCK_N] tile of out. For each BLOCK_K slice of the inputs
it loads the packed words of the slice (a word serves 8 inputs: the 8 rows of a word
load the same address, which the cache serves), shifts out each input's nibble, gathers
that input's group's scale and zero, or min (GGUF's Q4_1: code * scale + min; act-order: the
group comes from g_idx; else input // group_size), dequantizes the [BLOCK_K, BLOCK_N] tile in fp32 and feeds tl.dot
in the activations' dtype, accumulating in fp32:

    x [M, K] ──tile──▶ [BLOCK_M, BLOCK_K]
    qweight [K/8, N] ─▶ [BLOCK_K, BLOCK_N] codes ─(code - zero) * scale─▶ W^T tile ─┐
                                                               acc += x_tile @ W^T ◀┘
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant.triton_tiles import prepare, triton

if triton is not None:
    import triton.language as tl

    from pagedserve.kernels.quant.triton_tiles import accumulate, load_x, store_out, tile_offsets

    @triton.jit
    def _int4_gemm_kernel(
        x_ptr,  # [M, K] fp32 / fp16 / bf16, row stride stride_xm, unit column stride
        qweight_ptr,  # [K // 8, N] int32, contiguous
        scales_ptr,  # [num_groups, N], contiguous
        zeros_ptr,  # [num_groups, N] uint8, contiguous; with HAS_MIN the mins, [num_groups, N] fp16
        g_idx_ptr,  # [K] int32 (read only when HAS_G_IDX)
        bias_ptr,  # [N] (read only when HAS_BIAS)
        out_ptr,  # [M, N], row stride stride_om, unit column stride
        M, N, K,
        stride_xm, stride_om,
        group_size,
        HAS_G_IDX: tl.constexpr,
        HAS_MIN: tl.constexpr,  # w = code * scale + min (GGUF's Q4_1), not (code - zero) * scale
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
            kn_ok = k_ok[:, None] & n_ok[None, :]
            x = load_x(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm)
            words = tl.load(qweight_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=kn_ok, other=0)
            codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            at = g[:, None].to(tl.int64) * N + offs_n[None, :]
            s = tl.load(scales_ptr + at, mask=kn_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + at, mask=kn_ok, other=0).to(tl.float32)
            if HAS_MIN:
                w = codes.to(tl.float32) * s + z
            else:
                w = (codes.to(tl.float32) - z) * s  # [BLOCK_K, BLOCK_N] = W^T's tile
            acc = accumulate(acc, x, w, IEEE_FP32)
        store_out(out_ptr, acc, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)


def int4_gemm_triton(x: torch.Tensor,  # [..., K]
                     w,  # Int4Weight, W [N, K]
                     bias: torch.Tensor | None = None,  # [N]
                     ) -> torch.Tensor:  # [..., N], x's dtype
    k, n = w.k, w.n
    offset = w.zeros if w.mins is None else w.mins
    for name, t in (("qweight", w.qweight), ("scales", w.scales), ("zeros", offset)):
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"int4 GEMM: {name} must be contiguous on {x.device}.")
    x2, out, block_m = prepare(x, k, n, bias, "int4")
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_n, block_k = 64, 32  # BLOCK_K divides every group size (32, 64, 128) and a word's 8
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x2, w.qweight, w.scales, offset, w.g_idx if w.g_idx is not None else w.qweight,
        bias if bias is not None else out, out,
        m, n, k, x2.stride(0), out.stride(0), w.group_size,
        HAS_G_IDX=w.g_idx is not None, HAS_MIN=w.mins is not None, HAS_BIAS=bias is not None,
        IEEE_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*x.shape[:-1], n)
