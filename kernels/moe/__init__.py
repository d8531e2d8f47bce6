"""Mixture-of-experts kernels: the router's top-k and the experts' grouped GEMMs.

    grouped_torch.py   select_experts, grouped_experts: torch, one GEMM per active expert
                       (CPU, and CUDA until a fused Triton kernel sits beside it as
                       triton_fused_moe.py with this as its reference)
"""

from pagedserve.kernels.moe.grouped_torch import grouped_experts, select_experts

__all__ = ["grouped_experts", "select_experts"]
