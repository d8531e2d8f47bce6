"""The experts on CPU: a layer's experts packed once in the panel GEMM's layout, and run in one
C++ call a layer (kernels/cpu_moe.cpp over the tiles of kernels/cpu_gemm_tiles.h).

    CPUExperts(w13, w2)     w13 [E, 2I, H] -> [E, 2, ceil(I/16), H, 16] (gate panels, up panels)
                            w2  [E, H, I]  -> [E, ceil(H/16), I, 16]      (cpu_gemm.py's layout)
    cpu_grouped_experts(x, experts, topk_weights, topk_ids)
        the pairs sorted by expert and x's rows gathered (as grouped_torch.py does), then
        pass 1  items (expert, 48 columns of I): silu(x . gate^T) * (x . up^T)
        pass 2  items (expert, 48 columns of H): h . down^T
        each pass one parallel region, its items split over the threads by cost; then the
        fp32 routing weights and the per-token sum (index_add_), as the reference.

Why (BENCHMARKS.md, the MoE rows): a decode step gives each expert a few rows (n k / E on
average), and the reference's loop makes two GEMM calls, a SwiGLU and a copy per active
expert, each GEMM a parallel region of its own over a weight of a few hundred KB: 4 x E
thread hand-offs and Python dispatches a layer, and ``F.linear`` at 1-16 rows (MKL's sgemm on
the AMD EPYC of those rows) reads the weight far below the memory's bandwidth. Here a layer
is two hand-offs, each thread streams whole weight groups, and an expert no row chose is
never read. fp32 on AVX2 / AVX-512 only (the CPU engine's dtype for exactness); results
differ from F.linear's in summation order (~1e-6 relative), silu is cpu_fused's.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_build import LazyExtension, read_source
from pagedserve.kernels.cpu_gemm import PANEL, pack_panels
from pagedserve.kernels.cpu_linear import Alloc

_EXT = LazyExtension("pagedserve_cpu_moe_v1", read_source("cpu_moe.cpp"),
                     ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"],
                     "CPU mixture-of-experts", "the experts run one torch GEMM each")


def available(dtype: torch.dtype = torch.float32) -> bool:
    """fp32, and the extension built on a CPU with AVX-512, or AVX2 with FMA."""
    if dtype != torch.float32:
        return False
    mod = _EXT.get()
    return mod is not None and bool(mod.supported())


class CPUExperts:
    """One layer's experts in panels (the plain weights are no longer read)."""

    __slots__ = ("w13", "w2", "num_experts", "hidden_size", "intermediate_size")

    def __init__(self, w13: torch.Tensor,  # [E, 2I, H] fp32
                 w2: torch.Tensor,  # [E, H, I] fp32
                 alloc: Alloc | None = None) -> None:
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[2] != w2.shape[1] \
                or w13.shape[1] != 2 * w2.shape[2] or w13.dtype != torch.float32 or w2.dtype != torch.float32:
            raise ValueError(f"CPUExperts: fp32 w13 [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} "
                             f"{w13.dtype} and {tuple(w2.shape)} {w2.dtype}.")
        num_experts, hidden, inter = w2.shape
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, inter
        pi, ph = -(-inter // PANEL), -(-hidden // PANEL)
        new = alloc or (lambda shape: torch.empty(shape, dtype=torch.float32))
        self.w13 = new((num_experts, 2, pi, hidden, PANEL))
        self.w2 = new((num_experts, ph, inter, PANEL))
        with torch.no_grad():
            for e in range(num_experts):
                pack_panels(w13[e, :inter], self.w13[e, 0])
                pack_panels(w13[e, inter:], self.w13[e, 1])
                pack_panels(w2[e], self.w2[e])

    def nbytes(self) -> int:
        return (self.w13.numel() + self.w2.numel()) * 4


def cpu_grouped_experts(x: torch.Tensor,  # [n, H] fp32, CPU
                        experts: CPUExperts,
                        topk_weights: torch.Tensor,  # [n, k] fp32
                        topk_ids: torch.Tensor) -> torch.Tensor:  # [n, k] -> [n, H]
    n, k = topk_ids.shape
    if x.dim() != 2 or x.shape[0] != n or x.shape[1] != experts.hidden_size or x.dtype != torch.float32:
        raise ValueError(f"cpu_grouped_experts: x {tuple(x.shape)} {x.dtype} for fp32 experts of hidden size "
                         f"{experts.hidden_size} and topk_ids {tuple(topk_ids.shape)}.")
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs, grouped by expert
    token_of = order // k
    offsets = torch.zeros(experts.num_experts + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat_ids, minlength=experts.num_experts), 0, out=offsets[1:])
    rows = x.index_select(0, token_of)  # [n*k, H]
    h = torch.empty(n * k, experts.intermediate_size, dtype=torch.float32)
    out_rows = torch.empty_like(rows)
    _EXT.get().experts(out_rows, h, rows, offsets, experts.w13, experts.w2)
    # The routing weight in fp32 (as transformers multiplies it), then the per-token sum.
    weighted = out_rows.mul_(topk_weights.reshape(-1)[order, None])
    return torch.zeros_like(x).index_add_(0, token_of, weighted)
