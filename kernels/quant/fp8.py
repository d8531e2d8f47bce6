"""fp8 (e4m3) weights with a scale per output row, its pure-torch reference, and the GEMM on it.

    weight  float8_e4m3fn [n, k]   the checkpoint's bytes, untouched
    scale   fp32 [n]               per output row; a per-tensor (or per-shard: q, k, v of a
                                   fused projection) scale is repeated over its rows, which
                                   changes no product

    W[c, i] = float(weight[c, i]) * scale[c]

``Fp8Weight.linear`` runs ``x W^T + b`` weight-only: the activations stay in their dtype (no
fp8 activation quantization, whatever the checkpoint's input scales say). On CUDA the Triton
kernel (triton_fp8_gemm.py) decodes each tile's bytes in registers and scales the sums once
per output; elsewhere the weight is dequantized on every call and multiplied with F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn


class Fp8Weight:
    """W [n, k] in the layout above."""

    __slots__ = ("weight", "scale")
    qtype = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"fp8 weight must be a 2-D {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}.")
        if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
            raise ValueError(f"fp8 weight: scale {tuple(scale.shape)} {scale.dtype} must be fp32 [{weight.shape[0]}].")
        self.weight, self.scale = weight, scale

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def to(self, device: torch.device | str) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.scale.to(device))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cuda":
            from pagedserve.kernels.quant.triton_fp8_gemm import fp8_gemm_triton, triton

            if triton is not None:
                return fp8_gemm_triton(x, self, bias)
        return F.linear(x, dequantize_fp8(self).to(x.dtype), bias)


def dequantize_fp8(w: Fp8Weight) -> torch.Tensor:
    """The reference: W [n, k] fp32."""
    return w.weight.float() * w.scale[:, None]
