"""RMSNorm with Hugging Face's numerics (fp32 statistics, cast back, then scale),
optionally fused with the residual add that precedes it in every decoder layer. On CPU in
fp32 both run as one C++ loop (kernels/cpu_fused.py), elsewhere as torch ops."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.cpu_fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``s = x + residual`` and returns ``(norm(s), s)``
        (x is the fresh output of attention/MLP and nobody else holds it: s is x, updated)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
