"""RMSNorm with Hugging Face's numerics (fp32 statistics, cast back, then scale),
optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm so fp32 results are bit-identical.
        # (In-place where HF allocates; products commute, so the bits are the same.)
        dtype = x.dtype
        h = x.to(torch.float32)
        inv_rms = h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (h * inv_rms).to(dtype).mul_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``s = x + residual`` and returns ``(norm(s), s)``."""
        if residual is None:
            return self._norm(x)
        s = x.add_(residual)  # x is the fresh output of attention/MLP; nobody else holds it
        return self._norm(s), s
