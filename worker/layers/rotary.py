"""Rotary position embedding (RoPE): default, linear, YaRN, Llama 3.1 and LongRoPE (Phi-3)
frequency scaling (dynamic NTK is default rope within max_position_embeddings: model_config.py).

cos/sin are precomputed for every position up to ``max_position`` exactly as transformers
computes them (fp32 ``position * inv_freq``, ``cat(freqs, freqs)``, then cast), and the
model gathers the rows for this step's ``positions`` once per forward, shared by all
layers. Layout is the "rotate half" (NeoX) convention HF Llama checkpoints use:

    x = [x1 | x2]  ->  [x1*cos - x2*sin | x2*cos + x1*sin]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.cpu_fused import rotary


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.get("rope_type") == "linear":  # positions slowed by ``factor`` (Gemma 3's global layers)
        return inv_freq / rope_scaling["factor"]
    if rope_scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    if rope_scaling.get("rope_type") == "longrope":
        # Phi-3: one factor per frequency, the short or the long set (model_config.py picks
        # one for the engine's max_model_len). Mirrors transformers' _compute_longrope_parameters.
        ext = torch.tensor(rope_scaling["ext_factors"], dtype=torch.float32)
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (ext * base ** shape)
    if rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_scaling!r}")
    # Llama 3.1: low frequencies (long wavelengths) slowed by ``factor``, high ones kept,
    # a smooth blend in between. Mirrors transformers' _compute_llama3_parameters.
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_ctx = rope_scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, base: float, rs: dict[str, Any]) -> torch.Tensor:
    """YaRN: the original frequencies above the ramp of dimensions set by beta_fast /
    beta_slow, the ``factor``-slowed ones below it, blended linearly across it. Mirrors
    transformers' _compute_yarn_parameters (its cos/sin scale is ``attention_factor``)."""
    factor, original = rs["factor"], rs["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs["beta_fast"]), correction_dim(rs["beta_slow"])
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: slowed by factor
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # LongRoPE and YaRN scale cos and sin (HF's attention_scaling); 1.0 (exact) for the others.
        mscale = (rope_scaling or {}).get("attention_factor", 1.0)
        # Not parameters: rebuilt from the config, never loaded, moved with the module.
        self.register_buffer("cos_cache", (emb.cos() * mscale).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * mscale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [n] as [n, 1, head_dim] (broadcast over heads)."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; same op order as HF (x*cos + rotate_half(x)*sin); one C++
    loop on CPU in fp32 (kernels/cpu_fused.py)."""
    return rotary(x, cos, sin)
