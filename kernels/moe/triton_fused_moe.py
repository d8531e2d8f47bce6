"""Mixture-of-experts in Triton: the experts' SwiGLU MLPs as two grouped GEMM launches.

The (token, slot) pairs the router chose (``topk_ids`` [n, k], pair p = token * k + slot) are
sorted by expert and each expert's run padded to a whole number of BLOCK_M rows, so every
block of rows belongs to one expert (``align_by_expert``, torch ops on the device):

    sorted_ids   | e0: p3 p9 -- -- | e1: p0 p4 p5 p8 | e3: p1 p6 -- -- | -- ...   (-- : num_pairs)
    block_expert |        0        |        1        |        3        |  -1 ...

    launch 1  (blocks x tiles of I): h[p]   = silu(x[p // k] . gate[e]^T) * (x[p // k] . up[e]^T)
    launch 2  (blocks x tiles of H): y[p]   = topk_weight[p] * (h[p] . down[e]^T)
    then      out[t] = y[t k] + ... + y[t k + k - 1]        (a sum over the slots, no atomics)

A program reads its block's expert once and gathers its rows' tokens, so the expert's weight
tile is read once for all the block's rows and an expert nobody chose is never read. The
buffers are sized from n, k and E alone (at most n k + min(E, n k) (BLOCK_M - 1) padded
rows): nothing is read back to the host, so the step can run inside a CUDA graph. Blocks
past the used ones have expert -1 and return at once.

Numerics follow the torch reference (grouped_torch.py): fp32 accumulation, the gate and up
products rounded to the model dtype before the SwiGLU (as ``F.linear`` leaves them), the
down product rounded before the fp32 routing weight multiplies it. w13 [E, 2I, H] holds
[gate ; up] rows, w2 [E, H, I]; with tensor parallelism I is this rank's slice and the
result a partial sum the caller all-reduces.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _moe_gate_up_kernel(
        x_ptr,  # [n, H]
        w13_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
        h_ptr,  # [n k, I] out: silu(gate) * up, per pair
        sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32: pair index, num_pairs where padding
        block_expert_ptr,  # [num_blocks] int32: the block's expert, -1 for an unused block
        num_pairs, top_k, H, I,
        stride_xm, stride_xk,
        stride_we, stride_wn, stride_wk,
        stride_hm,
        num_tiles_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,  # fp32 inputs: exact ("ieee") dots, not tf32
    ):
        pid = tl.program_id(0)
        pid_m = pid // num_tiles_n
        pid_n = pid % num_tiles_n
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pairs < num_pairs
        tokens = (pairs // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
        w_e = w13_ptr + expert.to(tl.int64) * stride_we
        gate_cols = w_e + offs_n[None, :] * stride_wn  # [1, BLOCK_N]
        up_cols = w_e + (offs_n[None, :] + I) * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(gate_cols + offs_k[:, None] * stride_wk, mask=b_mask, other=0.0)
            bu = tl.load(up_cols + offs_k[:, None] * stride_wk, mask=b_mask, other=0.0)
            if FP32_DOT:
                acc_g += tl.dot(a, bg, input_precision="ieee")
                acc_u += tl.dot(a, bu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, bg)
                acc_u += tl.dot(a, bu)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)  # what F.linear would have returned, in the model dtype
        u = acc_u.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)  # silu, rounded as the torch op rounds
        dst = h_ptr + pairs.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
        tl.store(dst, (act * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_down_kernel(
        h_ptr,  # [n k, I]
        w2_ptr,  # [E, H, I]
        y_ptr,  # [n k, H] out: the pair's weighted expert output
        topk_weights_ptr,  # [n k] fp32
        sorted_ids_ptr, block_expert_ptr,
        num_pairs, H, I,
        stride_hm,
        stride_we, stride_wn, stride_wk,
        stride_ym,
        num_tiles_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_m = pid // num_tiles_n
        pid_n = pid % num_tiles_n
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pairs < num_pairs
        rows = pairs.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        h_rows = h_ptr + rows[:, None] * stride_hm
        w_cols = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(h_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP32_DOT:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        dt = y_ptr.dtype.element_ty
        weight = tl.load(topk_weights_ptr + rows, mask=m_ok, other=0.0)
        y = acc.to(dt).to(tl.float32) * weight[:, None]
        dst = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        tl.store(dst, y.to(dt), mask=m_ok[:, None] & n_ok[None, :])


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of ``sorted_ids``: enough for every expert's run padded to BLOCK_M, whatever
    the routing (each nonempty run adds at most BLOCK_M - 1 rows of padding)."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor,  # [n, k], any integer dtype
                    num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [padded_capacity] int32, block_expert [padded_capacity / block_m] int32)
    as the module docstring draws them: pairs grouped by expert in ascending order (a stable
    sort, so a run keeps its pairs in token order), each run starting on a block boundary.
    Device ops only, shapes from the arguments: no value is read back to the host."""
    n, k = topk_ids.shape
    num_pairs, dev = n * k, topk_ids.device
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # of each expert's run, unpadded
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert
    sorted_e = flat[order]
    dest = (padded_end - padded)[sorted_e] + torch.arange(num_pairs, device=dev) - run_start[sorted_e]
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(capacity // block_m, device=dev)
    block_expert = torch.searchsorted(padded_end // block_m, blocks, right=True)  # num_experts: unused
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows a block holds: small when each expert gets a few rows (decode), larger for
    prefill, where a bigger tile reuses each weight tile over more rows."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fused_experts_triton(x: torch.Tensor,  # [n, H]
                         w13: torch.Tensor,  # [E, 2I, H]
                         w2: torch.Tensor,  # [E, H, I]
                         topk_weights: torch.Tensor,  # [n, k] fp32
                         topk_ids: torch.Tensor,  # [n, k]
                         *, block_m: int | None = None, block_n: int | None = None,
                         block_k: int | None = None) -> torch.Tensor:  # [n, H], x's dtype
    """grouped_torch.grouped_experts, in two Triton launches (see the module docstring)."""
    if triton is None:
        raise RuntimeError("the Triton MoE kernel needs the triton package; use the torch path on this machine.")
    n, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if x.dim() != 2 or x.shape != (n, hidden) or tuple(w2.shape) != (num_experts, hidden, inter) \
            or two_i != 2 * inter or tuple(topk_weights.shape) != (n, k):
        raise ValueError(f"fused_experts_triton: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)} do not agree.")
    if not (x.dtype == w13.dtype == w2.dtype) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtypes must match and be fp32, fp16 or bf16: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}.")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32 (the router's), got {topk_weights.dtype}.")
    if n == 0:
        return torch.zeros_like(x)
    num_pairs = n * k
    block_m = block_m or choose_block_m(num_pairs, num_experts)
    fp32 = x.dtype == torch.float32
    block_k = block_k or (32 if fp32 else 64)
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()

    bn = block_n or min(64, max(16, _next_pow2(inter)))
    tiles = triton.cdiv(inter, bn)
    _moe_gate_up_kernel[(num_blocks * tiles,)](
        x, w13, h, sorted_ids, block_expert, num_pairs, k, hidden, inter,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0), tiles,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=min(block_k, max(16, _next_pow2(hidden))), FP32_DOT=fp32,
    )
    bn = block_n or min(64, max(16, _next_pow2(hidden)))
    tiles = triton.cdiv(hidden, bn)
    _moe_down_kernel[(num_blocks * tiles,)](
        h, w2, y, weights, sorted_ids, block_expert, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), tiles,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=min(block_k, max(16, _next_pow2(inter))), FP32_DOT=fp32,
    )
    return y.view(n, k, hidden).sum(dim=1) if k > 1 else y
