"""KV cache sizing: how much cache one token and one sequence take, and how many
sequences fit on a set of GPUs once the weights are loaded.

Only ``config.json`` is read (a directory holding nothing else is enough), so the
calculator runs on a laptop for a 70B model. Units are the ones people quote:
KiB per token, GiB per sequence (binary units, 1 GiB = 2**30 bytes).

    bytes/token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype bytes
                + 2 (K and V) x num_layers x num_kv_heads x 1     (quantised caches: one 1-byte
                                                                   scale per token and KV head)

With tensor parallelism each GPU holds ``ceil(num_kv_heads / tp)`` KV heads (KV heads
are replicated, not split, when there are fewer of them than GPUs) and ``1/tp`` of the
weights. A quantized checkpoint (config.json's quantization_config, or ModelOpt's
hf_quant_config.json) counts its linear layers at their packed size (AWQ / GPTQ int4 with
their group scales and zeros, fp8 with row scales: worker/loading/quant_config.py), the
embeddings, LM head and norms at the weight dtype, so the KV budget grows by what the
weights no longer take. A model with sliding-window layers (Gemma 2 / 3, Mistral's window,
Qwen2's use_sliding_window: worker/loading/sliding_window.py) runs on the hybrid KV cache
(scheduler/kv/kv_groups.py):
its local layers keep only the blocks their window reaches, so a sequence costs

    bytes/seq = 2 x kv_heads x head_dim x dtype bytes x 16 x group_size
                x (blocks of the full groups + blocks of the sliding groups, each at most
                   ceil((window - 1 + 1) / 16) + 1 per request)

which the report gives beside what every layer keeping every token would cost. Pure stdlib:
no torch, no ray, so ``pagedserve kv-size`` starts instantly. The
quantised formats and their scale layout are scheduler/kv/kv_cache_dtype.py's, the same the
workers size their pool with.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.platforms import auto_dtype
from pagedserve.worker.loading.quant_config import (HFQuantConfig, linear_weight_bytes, parse_quant_config,
                                                    read_quantization_config)
from pagedserve.scheduler.kv.kv_cache_dtype import KV_SCALE_BYTES, QUANTIZED_FORMATS, canonical_kv_cache_dtype
from pagedserve.scheduler.kv.kv_groups import SLIDING_ATTENTION, kv_cache_groups
from pagedserve.worker.loading.sliding_window import runs_sliding_window, sliding_window_layers

GiB = 1 << 30
KiB = 1 << 10

DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "fp16": 2, "float16": 2, "half": 2,
               "bf16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


@dataclass(slots=True)
class KVSizeReport:
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    weight_dtype: str
    kv_cache_dtype: str
    kv_bytes_per_token: int  # whole model, all ranks together, scales included
    kv_scale_bytes_per_token: int  # the scales' part of it (0 unless quantised)
    kv_bytes_per_seq: int  # at max_model_len
    max_model_len: int
    num_gpus: int
    tensor_parallel_size: int
    gpu_memory_gib: float
    gpu_memory_utilization: float
    weight_bytes: int  # whole model (quantized linear layers at their packed size)
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int  # after weights, at the utilisation cap (0 if weights don't fit)
    num_replicas: int  # num_gpus // tensor_parallel_size engine copies
    max_num_seqs_per_replica: int
    max_num_seqs: int  # across every replica
    quantization: str = "none"  # the checkpoint's quantization_config, described
    # Sliding-window layers (the hybrid KV cache): their window and count, and what a
    # sequence would cost if every layer kept every token (kv_bytes_per_seq is the hybrid's).
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    kv_bytes_per_seq_all_layers: int = 0

    @property
    def kib_per_token(self) -> float:
        return self.kv_bytes_per_token / KiB

    @property
    def gib_per_seq(self) -> float:
        return self.kv_bytes_per_seq / GiB


BLOCK_SIZE = 16  # the engine's default --block-size: the hybrid cache frees whole blocks


def layer_types(cfg: dict) -> list[str] | None:
    """Each layer's attention type where some layers slide, as the engine reads them
    (worker/loading/sliding_window.py: Gemma's layer_types or patterns, Mistral's window on
    every layer, Qwen2's from max_window_layers on, ...), or None."""
    arch = (cfg.get("architectures") or [""])[0]
    if not runs_sliding_window(arch):
        return None
    types, window = sliding_window_layers(cfg, arch)
    return list(types) if window else None


def load_hf_config(model: str | Path) -> dict:
    """``model`` is a directory holding ``config.json`` or the path of a JSON file."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path} (give a model directory or a config file)")
    cfg = json.loads(path.read_text())
    qc = read_quantization_config(cfg, str(path.parent))  # ModelOpt's may sit in hf_quant_config.json
    if qc is not None:
        cfg["quantization_config"] = qc
    # Multimodal wrappers keep the language model's shape under text_config.
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _dims(cfg: dict) -> tuple[int, int, int, int, int]:
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return hidden, layers, heads, kv_heads, head_dim


def count_params(cfg: dict) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Mixtral-style MoE),
    computed from the config: embeddings, attention, gated MLP, RMSNorms, LM head."""
    hidden, layers, heads, kv_heads, head_dim = _dims(cfg)
    vocab = int(cfg["vocab_size"])
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if cfg.get("attention_bias") or cfg.get("model_type") in ("qwen2",):
        attn += q + 2 * kv  # q/k/v biases (Qwen2 always has them)
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if num_experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        mlp = num_experts * 3 * hidden * moe_inter + hidden * num_experts  # experts + router
    else:
        mlp = 3 * hidden * inter  # gate, up, down
    per_layer = attn + mlp + 2 * hidden  # input and post-attention RMSNorm
    embed = vocab * hidden
    tied_default = str(cfg.get("model_type", "")).startswith("gemma")  # Gemma's configs tie by default
    lm_head = 0 if cfg.get("tie_word_embeddings", tied_default) else vocab * hidden
    return embed + layers * per_layer + hidden + lm_head


def _linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of one decoder layer (what AWQ / GPTQ / fp8 quantize)."""
    hidden, _, heads, kv_heads, head_dim = _dims(cfg)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or inter)
    mlp = [(moe_inter, hidden), (moe_inter, hidden), (hidden, moe_inter)] * num_experts if num_experts \
        else [(inter, hidden), (inter, hidden), (hidden, inter)]
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), *mlp]


def weight_bytes(cfg: dict, w_elt: int, qcfg: HFQuantConfig | None) -> int:
    """The whole model's weight bytes: every parameter at ``w_elt`` bytes, except the linear
    layers of a quantized checkpoint, at their packed size."""
    total = count_params(cfg) * w_elt
    if qcfg is not None:
        layers = int(cfg["num_hidden_layers"])
        for n, k in _linear_shapes(cfg):
            total += layers * (linear_weight_bytes(qcfg, n, k, w_elt) - n * k * w_elt)
    return total


def _config_dtype(cfg: dict) -> str:
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return name if name in DTYPE_BYTES else "bfloat16"


def _canon(dtype: str) -> str:
    return {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
            "bfloat16": "bf16"}.get(dtype, dtype)


def kv_size(cfg: dict, *, max_model_len: int, gpu_memory_gib: float = 80.0, num_gpus: int = 1,
            tensor_parallel_size: int | None = None, dtype: str = "auto",
            kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.9) -> KVSizeReport:
    _, layers, heads, kv_heads, head_dim = _dims(cfg)
    tp = tensor_parallel_size or num_gpus
    if tp < 1 or num_gpus < 1 or num_gpus % tp:
        raise ValueError(f"num_gpus ({num_gpus}) must be a positive multiple of tensor_parallel_size ({tp})")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    # GPUs: "auto" is what the engine runs there (a float32 checkpoint in bfloat16).
    weight_dtype = _canon(auto_dtype(_config_dtype(cfg), "cuda") if dtype == "auto" else dtype)
    kv_dtype = weight_dtype if kv_cache_dtype == "auto" else _canon(kv_cache_dtype)
    if kv_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        kv_dtype = canonical_kv_cache_dtype(kv_dtype)
    for name in (weight_dtype, kv_dtype):
        if name not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16, fp8, fp8_e4m3, fp8_e5m2, int8")
    kv_elt, w_elt = DTYPE_BYTES[kv_dtype], DTYPE_BYTES[weight_dtype]
    row_scale = KV_SCALE_BYTES if kv_dtype in QUANTIZED_FORMATS else 0  # per (token, KV head)

    per_token = 2 * layers * kv_heads * (head_dim * kv_elt + row_scale)
    scale_per_token = 2 * layers * kv_heads * row_scale
    kv_heads_per_gpu = math.ceil(kv_heads / tp)  # replicated when kv_heads < tp
    per_token_per_gpu = 2 * layers * kv_heads_per_gpu * (head_dim * kv_elt + row_scale)
    per_seq, per_seq_per_gpu = per_token * max_model_len, per_token_per_gpu * max_model_len
    types = layer_types(cfg)
    groups = kv_cache_groups(types, int(cfg["sliding_window"]), max_model_len=max_model_len) if types else None
    if groups is not None:  # a block per group of group_size layers, sliding groups capped at their window
        blocks = groups.blocks_per_request(max_model_len, BLOCK_SIZE)
        per_seq = blocks * BLOCK_SIZE * groups.group_size * per_token // layers
        per_seq_per_gpu = blocks * BLOCK_SIZE * groups.group_size * per_token_per_gpu // layers
    num_params = count_params(cfg)
    qcfg = parse_quant_config(cfg.get("quantization_config"))
    weights = weight_bytes(cfg, w_elt, qcfg)
    weight_per_gpu = math.ceil(weights / tp)
    usable = int(gpu_memory_gib * GiB * gpu_memory_utilization)
    budget = max(0, usable - weight_per_gpu)
    seqs_per_replica = budget // per_seq_per_gpu
    replicas = num_gpus // tp
    return KVSizeReport(
        model_type=str(cfg.get("model_type", "unknown")), num_layers=layers,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        num_params=num_params, weight_dtype=weight_dtype, kv_cache_dtype=kv_dtype,
        kv_bytes_per_token=per_token, kv_scale_bytes_per_token=scale_per_token, kv_bytes_per_seq=per_seq,
        max_model_len=max_model_len, num_gpus=num_gpus, tensor_parallel_size=tp,
        gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weights, weight_bytes_per_gpu=weight_per_gpu,
        kv_budget_bytes_per_gpu=budget, num_replicas=replicas,
        max_num_seqs_per_replica=seqs_per_replica, max_num_seqs=seqs_per_replica * replicas,
        quantization=qcfg.describe() if qcfg else "none",
        sliding_window=int(cfg["sliding_window"]) if groups else None,
        num_sliding_layers=types.count(SLIDING_ATTENTION) if groups else 0,
        kv_bytes_per_seq_all_layers=per_token * max_model_len)


def _num(x: float) -> str:
    """320.0 -> '320', 1.25 -> '1.25', 0.625 -> '0.625' (no trailing zeros, at most 3 decimals)."""
    return f"{x:,.3f}".rstrip("0").rstrip(".")


def format_report(r: KVSizeReport) -> str:
    lines = [
        f"model: {r.model_type}, {r.num_layers} layers, {r.num_attention_heads} heads, "
        f"{r.num_kv_heads} KV heads, head_dim {r.head_dim}, {r.num_params / 1e9:,.2f} B parameters",
        f"dtypes: weights {r.weight_dtype}, KV cache {r.kv_cache_dtype}",
        f"KV cache per token: {r.kv_bytes_per_token:,} bytes = {_num(r.kib_per_token)} KiB per token"
        + (f" ({_num((r.kv_bytes_per_token - r.kv_scale_bytes_per_token) / KiB)} KiB of {r.kv_cache_dtype} values"
           f" + {_num(r.kv_scale_bytes_per_token / KiB)} KiB of 1-byte scales, one per token and KV head)"
           if r.kv_scale_bytes_per_token else ""),
        f"KV cache per sequence: {_num(r.gib_per_seq)} GiB per {r.max_model_len:,}-token sequence"
        + (f" ({r.num_sliding_layers} of {r.num_layers} layers slide over {r.sliding_window:,} tokens and keep only "
           f"the blocks it reaches: {_num(r.kv_bytes_per_seq_all_layers / GiB)} GiB if every layer kept every token, "
           f"{_num(100 * (1 - r.kv_bytes_per_seq / r.kv_bytes_per_seq_all_layers))}% saved)"
           if r.sliding_window else ""),
        f"GPUs: {r.num_gpus} x {_num(r.gpu_memory_gib)} GiB, tensor parallel {r.tensor_parallel_size}, "
        f"{r.num_replicas} replica(s), gpu_memory_utilization {r.gpu_memory_utilization:g}",
        f"weights: {_num(r.weight_bytes / GiB)} GiB total, {_num(r.weight_bytes_per_gpu / GiB)} GiB per GPU"
        + (f" (linear layers {r.quantization})" if r.quantization != "none" else ""),
    ]
    if r.kv_budget_bytes_per_gpu == 0:
        lines.append("does not fit: the weights alone exceed the usable GPU memory "
                     "(add GPUs, raise --tensor-parallel-size, or use a smaller dtype)")
    else:
        lines.append(f"KV cache budget: {_num(r.kv_budget_bytes_per_gpu / GiB)} GiB per GPU")
    lines.append(f"fits: {r.max_num_seqs:,} sequences of {r.max_model_len:,} tokens "
                 f"({r.max_num_seqs * r.max_model_len:,} tokens; "
                 f"{r.max_num_seqs_per_replica:,} per replica)")
    return "\n".join(lines)


def add_kv_size_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kv-size`` on the ``pagedserve`` CLI; the handler is ``args.func``."""
    p = subparsers.add_parser("kv-size", help="KV cache bytes per token / sequence and how many fit",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (config.json is enough) or config file")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs per replica (default: all of --num-gpus)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="sequence length to size for (default: the config's max_position_embeddings)")
    p.add_argument("--dtype", default="auto", help="weight dtype: auto (the config's), fp32, fp16, bf16")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                   help="fp8 (= fp8_e4m3), fp8_e5m2, int8: 1 byte per value + a 1-byte scale per token and KV head")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_kv_size)
    return p


def run_kv_size(args: argparse.Namespace) -> int:
    try:
        cfg = load_hf_config(args.model)
        max_len = args.max_model_len or int(cfg.get("max_position_embeddings", 4096))
        report = kv_size(cfg, max_model_len=max_len, gpu_memory_gib=args.gpu_memory_gib,
                         num_gpus=args.num_gpus, tensor_parallel_size=args.tensor_parallel_size,
                         dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    except (OSError, ValueError, KeyError) as e:
        print(f"kv-size: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(report), "kib_per_token": report.kib_per_token,
                          "gib_per_seq": report.gib_per_seq}, indent=2))
    else:
        print(format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_kv_size_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kv-size", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
