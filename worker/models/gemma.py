"""Gemma 2 and Gemma 3 (text: Gemma2ForCausalLM, Gemma3ForCausalLM): the Llama graph with

    embedding x sqrt(hidden)       (cast to the weights' dtype first, as transformers does)
    RMSNorm's weight as (1 + w)    (the checkpoint stores w; 1 + w is formed in fp32 at load)
    four norms a layer:            x -> input_norm -> attention -> post_attention_norm -> + x
                                     -> pre_feedforward_norm -> GeGLU -> post_feedforward_norm -> +
    GeGLU                          gelu_pytorch_tanh(gate) * up
    scores x query_pre_attn_scalar ** -0.5   (not head_dim's)
    sliding-window layers          ModelConfig.layer_types: a local layer's row sees its
                                   ``sliding_window`` newest keys (the attention kernels take
                                   the window, kernels/__init__.py); the global ones see all
    Gemma 2                        attention scores and final logits soft-capped, c tanh(x / c)
    Gemma 3                        q/k RMSNorm per head (as Qwen3's, with (1 + w)); local layers
                                   rotate with their own rope (rope_local_base_freq, default
                                   rope), global ones with the model's (linear-scaled on 4B+);
                                   final logits soft-capped if the config says so

In fp32 every formula is transformers' op for op (the fused norm's x * (1 / rms) * (1 + w)
is its x * rsqrt * (1 + w)), so greedy tokens equal ``generate()``'s. The KV cache gives
local layers their own block groups (scheduler/kv/hybrid.py): blocks a window no longer
reaches are freed as decoding moves on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import read_full
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma RMSNorm: x / rms(x) * (1 + w), all in fp32, cast back once. The
    parameter holds 1 + w (fp32 in any model dtype), so in fp32 the fused kernels run it as
    Llama's norm; in bf16 / fp16 the fp32 formula runs (transformers rounds once, at the end)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, torch.float32)
        self.out_dtype = params_dtype or torch.float32
        self.weight.weight_loader = self._load_one_plus

    def _load_one_plus(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        w = read_full(loaded)
        if tuple(w.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch loading a Gemma norm: parameter {tuple(param.shape)}, "
                             f"checkpoint {tuple(w.shape)}.")
        param.data.copy_(1.0 + w.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return out if residual is None else (out, x)


class GemmaMLP(LlamaMLP):
    """GeGLU: gelu (tanh approximation) of the gate times up, then down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            self.lora.apply("gate_up", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [gate_r ; up_r] per rank
        act = F.gelu(gate, approximate="tanh") * up
        if self.lora is None:
            return self.down_proj(act)
        return self.lora.row_parallel("down", self.down_proj, act)


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: str, layer_idx: int = 0) -> None:
        super().__init__(cfg, backend, layer_idx)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping


class Gemma3Attention(GemmaAttention):
    def __init__(self, cfg: ModelConfig, backend: str, layer_idx: int = 0) -> None:
        super().__init__(cfg, backend, layer_idx)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = qk.shape[0], self.head_dim
        q = self.q_norm(qk[:, : self.num_heads].reshape(-1, d)).view(n, -1, d)
        k = self.k_norm(qk[:, self.num_heads:].reshape(-1, d)).view(n, -1, d)
        return apply_rotary(torch.cat([q, k], dim=1), cos, sin)


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__(cfg, self_attn, mlp)
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, h, residual, cos, sin, kv_cache, md):
        # residual carries the stream; h is the previous layer's (post-feedforward-normed) output.
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, md))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__(cfg, attention_backend)
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        # transformers: torch.tensor(hidden ** 0.5) (fp32), cast to the embedding's dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(cfg.dtype), persistent=False)
        self.local_rotary_emb = None  # the sliding layers' own rope, where it differs (Gemma 3)
        if (cfg.local_rope_theta, cfg.local_rope_scaling) != (cfg.rope_theta, cfg.rope_scaling):
            self.local_rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                                    cfg.local_rope_scaling, cfg.dtype)
        self.local_layers = frozenset(i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i))

    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        return GemmaDecoderLayer(cfg, self.attention_cls(cfg, backend, layer_idx), GemmaMLP(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list | None, attn_metadata) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embed_scale
        cos, sin = self.rotary_emb(positions)  # once per step, shared by the layers of each rope
        local = (cos, sin) if self.local_rotary_emb is None else self.local_rotary_emb(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            c, s = local if i in self.local_layers else (cos, sin)
            h, residual = layer(h, residual, c, s, None if kv_caches is None else kv_caches[i],
                                self.layer_metadata(attn_metadata, i))
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention
