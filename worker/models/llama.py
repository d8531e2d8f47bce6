"""The Llama family (Llama 2/3, Mistral, Qwen2) over a paged KV cache, tensor-parallel ready;
the base the other families (worker/models/*.py) change in one place each.

Reads like gpt-fast: embedding -> N x (RMSNorm, attention, RMSNorm, SwiGLU MLP) -> RMSNorm.
One step's tokens come flattened, ``[num_tokens]``, for a mixed batch of prefill chunks
and decode rows described by ``AttentionMetadata``; the numerics follow transformers'
``LlamaForCausalLM`` so fp32 greedy decoding is token-identical to ``generate()``.

With LoRA on (worker/lora), each projection's output gains its rows' adapter deltas
through the layer's ``lora`` hook; off, the hooks are None. For the pooling runner
(embeddings, worker/pooler.py) the model has no LM head: ``forward``'s final normed hidden
states are what it pools, and a bare decoder's checkpoint (``embed_tokens.weight``,
``layers.N...``, as transformers' AutoModel saves it) loads under ``model.``.

Parameter names match the HF checkpoint except for the fused projections:

    qkv_proj      <- q_proj, k_proj, v_proj   (shard ids "q", "k", "v")
    gate_up_proj  <- gate_proj, up_proj       (shard ids 0, 1)

Where another family differs, a subclass overrides one hook: ``LlamaAttention.rotate_qk``
(Qwen3's q/k norm, SmolLM3's layers without rope), ``LlamaForCausalLM.make_layer`` (a
mixture-of-experts block in place of the MLP), ``map_checkpoint_name`` (its tensor names).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionMetadata, paged_attention, write_kv_cache
from pagedserve.kernels.cpu_fused import silu_and_mul
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.kv_rotation import kv_rotation
from pagedserve.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                  copy_checked, read_full)
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel_state import get_tp_size

# (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; a quantised
# cache adds (k_scale, v_scale), each [num_blocks, block_size, num_kv_heads]
# uint8 absmax codes (kernels/kv_quant.py).
KVCache = tuple[torch.Tensor, ...]


def _attention_no_cache(q, k, v, md: AttentionMetadata | None, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Causal attention inside each sequence's chunk only (profile runs, tests); ``window``
    and ``softcap`` as paged_attention takes them."""
    if md is None:
        bounds = [0, q.shape[0]]
    elif md.query_lens_cpu is not None:
        bounds = [0]
        for n in md.query_lens_cpu:
            bounds.append(bounds[-1] + n)
    else:
        bounds = md.cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, len, d]
            if window is None and softcap is None:
                out[start:end] = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
                continue
            pos = torch.arange(end - start, device=q.device)
            seen = pos[None, :] <= pos[:, None]
            if window is not None:
                seen &= pos[None, :] > pos[:, None] - window
            group = qs.shape[0] // ks.shape[0]
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
            scores = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
            out[start:end] = torch.matmul(probs, vs.float()).transpose(0, 1).to(out.dtype)
    return out


class LlamaAttention(nn.Module):
    # The LoRA hook (worker/lora/lora_ops.LayerLoRA), set when LoRA is enabled; None: off.
    lora = None
    # A soft-cap on the scores (Gemma 2, worker/models/gemma.py); None: off.
    softcap: float | None = None

    def __init__(self, cfg: ModelConfig, backend: str, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # A sliding-window layer's window (ModelConfig.layer_types: Gemma's local layers,
        # Mistral's and Qwen2's windows); None: it attends to every key.
        self.sliding_window = cfg.layer_window(layer_idx)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.backend = backend
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias,
                                          params_dtype=cfg.dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Qwen2 has q/k/v bias but none on o_proj; Llama's attention_bias covers both.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=o_bias, params_dtype=cfg.dtype)

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [n, heads + kv_heads, head_dim], a view of qkv -> q and k as attention reads them.
        q and k sit side by side in qkv: rotate them as one tensor (half the ops of two
        calls; per element the same arithmetic)."""
        return apply_rotary(qk, cos, sin)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache | None, md: AttentionMetadata | None) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv_proj(h)
        if self.lora is not None:
            self.lora.apply("qkv", h, qkv)
        qk = self.rotate_qk(qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if kv_cache is None:
            o = _attention_no_cache(q, k, v, md, self.scale, self.sliding_window, self.softcap)
        else:
            k_cache, v_cache, *scales = kv_cache
            k_scale, v_scale = scales or (None, None)
            rot = None
            if scales:  # a quantised cache: store rotated K and V (kv_rotation.py)
                rot = kv_rotation(self.head_dim, qk.dtype, qk.device)
                qk = qk @ rot
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
                v = v @ rot
            write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping, self.backend, k_scale, v_scale)
            o = paged_attention(q, k_cache, v_cache, md, self.scale, backend=self.backend, k_scale=k_scale,
                                v_scale=v_scale, sliding_window=self.sliding_window, softcap=self.softcap)
            if rot is not None:
                o = o @ rot.mT  # o was computed from rotated V: rotate back (R R^T = I)
        o = o.reshape(n, self.q_size)
        if self.lora is None:
            return self.o_proj(o)
        return self.lora.row_parallel("o", self.o_proj, o)  # the delta joins o_proj's partial sum at TP > 1


class LlamaMLP(nn.Module):
    lora = None  # as LlamaAttention's

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       params_dtype=cfg.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, params_dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [gate_r ; up_r] per rank
        gate_up = self.gate_up_proj(x)
        self.lora.apply("gate_up", x, gate_up)
        return self.lora.row_parallel("down", self.down_proj, silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp  # SwiGLU, or a mixture-of-experts block (worker/layers/fused_moe.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, h, residual, cos, sin, kv_cache, md):
        # residual carries the stream; h is the previous sublayer's output, added in the norm.
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Iterable[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params_mapping = (
        (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        cfg.verify_tensor_parallel(get_tp_size())
        self.config = cfg
        self.attention_backend = attention_backend
        self.model = LlamaModel(cfg, (self.make_layer(cfg, attention_backend, i)
                                      for i in range(cfg.num_hidden_layers)))
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling, cfg.dtype)
        # A hybrid KV cache (sliding-window and full layers, scheduler/kv/kv_groups.py): each
        # layer's group, whose block table and slots the step's metadata carries in
        # ``groups``; None: one table for every layer.
        groups = cfg.kv_cache_groups()
        self.layer_group = None if groups is None else [groups.layer_group(i) for i in range(cfg.num_hidden_layers)]
        # The pooling runner (embeddings) reads the final hidden states: no LM head at all.
        self.lm_head = None
        if cfg.runner != "pooling":
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, backend: str, layer_idx: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, LlamaAttention(cfg, backend, layer_idx), LlamaMLP(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache] | None, attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # once per step, shared by every layer
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, cos, sin, None if kv_caches is None else kv_caches[i],
                                self.layer_metadata(attn_metadata, i))
        h, _ = self.model.norm(h, residual)
        return h

    def layer_metadata(self, attn_metadata: AttentionMetadata | None, layer_idx: int) -> AttentionMetadata | None:
        """The metadata layer ``layer_idx`` reads: its KV cache group's on a hybrid cache."""
        groups = attn_metadata.groups if attn_metadata is not None and self.layer_group is not None else None
        return groups[self.layer_group[layer_idx]] if groups else attn_metadata

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] fp32, the full vocabulary on every rank."""
        if self.lm_head is None:
            raise RuntimeError("this model runs for embeddings (--runner pooling): it has no LM head.")
        return self.lm_head.compute_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy (HF name, tensor or safetensors slice) pairs into this rank's parameters.
        Returns the names of the parameters that were written."""
        params = dict(self.named_parameters())  # tied lm_head.weight is listed once, as embed
        loaded: set[str] = set()
        pooling = self.lm_head is None
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints store this buffer; we recompute it
            if name.startswith("lm_head.") and (pooling or self.config.tie_word_embeddings):
                continue  # no head to fill; some tied checkpoints still ship a copy of the embedding
            if pooling and not name.startswith("model."):
                name = "model." + name  # a bare decoder's checkpoint (AutoModel's names), as vLLM maps it
            target, shard_id = self.map_checkpoint_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}.")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                copy_checked(param.data, read_full(tensor), name)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        return loaded

    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        """A checkpoint tensor's name -> (our parameter's name, shard id or None)."""
        for hf_part, our_part, shard_id in self.stacked_params_mapping:
            if hf_part in name:
                return name.replace(hf_part, our_part), shard_id
        return name, None

    def expected_weight_keys(self) -> set[str]:
        """What ``load_weights`` must report for the model to be fully loaded."""
        keys: set[str] = set()
        for name, param in self.named_parameters():
            shard_ids = getattr(param, "shard_ids", None)  # a parameter filled in parts by its loader
            if shard_ids is not None:
                keys.update(f"{name}#{s}" for s in shard_ids)
            elif ".qkv_proj." in name:
                keys.update(f"{name}#{s}" for s in ("q", "k", "v"))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}#{s}" for s in (0, 1))
            else:
                keys.add(name)
        return keys


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
