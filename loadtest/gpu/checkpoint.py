"""A large random checkpoint written fast: the 8B-shaped Llama of the b1_8b section, drawn
on the device and written with safetensors in shards (the ~0.85B model of the other
sections is worker/loading/random_models.py's make_random_llama, drawn by HF on the CPU)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def write_random_llama_fast(path: str, cfg: dict, dev: torch.device) -> int:
    """An HF Llama checkpoint of random bf16 weights drawn on ``dev``, written with safetensors
    in shards (a thread writes one while the next is drawn), with config.json and a tokenizer.
    Weights ~N(0, 0.02), norms 1: finite activations through every layer, which is all a
    timing run needs (its tokens are not compared). Returns the bytes written."""
    from safetensors.torch import save_file

    from pagedserve.worker.loading.tokenizer_build import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

    os.makedirs(path, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layers, heads, kvh = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", torch_dtype="bfloat16",
                  tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_tokenizer(path, v, model_max_length=cfg["max_position_embeddings"])

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        return {p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kvh * hd, h),
                p + "self_attn.v_proj.weight": (kvh * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}

    shards = [{"model.embed_tokens.weight": (v, h)}]
    for first in range(0, layers, 4):
        shards.append({k: s for i in range(first, min(first + 4, layers)) for k, s in layer(i).items()})
    shards.append({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    gen = torch.Generator(device=dev).manual_seed(0)
    weight_map, total, pending = {}, 0, []
    with ThreadPoolExecutor(2) as pool:
        for i, shapes in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for key, shape in shapes.items():
                if len(shape) == 1:
                    t = torch.ones(shape, dtype=torch.bfloat16, device=dev)
                else:
                    t = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=dev).mul_(0.02)
                tensors[key] = t.cpu()
                weight_map[key] = name
                total += t.numel() * 2
            pending.append(pool.submit(save_file, tensors, os.path.join(path, name), {"format": "pt"}))
            del tensors
            if len(pending) > 2:  # at most ~3 shards in host memory at once
                pending.pop(0).result()
        for p in pending:
            p.result()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total

