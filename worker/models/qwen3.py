"""Qwen3 (dense): the Llama graph with an RMSNorm over each head of q and of k, before rope.

    q_proj -> [n, heads, head_dim] -> q_norm (weight [head_dim], shared by the heads) -> rope
    k_proj -> [n, kv_heads, head_dim] -> k_norm                                       -> rope

head_dim is its own config field (Qwen3-0.6B: hidden 1024, 16 heads of 128), which
ModelConfig already reads. q/k/v and o_proj carry a bias only if ``attention_bias``.
The norm weights are per head_dim, so every tensor-parallel rank holds them whole.
"""

from __future__ import annotations

import torch

from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import apply_rotary
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: str, layer_idx: int = 0) -> None:
        super().__init__(cfg, backend, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = qk.shape[0], self.head_dim
        q = self.q_norm(qk[:, : self.num_heads].reshape(-1, d)).view(n, -1, d)
        k = self.k_norm(qk[:, self.num_heads:].reshape(-1, d)).view(n, -1, d)
        return apply_rotary(torch.cat([q, k], dim=1), cos, sin)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, Qwen3Attention(cfg, backend, layer_idx), LlamaMLP(cfg))
