"""Multi-LoRA shrink and expand over segments of rows: the pure-torch reference of the Triton
kernels (triton_lora_shrink.py, triton_lora_expand.py), and their shared vocabulary.

A step's rows are sorted by adapter, so each adapter's rows are a few runs (segments):

    rows:      [ d0 d1 | d2 | d3 d4 | p0 p0 p0 | p1 p1 ]      (base-model rows: no segment)
    segments:  [start, num_rows, slot] int32 per run          [num_segments, 3]

One projection's LoRA over the slots of a pool (S slots, rank R, ``k`` the modules an adapter
targets in this projection, packed in A at rows [k*r, (k+1)*r) with r the slot's rank):

    shrink   xa[s:s+n, :widths[slot]] = x[s:s+n] @ A[slot, :widths[slot]]^T        fp32
    expand   out[s:s+n] += xa[s:s+n, c:c+r] @ B[slot, :, :r]^T   c = cols[slot] (-1: none)

``widths`` [S] is k*r per slot (0: the slot's adapter targets none of the projection's modules);
``cols`` [S] and ``ranks`` [S] describe one of the projection's modules. B is pre-scaled. xa is
fp32 and cast to B's dtype for the expand, as a torch ``x @ A^T`` in the model's dtype would be
rounded; rows outside every segment are neither read nor written.
"""

from __future__ import annotations

import torch


def check_segments(segments: torch.Tensor) -> None:
    """The Triton wrappers' check of the segment table (the kernels read it as int32 triples)."""
    if segments.dtype != torch.int32 or segments.dim() != 2 or segments.shape[1] != 3 or not segments.is_contiguous():
        raise ValueError("segments must be a contiguous [num_segments, 3] int32 tensor (start, num_rows, slot).")


def block_m_for(max_rows: int) -> int:
    """Rows per program for segments of at most ``max_rows`` rows (tl.dot wants >= 16)."""
    return 16 if max_rows <= 16 else 32 if max_rows <= 32 else 64


def lora_shrink_ref(
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, N, in]
    segments: torch.Tensor,  # [num_segments, 3] int32: start, num_rows, slot
    widths: torch.Tensor,  # [num_slots] int32: columns of xa each slot fills
    xa: torch.Tensor,  # [num_tokens, >= N] fp32
) -> torch.Tensor:
    widths_l = widths.tolist()
    for start, n, slot in segments.tolist():
        w = widths_l[slot]
        if w > 0 and n > 0:
            xa[start:start + n, :w] = x[start:start + n].float() @ lora_a[slot, :w].float().t()
    return xa


def lora_expand_ref(
    xa: torch.Tensor,  # [num_tokens, >= N] fp32, from the shrink
    lora_b: torch.Tensor,  # [num_slots, out, R] (scale folded in)
    out: torch.Tensor,  # [num_tokens, out], added into
    segments: torch.Tensor,  # [num_segments, 3] int32: start, num_rows, slot
    cols: torch.Tensor,  # [num_slots] int32: this module's first column in xa, -1: not targeted
    ranks: torch.Tensor,  # [num_slots] int32: the slot's rank r (<= R)
) -> torch.Tensor:
    cols_l, ranks_l = cols.tolist(), ranks.tolist()
    for start, n, slot in segments.tolist():
        c, r = cols_l[slot], ranks_l[slot]
        if c < 0 or n == 0 or r == 0:
            continue
        delta = xa[start:start + n, c:c + r].to(lora_b.dtype).float() @ lora_b[slot, :, :r].float().t()
        out[start:start + n] = (out[start:start + n].float() + delta).to(out.dtype)
    return out
