"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package.

One file holds everything: metadata (shape, rope, tokenizer, chat template, special ids)
and the tensors, most of them quantized in blocks along each row. We turn it into what the
rest of the worker already knows:

    metadata  llama.block_count, llama.rope.freq_base, ...  ->  an HF-style config dict
    tensors   blk.N.attn_q.weight (Q4_1 blocks)             ->  (HF name, fp32 tensor),
                                                                fed to model.load_weights

so the TP weight loaders shard them like any safetensors tensor (each rank copies its rows
or columns into parameters of the engine dtype). The architectures llama.cpp's converter
writes for the families in worker/models (GGUF_ARCHITECTURES) are accepted; any other
``general.architecture`` is refused by name before anything is built. What differs by
architecture, as llama.cpp's convert_hf_to_gguf.py writes it:

    llama     q/k rows permuted to ggml's rope pairs (undone here); Mistral files say "llama";
              with llama.expert_count, Mixtral: a router blk.N.ffn_gate_inp and stacked experts
              as qwen3moe's below (w1 gate, w3 up, w2 down), top-k renormalised
    qwen2     qkv biases
    qwen3     blk.N.attn_q_norm / attn_k_norm (per-head RMSNorm weights), key_length = head_dim
    qwen3moe  + blk.N.ffn_gate_inp (the router) and the experts stacked in 3-D tensors
              ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps [E, H, I], handed on one
              expert at a time under the checkpoint's names; every layer routed (llama.cpp's
              graph has no dense layers), top-k renormalised unless expert_weights_norm says
              not (llama.cpp always renormalises Qwen3-MoE; transformers reads its files so)
    phi3      fused attn_qkv [q ; k ; v] and ffn_up [gate ; up] (worker/models/phi3.py splits
              them), LongRoPE as rope_factors_long / rope_factors_short tensors plus
              rope.scaling.original_context_length and attn_factor: read into the config
    gemma2    four norms a layer (attn_norm, post_attention_norm, ffn_norm = the pre-feedforward
    gemma3    one, post_ffw_norm), every norm weight stored as 1 + w (the converter adds Gemma's
              1; subtracted here), tied embeddings, attn_logit_softcapping (gemma2) and
              final_logit_softcapping, attention.sliding_window; the layer pattern, the query
              scale and Gemma 3's local rope base are llama.cpp's constants, not metadata:
              gemma2 alternates from a sliding layer 0, gemma3 slides 5 layers of 6, scores
              scale by key_length ** -0.5 (hidden / heads on the 27B models: 46 / 62 layers),
              local layers rope at base 10,000; gemma3 adds attn_q_norm / attn_k_norm

With ``--quantization gguf`` (the default for a .gguf on CPU) the 2-D weights stay in their
blocks instead: ``iter_gguf_native`` hands the loaders QuantTensors (worker/layers/
quantized.py), views of the file's rows, and kernels/cpu_gguf.py multiplies them. Its types
are NATIVE_GGUF_TYPES; F16 and BF16 weights (rare: a file's unquantized leftovers) are
dequantized to fp32 at load, and any other type refuses to start (``check_native_types``).

GGUF stores shapes innermost-first (``[in, out]``); the reader's ``data`` is already
row-major ``[out, in]`` (in blocks), and ``gguf.quants.dequantize`` returns ``[out, in]``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import numpy as np
import torch

from pagedserve.scheduler.kv.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION

# GGUF general.architecture -> the config.json architecture we implement (worker/models).
# Mistral files say "llama" (same graph; llama.cpp has no separate arch for it).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}  # config.json's model_type where it differs from the GGUF name

# Per-layer GGUF tensor names -> HF names (llama.cpp's gguf-py TensorNameMap, reversed).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# What the newer families add, or name differently, per architecture.
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GEMMA_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_ARCH_LAYER_TENSORS = {
    "llama": {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},  # Mixtral's router
    "qwen3": _QK_NORM,
    "qwen3moe": {**_QK_NORM, "ffn_gate_inp.weight": "mlp.gate.weight"},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": {**_GEMMA_NORMS, **_QK_NORM},
}
# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w in every *norm.weight.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Gemma 3 local layers rope at this base whatever the global layers' is.
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Stacked experts [E, out, in] -> one tensor per expert under the checkpoint's names:
# (the block's name, GGUF tensor -> the projection's).
_EXPERT_TENSORS = {
    "llama": ("block_sparse_moe", {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3",
                                   "ffn_down_exps.weight": "w2"}),
    "qwen3moe": ("mlp", {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                         "ffn_down_exps.weight": "down_proj"}),
}
# Tensors that are configuration, not weights (read by gguf_hf_config).
_CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_MAGIC = b"GGUF"
# What --quantization gguf runs: the kernel's block types, and the float types it reads as
# they are (F32: norms, biases) or dequantizes at load (F16, BF16).
NATIVE_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
PLAIN_GGUF_TYPES = ("F32", "F16", "BF16")


def is_gguf_file(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) and os.fspath(path).endswith(".gguf")


def find_gguf_file(path: str | os.PathLike) -> str | None:
    """``path`` itself if it is a .gguf file; the one .gguf in a directory that has no
    config.json; else None (an HF directory, or nothing GGUF about it)."""
    path = os.fspath(path)
    if is_gguf_file(path):
        return os.path.abspath(path)
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path!r} holds {len(found)} GGUF files ({', '.join(found)}); "
                         "name the one to load: --model DIR/FILE.gguf.")
    return os.path.abspath(os.path.join(path, found[0])) if found else None


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped), with errors that say what is wrong
    with the file instead of the reader's numpy reshape messages."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file: it does not start with the GGUF magic bytes.")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # a short file fails as "cannot reshape array of size ..."
        raise ValueError(f"cannot read GGUF file {path!r}: it is truncated or corrupt "
                         f"({size:,} bytes on disk; the gguf reader said: {e}).") from None
    return reader


def _scalar(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, path: str) -> str:
    arch = _scalar(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} is a {arch!r} model; pagedserve runs the Llama family "
                         f"and the architectures of worker/models (GGUF architectures: "
                         f"{', '.join(GGUF_ARCHITECTURES)}).")
    return arch


def gguf_hf_config(reader, path: str) -> dict[str, Any]:
    """The config.json this file implies, in transformers' vocabulary (what
    ``ModelConfig.from_dict`` reads; it refuses what we cannot run exactly)."""
    arch = gguf_architecture(reader, path)
    p = arch + "."

    def need(key: str) -> Any:
        value = _scalar(reader, p + key)
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks metadata key {p + key!r}.")
        if isinstance(value, list):  # per-layer values (hybrid models): not the Llama family
            raise ValueError(f"GGUF file {path!r}: per-layer {p + key!r} is not supported.")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_scalar(reader, p + "attention.key_length") or hidden // num_heads)
    rope_dim = int(_scalar(reader, p + "rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"GGUF file {path!r}: rotary dimension {rope_dim} != head_dim {head_dim} "
                         "(partial rotary embeddings) is not supported.")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # Llama 3.1+ files bake rope scaling into per-dimension factors instead of metadata;
        # ignoring them would change every position's rotation.
        raise ValueError(f"GGUF file {path!r} carries per-dimension rope frequency factors "
                         "(rope_freqs.weight, Llama 3.1-style rope scaling), which are not supported.")
    mixtral = arch == "llama" and bool(_scalar(reader, p + "expert_count"))
    hf: dict[str, Any] = dict(
        architectures=["MixtralForCausalLM" if mixtral else GGUF_ARCHITECTURES[arch]],
        model_type="mixtral" if mixtral else _MODEL_TYPES.get(arch, arch), gguf_architecture=arch,
        # A Qwen3-MoE file may state only its experts' width: then that is the dense width too.
        hidden_size=hidden, intermediate_size=int(_scalar(reader, p + "feed_forward_length")
                                                  or _scalar(reader, p + "expert_feed_forward_length")
                                                  or need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=num_heads,
        num_key_value_heads=int(_scalar(reader, p + "attention.head_count_kv") or num_heads),
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_scalar(reader, p + "rope.freq_base") or 10000.0),
        max_position_embeddings=int(_scalar(reader, p + "context_length") or 2048),
        tie_word_embeddings="output.weight" not in names, hidden_act="silu",
        # Weights are dequantized to fp32 (exact for every block format); --dtype casts.
        dtype="float32",
    )
    if "blk.0.attn_q.bias" in names:
        hf["attention_bias"] = True
    scaling = _scalar(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": _scalar(reader, p + "rope.scaling.factor")}
    if arch == "qwen3moe":
        hf.update(_moe_config(reader, path, p))
    if mixtral:  # the experts are intermediate_size wide; top-k always renormalised
        hf.update(num_local_experts=int(_scalar(reader, p + "expert_count")),
                  num_experts_per_tok=int(need("expert_used_count")))
    if arch == "phi3":
        hf.update(_phi3_rope(reader, path, p, hf))
    if arch in _NORM_PLUS_ONE:
        hf.update(_gemma_config(reader, p, hf))
    window = _scalar(reader, p + "attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _scalar(reader, p + "vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF file {path!r} states no vocabulary size (no {p}vocab_size, no tokens).")
    hf["vocab_size"] = int(vocab)
    bos = _scalar(reader, "tokenizer.ggml.bos_token_id")
    # eot/eom end a chat turn in Llama 3 files; a turn end is a stop like eos.
    eos_ids = [int(v) for v in (_scalar(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
               if v is not None]
    hf.update(bos_token_id=None if bos is None else int(bos),
              eos_token_id=list(dict.fromkeys(eos_ids)) or None,
              pad_token_id=_scalar(reader, "tokenizer.ggml.padding_token_id"))
    return hf


def _moe_config(reader, path: str, p: str) -> dict[str, Any]:
    """Qwen3-MoE's expert fields: every layer routed (as llama.cpp's graph runs it)."""
    experts, used = _scalar(reader, p + "expert_count"), _scalar(reader, p + "expert_used_count")
    if not experts or not used:
        raise ValueError(f"GGUF file {path!r} lacks metadata key {p}expert_count or {p}expert_used_count.")
    if _scalar(reader, p + "expert_shared_feed_forward_length"):
        raise ValueError(f"GGUF file {path!r}: shared experts are not supported.")
    inter = _scalar(reader, p + "expert_feed_forward_length")
    if not inter:
        raise ValueError(f"GGUF file {path!r} lacks metadata key {p + 'expert_feed_forward_length'!r}.")
    norm = _scalar(reader, p + "expert_weights_norm")
    return dict(num_experts=int(experts), num_experts_per_tok=int(used), moe_intermediate_size=int(inter),
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True if norm is None else bool(norm))


def _gemma_config(reader, p: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's fields as llama.cpp runs them (see the module doc); ModelConfig reads
    the layer pattern from its defaults (no layer_types: Gemma 2 alternates, Gemma 3 slides
    5 of 6) and the two ropes from rope_theta / rope_local_base_freq."""
    layers, big = hf["num_hidden_layers"], {"gemma2": 46, "gemma3": 62}[p[:-1]]
    out: dict[str, Any] = dict(
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hf["hidden_size"] // hf["num_attention_heads"] if layers == big else hf["head_dim"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _scalar(reader, p + key)
        out[key] = float(value) if value else None
    if p == "gemma3.":
        out.update(rope_local_base_freq=_GEMMA3_LOCAL_ROPE_BASE, sliding_window_pattern=6)
    pattern = _scalar(reader, p + "attention.sliding_window_pattern")  # where a file states it
    if isinstance(pattern, list):  # per layer, true where it slides
        out["layer_types"] = [SLIDING_ATTENTION if s else FULL_ATTENTION for s in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    return out


def _phi3_rope(reader, path: str, p: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE from its factor tensors and metadata (absent: plain rope)."""
    original = _scalar(reader, p + "rope.scaling.original_context_length")
    out: dict[str, Any] = {"original_max_position_embeddings": int(original or hf["max_position_embeddings"])}
    tensors = {t.name: t for t in reader.tensors if t.name in _CONFIG_TENSORS["phi3"]}
    if not tensors:
        return out
    if len(tensors) != 2:
        raise ValueError(f"GGUF file {path!r} has {', '.join(tensors)} without its pair (rope_factors_long "
                         "and rope_factors_short go together).")
    from gguf.quants import dequantize

    long, short = ([float(v) for v in np.asarray(dequantize(tensors[f"rope_factors_{k}.weight"].data,
                                                           tensors[f"rope_factors_{k}.weight"].tensor_type),
                                                dtype=np.float32).reshape(-1)] for k in ("long", "short"))
    rope = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
            "original_max_position_embeddings": out["original_max_position_embeddings"]}
    attn = _scalar(reader, p + "rope.scaling.attn_factor")
    if attn is not None:
        # The converter writes sqrt(1 + ln(s) / ln(original)) in fp32; transformers computes the
        # same from the config, so the value is kept only where it is another one.
        scale = hf["max_position_embeddings"] / out["original_max_position_embeddings"]
        default = math.sqrt(1 + math.log(scale) / math.log(out["original_max_position_embeddings"])) \
            if scale > 1.0 else 1.0
        if abs(float(attn) - default) > 1e-6:
            rope["attention_factor"] = float(attn)
    out["rope_scaling"] = rope
    return out


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The checkpoint name of a GGUF tensor of a file of ``arch``; None if it has none (a
    stacked expert tensor: see ``_expert_tensors``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    blk, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if blk == "blk" and layer.isdigit():
        table = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
        if suffix in table:
            return f"model.layers.{layer}.{table[suffix]}"
    return None


def _expert_tensors(gguf_name: str, arch: str) -> tuple[str, str] | None:
    """(layer prefix, projection) of a stacked expert tensor of a MoE file, else None."""
    blk, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    block, projs = _EXPERT_TENSORS.get(arch, ("", {}))
    if blk == "blk" and layer.isdigit() and suffix in projs:
        return f"model.layers.{layer}.{block}.experts", projs[suffix]
    return None


def _names(gguf_name: str, arch: str, w, path: str, architecture: str) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) for one GGUF tensor: itself, or one per expert of a stacked
    expert tensor (``w`` [E, out, in]); nothing for a configuration tensor."""
    if gguf_name in _CONFIG_TENSORS.get(arch, ()):
        return
    if arch in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # exact in fp32 where 1 + w >= 0.5: the model forms the file's 1 + w again
    expert = _expert_tensors(gguf_name, arch)
    if expert is not None:
        prefix, proj = expert
        for e in range(w.shape[0]):
            yield f"{prefix}.{e}.{proj}.weight", w[e]
        return
    name = hf_tensor_name(gguf_name, arch)
    if name is None:
        raise ValueError(f"GGUF file {path!r} has tensor {gguf_name!r}, which a {architecture} does not have.")
    yield name, w


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Llama q/k rows. HF rotates the two halves
    of each head (rotate_half: x_i pairs with x_{i+d/2}); ggml rotates adjacent pairs, so the
    converter interleaves each head's halves: rows [a0..a31 b0..b31] -> [a0 b0 a1 b1 ...]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file, dequantized one at a time so at
    most one full fp32 tensor is alive beside the model."""
    from gguf.quants import dequantize

    reader = reader if reader is not None else open_gguf(path)
    hf = gguf_hf_config(reader, path)
    arch = gguf_architecture(reader, path)
    permute = {".self_attn.q_proj.": hf["num_attention_heads"],
               ".self_attn.k_proj.": hf["num_key_value_heads"]} if arch == "llama" else {}
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS.get(arch, ()):
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        for name, part_w in _names(t.name, arch, w, path, hf["architectures"][0]):
            for part, heads in permute.items():
                if part in name:
                    part_w = _unpermute_rope_rows(part_w, heads)
            if not (part_w.flags.writeable and part_w.flags.c_contiguous):  # F32: views of the read-only map
                part_w = np.array(part_w, order="C")
            yield name, torch.from_numpy(part_w)


def check_native_types(index, path: str) -> None:
    """ValueError naming each GGML type of ``index`` (a gguf_index.GGUFIndex) that
    ``--quantization gguf`` cannot run, a tensor of it, and the supported list."""
    bad: dict[str, str] = {}
    for t in index.tensors.values():
        if t.qtype not in NATIVE_GGUF_TYPES + PLAIN_GGUF_TYPES:
            bad.setdefault(t.qtype, t.name)
    if bad:
        shown = ", ".join(f"{q} (e.g. {name})" for q, name in bad.items())
        raise ValueError(f"GGUF file {path!r} holds tensors of type {shown}, which --quantization gguf does "
                         f"not run; supported: {', '.join(NATIVE_GGUF_TYPES + PLAIN_GGUF_TYPES)}. "
                         "--quantization none dequantizes every tensor to fp32 at load instead.")


def iter_gguf_native(path: str, hf: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(HF name, QuantTensor or fp32 tensor) for every tensor of the file: the block types as
    QuantTensors over the file's rows (memory-mapped; each layer copies its rows when it packs
    them), F32 as tensors, F16 / BF16 dequantized to fp32. ``hf``: the model's config dict
    (head counts for the q/k row permutation)."""
    from pagedserve.worker.layers.quantized import QuantTensor
    from pagedserve.worker.loading.gguf_index import read_gguf_index

    index = read_gguf_index(path)
    check_native_types(index, path)
    # A prepared directory written before gguf_architecture was recorded: from the architecture.
    arch = hf.get("gguf_architecture") or next(
        (a for a, c in GGUF_ARCHITECTURES.items() if [c] == hf.get("architectures")), "llama")
    permute = {".self_attn.q_proj.": hf["num_attention_heads"],
               ".self_attn.k_proj.": hf["num_key_value_heads"]} if arch == "llama" else {}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in index.tensors.values():
        if t.name in _CONFIG_TENSORS.get(arch, ()):
            continue
        raw = data[t.offset:t.offset + t.nbytes]
        # The blocks stay blocks for a 2-D weight of a linear layer; a router (its logits pick
        # the experts, in fp32 as transformers computes them) and stacked experts (the MoE
        # kernels take plain weights) are dequantized, as --quantization none loads them.
        native = t.qtype in NATIVE_GGUF_TYPES and len(t.shape) == 2 and not t.name.endswith("ffn_gate_inp.weight")
        if native:
            w = raw.reshape(t.shape[0], -1)
        elif t.qtype == "F32":
            w = raw.view(np.float32).reshape(t.shape)
        else:  # F16 / BF16, a 1-D or 3-D block tensor, a router: fp32
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
            w = np.asarray(dequantize(raw.reshape(rows, -1), GGMLQuantizationType[t.qtype]),
                           dtype=np.float32).reshape(t.shape)
        for name, part_w in _names(t.name, arch, w, path, hf["architectures"][0]):
            for part, heads in permute.items():
                if part in name:
                    part_w = _unpermute_rope_rows(part_w, heads)  # whole rows: blocks move with their row
            if native:
                yield name, QuantTensor(t.qtype, t.shape, part_w)
            else:
                yield name, torch.from_numpy(np.array(part_w, dtype=np.float32, order="C"))
