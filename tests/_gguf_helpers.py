"""Write small GGUF files with the ``gguf`` package's writer, as llama.cpp's converter would:
from one of worker/loading/random_models.py's random HF checkpoints (weights quantized, Llama q/k rows
permuted to ggml's rope layout, the byte-level BPE tokenizer as metadata), or a bare file of
another architecture for the refusal test. Used by tests only."""

from __future__ import annotations

import contextlib
import functools
import json
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


@contextlib.contextmanager
def parse_gguf_once():
    """transformers' own GGUF load, as it is, but with the file parsed once: it builds a
    ``gguf.GGUFReader`` for the config, another for the tokenizer and a third for the
    weights (each reads every vocab and merges string, seconds apiece on a 49k-token
    vocab), and ggml's tensor-name table once per tensor. Both are pure functions of their
    arguments, so memoizing them changes nothing transformers computes, only how often."""
    import gguf
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF half-split rope -> ggml pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(hf_dir: str, out: str, qtype: str = "Q8_0") -> str:
    """``hf_dir`` (a worker/loading/random_models.py checkpoint) as a GGUF at ``out``: 2-D weights in ``qtype``,
    norms and biases in F32, as llama.cpp's converter lays them out."""
    import gguf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, hf_dir)

    q = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        t = t.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, kv_heads)
        if t.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(_gguf_name(name), t)
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


def write_foreign_gguf(out: str, arch: str = "gpt2") -> str:
    """A small, valid GGUF of another architecture (one tensor), for the refusal test."""
    import gguf

    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
