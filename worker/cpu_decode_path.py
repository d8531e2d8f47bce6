"""CPUDecodePath: a decode step of a plain Llama on CPU as kernel calls bound once.

On a GPU a CUDA graph removes the host's work between kernels (cuda_graphs.py). On a CPU
the kernels are C++ calls on the same thread, and at batch 1 the Python between them is
most of a step that is not GEMM: per layer about twenty module calls, wrapper checks and
allocations around ten kernel calls (BENCHMARKS.md has what it costs and what binding
saves). This path binds, once, each layer's
weights, norms and extension entry points, and runs a decode-only step as the same kernel
calls in the same order on the same inputs, so its hidden states are bit-identical to the
module path's (tests/test_cpu_decode_path.py):

    per layer  add_rms_norm ─▶ qkv GEMM ─▶ rotary(q ‖ k) ─▶ write_kv ─▶ decode_attention
               ─▶ o GEMM ─▶ add_rms_norm ─▶ gate‖up GEMM ─▶ silu_and_mul ─▶ down GEMM
               (with LoRA on, each GEMM followed by the layer's hook: its adapters' deltas,
               worker/lora/lora_ops.py, called as the modules call it)

It is built where everything fits (``build`` says why not otherwise): Llama, Mistral or
Qwen2 exactly (no sliding-window layer), fp32 on CPU, tensor parallel size 1, the torch
attention backend with its C++ kernels loaded, an fp32 KV cache, each linear a single-part GGUF weight, a packed panel
weight, an AWQ / GPTQ / fp8 one (kernels/quant/) or a plain fp32 one. A step it cannot take (prefill, a mixed
batch, speculative rows, tensors of another shape) returns None and runs the modules.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_decode_attention, cpu_fused, cpu_gemm, cpu_gguf
from pagedserve.kernels.cpu_linear import PanelWeight
from pagedserve.kernels.quant import QUANT_WEIGHTS
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from pagedserve.worker.parallel_state import get_tp_size

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _bind_linear(layer):
    """``x -> x W^T + b`` for one linear layer as a direct extension call, or None."""
    packed, bias = getattr(layer, "_packed", None), layer.bias
    if bias is not None and bias.dtype != torch.float32:
        return None
    if type(packed) is cpu_gguf.GGUFWeight:
        ext, parts, n, int8 = cpu_gguf._EXT.get(), packed.parts, packed.n, packed.int8
        if ext is None:
            return None
        if len(parts) == 1:
            part = parts[0]
            return lambda x: ext.linear(x, part.packed, part.qid, n, bias, int8)
        # A fused projection whose pieces came in different types (llama.cpp's Q4_K_M: q and k
        # in Q4_K or Q5_0, v in Q6_K or Q8_0): one call a part, each into its columns of y.
        cols, start = [], 0
        for p in parts:
            cols.append((start, p, None if bias is None else bias[start:start + p.n]))
            start += p.n

        def multi(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty((x.shape[0], n), dtype=torch.float32)
            for s, p, b in cols:
                ext.gemm(y[:, s:s + p.n], x, p.packed, p.qid, b, int8)
            return y
        return multi
    if type(packed) is PanelWeight:
        panels, n = packed.panels, packed.n
        return lambda x: cpu_gemm.gemm(x, panels, n, bias)
    if type(packed) in QUANT_WEIGHTS:  # AWQ / GPTQ / fp8 (kernels/quant/), as cpu_linear calls them
        return lambda x: packed.linear(x, bias)
    if packed is None and layer.weight.dtype == torch.float32 and layer.weight.numel():
        weight = layer.weight
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    return None


class _Layer:
    __slots__ = ("w_in", "w_post", "qkv", "o", "gate_up", "down", "kv", "lora")

    def __init__(self, layer, kv) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.lora = attn.lora  # worker/lora's hook (the MLP's is the same object); None: LoRA off
        self.w_in, self.w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv, self.o = _bind_linear(attn.qkv_proj), _bind_linear(attn.o_proj)
        self.gate_up, self.down = _bind_linear(mlp.gate_up_proj), _bind_linear(mlp.down_proj)
        self.kv = kv


class CPUDecodePath:
    def __init__(self, model, layers: list[_Layer]) -> None:
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.model = model
        self.layers = layers
        self.eps = float(model.model.layers[0].input_layernorm.eps)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.qk_size = attn.q_size, attn.q_size + attn.kv_size
        self.scale = float(attn.scale)
        self.intermediate = cfg.intermediate_size
        self._fused = cpu_fused._EXT.get()
        self._attn = cpu_decode_attention._EXT.get()

    @classmethod
    def build(cls, model, kv_caches: list | None) -> tuple["CPUDecodePath | None", str | None]:
        """(the path, None), or (None, why it does not fit this model and cache)."""
        name = type(model).__name__
        if name not in SUPPORTED:
            return None, f"{name} is not {'/'.join(SUPPORTED)}"
        cfg = model.config
        if cfg.dtype != torch.float32 or next(model.parameters()).device.type != "cpu":
            return None, "not fp32 on CPU"
        if get_tp_size() != 1:
            return None, "tensor parallel"
        if getattr(model, "attention_backend", "torch") != "torch":
            return None, "not the torch attention backend"
        if cpu_fused._EXT.get() is None or cpu_decode_attention._EXT.get() is None:
            return None, "the C++ kernels are not built"
        if not kv_caches or len(kv_caches) != len(model.model.layers):
            return None, "no KV cache"
        layers = []
        for layer, kv in zip(model.model.layers, kv_caches):
            if layer.self_attn.lora is not layer.mlp.lora:
                return None, "LoRA hooks of another kind"
            if len(kv) != 2 or kv[0].dtype != torch.float32 or not kv[0].is_contiguous() or not kv[1].is_contiguous():
                return None, "a quantised KV cache"
            # Exactly Llama's layer, attention and MLP: a family that overrides one of them
            # (Qwen3's q/k norm, a mixture of experts) runs its modules.
            if (type(layer), type(layer.self_attn), type(layer.mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
                return None, "layers of another kind"
            if layer.self_attn.sliding_window is not None:  # its decode attention reads every key
                return None, "sliding-window layers"
            bound = _Layer(layer, kv)
            if None in (bound.qkv, bound.o, bound.gate_up, bound.down):
                return None, "a linear layer of another weight layout"
            layers.append(bound)
        return cls(model, layers), None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md) -> torch.Tensor | None:
        """The step's hidden states, or None when it is not a decode-only step this path
        takes (then the caller runs the modules)."""
        n = input_ids.shape[0]
        if (md is None or n == 0 or md.num_decode_tokens != n or md.max_seqlen_q != 1
                or md.block_table.shape[0] != n or md.seq_lens.shape[0] != n
                or md.block_table.dtype != torch.int32 or md.seq_lens.dtype != torch.int32
                or not md.block_table.is_contiguous() or not md.seq_lens.is_contiguous()
                or md.slot_mapping.dtype != torch.int64 or not md.slot_mapping.is_contiguous()):
            return None
        groups = md.decode_row_groups
        if groups is None:
            groups = cpu_decode_attention._NO_GROUPS
        elif groups.dtype != torch.int32 or not groups.is_contiguous():
            return None
        model, fused, attn = self.model, self._fused, self._attn
        eps, scale, hd, nh, q_size, qk_size = self.eps, self.scale, self.head_dim, self.num_heads, self.q_size, \
            self.qk_size
        bt, lens, slots = md.block_table, md.seq_lens, md.slot_mapping
        h = model.model.embed_tokens(input_ids)
        cos, sin = model.rotary_emb(positions)
        if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            return None
        hidden = h.shape[1]
        residual = None
        x = torch.empty((n, hidden), dtype=torch.float32)
        qk = torch.empty((n, qk_size // hd, hd), dtype=torch.float32)
        o = torch.empty((n, nh, hd), dtype=torch.float32)
        act = torch.empty((n, self.intermediate), dtype=torch.float32)
        for layer in self.layers:
            if residual is None:
                fused.rms_norm(x, h, layer.w_in, eps)
                residual = h
            else:
                fused.add_rms_norm(x, h, residual, layer.w_in, eps)  # h += residual: the stream
                residual = h
            lora = layer.lora
            qkv = layer.qkv(x)
            if lora is not None:
                lora.apply("qkv", x, qkv)
            fused.rotary(qk, qkv[:, :qk_size].view(n, -1, hd), cos, sin)
            k_cache, v_cache = layer.kv
            attn.write_kv(qk[:, nh:], qkv[:, qk_size:].view(n, -1, hd), k_cache, v_cache, slots)
            attn.decode_attention(qk[:, :nh], k_cache, v_cache, bt, lens, scale, o, groups, 0, 0.0)
            o_in = o.view(n, q_size)
            h = layer.o(o_in)
            if lora is not None:
                lora.apply("o", o_in, h)
            fused.add_rms_norm(x, h, residual, layer.w_post, eps)
            residual = h
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.apply("gate_up", x, gate_up)
            fused.silu_and_mul(act, gate_up)
            h = layer.down(act)
            if lora is not None:
                lora.apply("down", act, h)
        out, _ = model.model.norm(h, residual)
        return out
