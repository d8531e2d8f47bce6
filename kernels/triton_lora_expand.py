"""Multi-LoRA expand in Triton (Punica's SGMV, the second half): for each segment of rows of
one adapter slot, ``out[rows] += xa[rows, c:c+r] @ B[slot, :, :r]^T`` for one module of the
projection (B pre-scaled; c its first column in xa, r the slot's rank).

Grid, one program per (tile of rows x tile of output columns, segment):

    axis 0:  pid_m * num_tiles_n + pid_n     BLOCK_M rows of the segment, BLOCK_N of out's columns
    axis 1:  segment

A slot whose adapter does not target this module (c = -1) and a program past its segment's
rows return at once; the rank loop stops at the slot's r, so a pool sized for
``max_lora_rank`` costs an adapter of a smaller rank nothing but its padding's memory. Each
output element is read, added to in fp32 and written once (no atomics): segments never share
a row. ``out`` may be a column slice of a fused projection's output (q of qkv): its row stride
is passed.

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
    def _lora_expand_kernel(
        xa_ptr,  # [num_tokens, >= c + r] fp32
        b_ptr,  # [num_slots, OUT, R]
        out_ptr,  # [num_tokens, OUT] (row stride stride_om: maybe a slice of a wider tensor)
        seg_ptr,  # [num_segments, 3] int32: start, num_rows, slot (contiguous)
        cols_ptr,  # [num_slots] int32: the module's first column in xa, -1: not targeted
        ranks_ptr,  # [num_slots] int32: the slot's rank r (<= R)
        OUT,
        stride_xam,
        stride_bs, stride_bo, stride_br,
        stride_om, stride_on,
        num_tiles_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        FP32_DOT: tl.constexpr,  # fp32 inputs: exact ("ieee") dots, not tf32
    ):
        pid = tl.program_id(0)
        seg = tl.program_id(1)
        pid_m = pid // num_tiles_n
        pid_n = pid % num_tiles_n
        start = tl.load(seg_ptr + seg * 3)
        num_rows = tl.load(seg_ptr + seg * 3 + 1)
        slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)
        col = tl.load(cols_ptr + slot)
        rank = tl.load(ranks_ptr + slot)
        if col < 0 or pid_m * BLOCK_M >= num_rows:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < num_rows
        n_ok = offs_n < OUT
        rows = (start + offs_m).to(tl.int64)
        xa_rows = xa_ptr + rows[:, None] * stride_xam + col  # [BLOCK_M, 1]
        b_cols = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bo  # [1, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < rank
            # xa rounded to B's dtype first: the dot runs in it, as torch's x @ A^T @ B^T would
            xat = tl.load(xa_rows + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
            xat = xat.to(b_ptr.dtype.element_ty)
            bt = tl.load(b_cols + offs_r[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            if FP32_DOT:
                acc += tl.dot(xat, bt, input_precision="ieee")
            else:
                acc += tl.dot(xat, bt)
        dst = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = m_ok[:, None] & n_ok[None, :]
        o = tl.load(dst, mask=mask, other=0.0)
        tl.store(dst, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand_triton(
    xa: torch.Tensor,  # [num_tokens, >= c + r] fp32, unit column stride
    lora_b: torch.Tensor,  # [num_slots, out, R] (scale folded in)
    out: torch.Tensor,  # [num_tokens, out], added into; may be a column slice
    segments: torch.Tensor,  # [num_segments, 3] int32, contiguous: start, num_rows, slot
    cols: torch.Tensor,  # [num_slots] int32, -1: the slot's adapter does not target this module
    ranks: torch.Tensor,  # [num_slots] int32
    max_rows: int,  # the longest segment's num_rows (host-known: no device read)
) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the Triton LoRA kernels need the triton package; use the torch path on this machine.")
    num_tokens, fan_out = out.shape
    num_slots, b_out, max_rank = lora_b.shape
    if b_out != fan_out:
        raise ValueError(f"lora_b has {b_out} output features, out has {fan_out}.")
    if lora_b.dtype != out.dtype:
        raise ValueError(f"dtypes must match: out {out.dtype}, lora_b {lora_b.dtype}.")
    if xa.dtype != torch.float32 or xa.shape[0] != num_tokens or xa.stride(1) != 1:
        raise ValueError(f"xa must be fp32 [{num_tokens}, N] with stride 1 along its columns.")
    check_segments(segments)
    for name, t in (("cols", cols), ("ranks", ranks)):
        if t.dtype != torch.int32 or tuple(t.shape) != (num_slots,) or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{num_slots}] int32 tensor (one per slot).")
    num_segments = segments.shape[0]
    if num_segments == 0 or max_rows == 0 or fan_out == 0:
        return out
    block_m = block_m_for(max_rows)
    block_n = 64 if fan_out >= 64 else max(1 << (fan_out - 1).bit_length(), 16)
    block_r = 16 if max_rank <= 16 else 32  # the rank loop runs to each slot's r in these steps
    num_tiles_m, num_tiles_n = triton.cdiv(max_rows, block_m), triton.cdiv(fan_out, block_n)
    grid = (num_tiles_m * num_tiles_n, num_segments)
    _lora_expand_kernel[grid](
        xa, lora_b, out, segments, cols, ranks, fan_out,
        xa.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), out.stride(0), out.stride(1),
        num_tiles_n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, FP32_DOT=out.dtype == torch.float32,
    )
    return out
