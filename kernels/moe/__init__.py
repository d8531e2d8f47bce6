"""Mixture-of-experts kernels: the router's top-k and the experts' grouped GEMMs.

    grouped_torch.py     select_experts, grouped_experts: torch, one GEMM per active expert
                         (the reference of the two below, and the path where neither runs)
    triton_fused_moe.py  fused_experts_triton: CUDA, two grouped GEMM launches over the pairs
                         sorted by expert and padded into blocks, no host read-back
    cpu_experts.py       CPUExperts, cpu_grouped_experts: CPU, the experts packed in panels and
                         run in one C++ call a layer (kernels/cpu_moe.cpp)
"""

from pagedserve.kernels.moe.grouped_torch import grouped_experts, select_experts

__all__ = ["grouped_experts", "select_experts"]
