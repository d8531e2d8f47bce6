"""Mixture-of-experts in torch: the router's top-k and the experts' grouped GEMMs.

    topk_ids [n, k] ──flatten, stable sort by expert──▶ (token, slot) pairs grouped by expert

    sorted rows:  | e0: t3 t9 | e1: t0 t3 t5 | e2: (none) | e3: t0 t5 t9 |
                    one GEMM     one GEMM                    one GEMM     (per active expert)

    out[t] = sum over t's k slots of weight[t, slot] * expert(x[t]), added in ascending
             expert order (index_add_ over the sorted rows), as transformers' loop adds them.

Each expert is SwiGLU: w13 [E, 2I, H] holds [gate ; up] rows (silu(gate) * up), w2 [E, H, I].
With tensor parallelism I is this rank's slice of the intermediate features and the result
is a partial sum the caller all-reduces. This is the reference of triton_fused_moe.py (CUDA)
and cpu_experts.py (CPU); it reads the per-expert counts on the host (``tolist``), which on
a GPU is a sync a layer, so a CUDA worker runs it only where triton does not import.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_fused import silu_and_mul


def select_experts(router_logits: torch.Tensor,  # [n, E], the model dtype
                   top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax in fp32, top-k, optionally renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    norm_topk_prob). Returns (topk_weights [n, k] fp32, topk_ids [n, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor,  # [n, H]
                    w13: torch.Tensor,  # [E, 2I, H]
                    w2: torch.Tensor,  # [E, H, I]
                    topk_weights: torch.Tensor,  # [n, k] fp32
                    topk_ids: torch.Tensor) -> torch.Tensor:  # [n, k] -> [n, H], x's dtype
    n, k = topk_ids.shape
    if x.shape[0] != n or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_experts: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)} do not agree.")
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs, grouped by expert
    token_of = order // k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, token_of)  # [n*k, H]
    out_rows = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(counts):
        if count:
            end = start + count
            h = silu_and_mul(torch.nn.functional.linear(rows[start:end], w13[e]))
            out_rows[start:end] = torch.nn.functional.linear(h, w2[e])
            start = end
    # The routing weight in fp32, as transformers multiplies it, then back to x's dtype.
    weighted = (out_rows.float() * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)
