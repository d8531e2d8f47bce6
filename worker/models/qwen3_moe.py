"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) with a sparse mixture-of-experts
block as the MLP of each layer ModelConfig lists in ``moe_layers`` (those not in
``mlp_only_layers``, every ``decoder_sparse_step``-th); the rest keep a dense SwiGLU MLP of
``intermediate_size``. Router: softmax in fp32, top-k, renormalised only if
``norm_topk_prob``. No shared experts (Qwen2-MoE's are refused in model_config.py).
"""

from __future__ import annotations

from typing import Any

from pagedserve.worker.layers.fused_moe import SparseMoeBlock, map_expert_name
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedserve.worker.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        mlp = SparseMoeBlock(cfg) if layer_idx in cfg.moe_layers else LlamaMLP(cfg)
        return LlamaDecoderLayer(cfg, Qwen3Attention(cfg, backend, layer_idx), mlp)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        return map_expert_name(name) or super().map_checkpoint_name(name)
