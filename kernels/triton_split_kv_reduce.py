"""Flash-decoding reduce: merge the per-split partial outputs of a decode row.

Split s of a row produced ``o_s`` (already divided by its own softmax sum) and
``lse_s = log2(sum_j 2^(score_j))`` over its key range (-inf when the range was empty).
The row's output is the lse-weighted average:

    out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M),   M = max_s lse_s
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _split_kv_reduce_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
        part_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
        stride_o_tok, stride_o_head,
        num_heads,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        s_ok = offs_s < NUM_SPLITS
        row = (tok * num_heads + head) * NUM_SPLITS
        lse = tl.load(part_lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
        parts = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                        mask=(w > 0.0)[:, None], other=0.0)
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def split_kv_reduce(
    part_out: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim_pad] fp32
    part_lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] fp32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    num_tokens, num_heads, num_splits, head_dim_pad = part_out.shape
    if part_lse.shape != (num_tokens, num_heads, num_splits) or not (part_out.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError(f"part_lse {tuple(part_lse.shape)} must be [{num_tokens}, {num_heads}, {num_splits}]; both contiguous.")
    if out.shape[:2] != (num_tokens, num_heads) or out.shape[2] > head_dim_pad or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} does not fit the partials {tuple(part_out.shape)}.")
    _split_kv_reduce_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse, out.stride(0), out.stride(1), num_heads,
        NUM_SPLITS=num_splits, SPLITS_PAD=1 << max(0, (num_splits - 1).bit_length()),
        HEAD_DIM=out.shape[2], HEAD_DIM_PAD=head_dim_pad,
    )
    return out
