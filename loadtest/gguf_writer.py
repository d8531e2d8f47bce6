"""Write GGUF files with the ``gguf`` package's writer, as llama.cpp's converter would: from
one of worker/loading/random_models.py's random HF checkpoints (weights quantized, Llama q/k rows
permuted to ggml's rope layout, the byte-level BPE tokenizer as metadata; Qwen3's q/k norms,
Qwen3-MoE's and Mixtral's experts stacked per layer and their router in F32, Phi-3's fused tensors and LongRoPE
factor tensors, Gemma's four norms a layer stored as 1 + w and its soft-caps and window, under llama.cpp's
names). The GPU check's gguf section writes its checkpoint with it (no hub there), and the
tests theirs (tests/_gguf_helpers.py). Not the engine's: worker/loading/gguf_loader.py reads GGUF."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors.numpy import load_file

from pagedserve.worker.loading.tokenizer_build import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS

# HF name pieces -> GGUF (the inverse of worker/loading/gguf_loader.py's tables, written out again
# on purpose: a shared table would let a wrong entry pass both sides).
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# What llama.cpp's converter names differently for the newer families (its TensorNameMap).
_ARCH_LAYER = {
    "llama": {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight"},  # Mixtral's router
    "qwen3": {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "qwen3moe": {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "mlp.gate.weight": "ffn_gate_inp.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma2": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}
_ARCH_LAYER["gemma3"] = {**_ARCH_LAYER["gemma2"], **_ARCH_LAYER["qwen3"]}
_ARCHS = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3",
          "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_EXPERT_PROJ = {  # the checkpoint's block and projection names -> llama.cpp's stacked tensor
    "qwen3moe": ("mlp", {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                         "down_proj": "ffn_down_exps.weight"}),
    "llama": ("block_sparse_moe", {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight",
                                   "w2": "ffn_down_exps.weight"}),
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_ARCH_LAYER.get(arch, {}).get(rest) or _LAYER[rest]}"


def _stack_experts(tensors: dict[str, np.ndarray], arch: str, num_layers: int,
                   num_experts: int) -> dict[str, np.ndarray]:
    """A MoE checkpoint's per-expert tensors (popped from ``tensors``) -> llama.cpp's
    [E, out, in] per layer and projection (convert_hf_to_gguf.py's Qwen2MoeModel and
    LlamaModel for Mixtral), keyed by GGUF name."""
    block, projs = _EXPERT_PROJ[arch]
    out = {}
    for layer in range(num_layers):
        for proj, gguf_name in projs.items():
            keys = [f"model.layers.{layer}.{block}.experts.{e}.{proj}.weight" for e in range(num_experts)]
            out[f"blk.{layer}.{gguf_name}"] = np.stack([tensors.pop(k) for k in keys])
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF half-split rope -> ggml pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(hf_dir: str, out: str, qtype: str = "Q8_0", types: dict[str, str] | None = None) -> str:
    """``hf_dir`` (a worker/loading/random_models.py checkpoint) as a GGUF at ``out``: 2-D weights in ``qtype``,
    norms and biases in F32, as llama.cpp's converter lays them out. ``types``: a GGUF name
    suffix (e.g. "attn_v.weight") -> the type of those tensors instead, as llama.cpp's mixed
    presets write them (Q4_K_M: attn_v and ffn_down in Q6_K)."""
    import gguf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = _ARCHS[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    if arch == "qwen3moe":
        assert not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1, "llama.cpp routes every layer"
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if not cfg.get("norm_topk_prob", False):
            w.add_expert_weights_norm(False)  # llama.cpp renormalises unless told
    if cfg.get("num_experts") or cfg.get("num_local_experts"):  # Qwen3-MoE, Mixtral
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3":  # convert_hf_to_gguf.py's Phi3MiniModel
        original = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if arch.startswith("gemma"):  # convert_hf_to_gguf.py's Gemma2Model / Gemma3Model
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rope
        if rope.get("rope_type", "default") != "default":
            w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
            w.add_rope_scaling_factor(rope["factor"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, hf_dir)

    tensors = {k: v.astype(np.float32) for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    stacked = _stack_experts(tensors, arch, cfg["num_hidden_layers"], num_experts) if num_experts else {}
    named = {**{_gguf_name(k, arch): (k, v) for k, v in tensors.items()}, **{k: (k, v) for k, v in stacked.items()}}
    for gname, (name, t) in named.items():
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            t = t + np.float32(1.0)  # the converter stores Gemma's norms as 1 + w
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, kv_heads)
        if t.ndim >= 2 and not gname.endswith("ffn_gate_inp.weight"):  # the router stays F32, as llama.cpp keeps it
            tname = next((v for k, v in (types or {}).items() if gname.endswith(k)), qtype)
            if tname in ("F32", "F16"):
                w.add_tensor(gname, t.astype(np.float16 if tname == "F16" else np.float32))
                continue
            q = getattr(gguf.GGMLQuantizationType, tname)
            w.add_tensor(gname, quantize(t, tname), raw_dtype=q)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, hf_dir: str) -> None:
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = dict(tok["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == max(vocab.values()) + 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3: CONTROL
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))["chat_template"])


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """[..., rows, K] fp32 -> the GGUF rows of ``qtype``: the gguf package's quantizer where it has
    one (Q8_0, Q4_0, Q4_1, ...), else :func:`quantize_k` (Q4_K, Q5_K, Q6_K)."""
    import gguf

    if w.ndim > 2:  # stacked experts: row by row all the same
        return quantize(w.reshape(-1, w.shape[-1]), qtype).reshape(*w.shape[:-1], -1)
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(w, qtype)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """[rows, K] fp32 (K a multiple of 256) -> Q4_K, Q5_K or Q6_K rows in ggml's block layout.
    A plain round-to-nearest quantizer (llama.cpp's searches its scales; the gguf package has
    none for these types): a test needs valid blocks of realistic values, which the kernel
    must then read exactly as the gguf package's ``dequantize`` does."""
    rows, k = w.shape
    x = w.reshape(-1, 256).astype(np.float32)  # one super-block a row
    n = x.shape[0]

    def f16(v):
        return v.astype(np.float16)

    if qtype == "Q6_K":
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 31.5  # q - 32 in [-32, 31]
        d = f16(scale.max(-1) / 127)
        df = d.astype(np.float32)[:, None]
        sc = np.where(df > 0, np.round(scale / np.where(df > 0, df, 1)), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[..., None]
        q = (np.where(step > 0, np.round(sub / np.where(step > 0, step, 1)), 0).clip(-32, 31) + 32).astype(np.uint8)
        q = q.reshape(n, 2, 4, 32)  # [half][quarter t][l]: weight 128 h + 32 t + l
        ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                             (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1).reshape(n, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=-1)
        return blocks.reshape(rows, -1)
    levels = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / levels, -lo
    d, dmin = f16(scale.max(-1) / 63), f16(mins.max(-1) / 63)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(scale / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    mn = np.where(dmf > 0, np.round(mins / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63).astype(np.uint8)
    step = (df * sc.astype(np.float32))[..., None]
    off = (dmf * mn.astype(np.float32))[..., None]
    q = np.where(step > 0, np.round((sub + off) / np.where(step > 0, step, 1)), 0).clip(0, levels).astype(np.uint8)
    packed = np.zeros((n, 12), dtype=np.uint8)  # ggml's 6-bit scales and mins (get_scale_min_k4, inverted)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    q = q.reshape(n, 4, 2, 32)  # [chunk i][nibble][l]: weight 64 i + 32 nibble + l
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed]
    if qtype == "Q5_K":
        bits = (q.reshape(n, 8, 32) >> 4) & 1  # [sub-block j][l]
        parts.append((bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(rows, -1)
