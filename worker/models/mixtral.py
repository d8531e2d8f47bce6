"""Mixtral: the Mistral graph with a sparse mixture-of-experts block in every layer's MLP
place (softmax over the experts in fp32, top-k, renormalised to sum to 1).

The checkpoint calls the block ``block_sparse_moe`` and its experts' projections w1 (gate),
w3 (up), w2 (down); they load under ``mlp`` (worker/layers/fused_moe.py says how), so a
layer reads the same as every other family's.
"""

from __future__ import annotations

from typing import Any

from pagedserve.worker.layers.fused_moe import SparseMoeBlock, map_expert_name
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, LlamaAttention(cfg, backend, layer_idx), SparseMoeBlock(cfg))

    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        return map_expert_name(name) or super().map_checkpoint_name(name)
