"""Multi-LoRA shrink in Triton (Punica's SGMV, "segmented gather matrix-vector"): for each
segment of rows [start, start + num_rows) of one adapter slot, ``x @ A[slot]^T`` into fp32.

Grid, one program per (tile of rows x tile of xa columns, segment, K split):

    axis 0:  pid_m * num_tiles_n + pid_n     tiles of BLOCK_M rows of the segment,
                                             BLOCK_N columns of xa (of the slot's width)
    axis 1:  segment
    axis 2:  K split: SPLIT_K programs each sum a strided share of the input features

The host sizes axis 0 from the longest segment, so a program past its segment's rows or its
slot's width returns at once. A step of decode rows (segments of a few rows, xa a few dozen
columns wide, thousands of input features) has few tiles: SPLIT_K spreads the K loop over more
programs, which add their partial sums into a zeroed xa (fp32 atomics). With SPLIT_K 1 each
program stores its tile and xa needs no zeroing.

The semantics, the segment layout and the torch reference are in lora_ref.py.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.lora_ref import block_m_for, check_segments

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr,  # [num_tokens, K]
        a_ptr,  # [num_slots, N, K]
        xa_ptr,  # [num_tokens, >= N] fp32
        seg_ptr,  # [num_segments, 3] int32: start, num_rows, slot (contiguous)
        widths_ptr,  # [num_slots] int32: columns of xa the slot fills (<= N)
        K,
        stride_xm, stride_xk,
        stride_as, stride_an, stride_ak,
        stride_xam,
        num_tiles_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        FP32_DOT: tl.constexpr,  # fp32 inputs: exact ("ieee") dots, not tf32
    ):
        pid = tl.program_id(0)
        seg = tl.program_id(1)
        pid_k = tl.program_id(2)
        pid_m = pid // num_tiles_n
        pid_n = pid % num_tiles_n
        start = tl.load(seg_ptr + seg * 3)
        num_rows = tl.load(seg_ptr + seg * 3 + 1)
        slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)  # slot * stride_as may pass 2^31
        width = tl.load(widths_ptr + slot)
        if pid_m * BLOCK_M >= num_rows or pid_n * BLOCK_N >= width:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < num_rows
        n_ok = offs_n < width
        rows = (start + offs_m).to(tl.int64)
        x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
        a_cols = a_ptr + slot * stride_as + offs_n[None, :] * stride_an  # [1, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None] * stride_ak, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP32_DOT:
                acc += tl.dot(xt, at, input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        dst = xa_ptr + rows[:, None] * stride_xam + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(dst, acc, mask=mask)
        else:
            tl.atomic_add(dst, acc, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def lora_shrink_triton(
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, N, in], in x's dtype
    segments: torch.Tensor,  # [num_segments, 3] int32, contiguous: start, num_rows, slot
    widths: torch.Tensor,  # [num_slots] int32
    max_rows: int,  # the longest segment's num_rows (host-known: no device read)
    xa: torch.Tensor | None = None,  # [num_tokens, >= N] fp32, unit column stride
    split_k: int | None = None,  # None: choose by the tile count
) -> torch.Tensor:
    """xa, with every segment's rows filled up to its slot's width (the rest untouched,
    except with split_k > 1, which zeroes xa first)."""
    if triton is None:
        raise RuntimeError("the Triton LoRA kernels need the triton package; use the torch path on this machine.")
    num_tokens, fan_in = x.shape
    num_slots, n_max, a_in = lora_a.shape
    if a_in != fan_in:
        raise ValueError(f"lora_a has {a_in} input features, x has {fan_in}.")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"dtypes must match: x {x.dtype}, lora_a {lora_a.dtype}.")
    check_segments(segments)
    if widths.dtype != torch.int32 or tuple(widths.shape) != (num_slots,):
        raise ValueError(f"widths must be a [{num_slots}] int32 tensor (one per slot).")
    if xa is None:
        xa = torch.empty(num_tokens, n_max, dtype=torch.float32, device=x.device)
    elif xa.dtype != torch.float32 or xa.shape[0] != num_tokens or xa.shape[1] < n_max or xa.stride(1) != 1:
        raise ValueError(f"xa must be fp32 [{num_tokens}, >= {n_max}] with stride 1 along its columns.")
    num_segments = segments.shape[0]
    if num_segments == 0 or max_rows == 0 or n_max == 0:
        return xa
    block_m = block_m_for(max_rows)
    block_n = min(max(_next_pow2(n_max), 16), 64)
    block_k = 64 if fan_in >= 64 else max(_next_pow2(fan_in), 16)
    num_tiles_m, num_tiles_n = triton.cdiv(max_rows, block_m), triton.cdiv(n_max, block_n)
    if split_k is None:
        # Enough programs to fill a GPU when the tiles are few (decode): at most one K tile per split.
        tiles = num_tiles_m * num_tiles_n * num_segments
        split_k = max(1, min(triton.cdiv(256, tiles), triton.cdiv(fan_in, block_k), 32))
    if split_k > 1:
        xa.zero_()
    grid = (num_tiles_m * num_tiles_n, num_segments, split_k)
    _lora_shrink_kernel[grid](
        x, lora_a, xa, segments, widths, fan_in,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), xa.stride(0),
        num_tiles_n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        FP32_DOT=x.dtype == torch.float32,
    )
    return xa
