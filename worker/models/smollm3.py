"""SmolLM3: the Llama graph where every few layers skip rotary embeddings (NoPE layers).

config.json's ``no_rope_layers[i]`` is 1 where layer i rotates q and k and 0 where it does
not (by default every 4th layer, ``no_rope_layer_interval``); ModelConfig turns it into
``nope_layers``. A NoPE layer's keys go into the paged cache unrotated, so a prefix-cache
hit or a recompute reads the same keys as the first pass.
"""

from __future__ import annotations

import torch

from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class NoRopeAttention(LlamaAttention):
    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return qk


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        attn_cls = NoRopeAttention if layer_idx in cfg.nope_layers else LlamaAttention
        return LlamaDecoderLayer(cfg, attn_cls(cfg, backend, layer_idx), LlamaMLP(cfg))
