"""What a Hugging Face checkpoint's ``quantization_config`` says, as one typed object, and
what a quantized linear weight costs in bytes. Pure stdlib (``pagedserve kv-size`` reads it).

Read as transformers and vLLM read it (config.json's ``quantization_config``; a ModelOpt
export may instead carry it in ``hf_quant_config.json`` beside config.json):

    quant_method          what we run it as    accepted
    awq                   "awq"  int4          version "gemm", bits 4, zero_point true
    gptq                  "gptq" int4          bits 4, sym true/false, desc_act (g_idx),
                                               checkpoint_format "gptq" (zeros stored - 1)
                                               or "gptq_v2" (zeros stored as they are)
    fp8                   "fp8"  fp8 e4m3      per-tensor weight_scale (no weight_block_size)
    compressed-tensors    "fp8"                format float-quantized / naive-quantized, every
                                               group's weights 8-bit float, strategy tensor
                                               or channel
    modelopt              "fp8"                quant_algo FP8 (per-tensor) or
                                               FP8_PER_CHANNEL_PER_TOKEN (per-channel)

int4 groups: 32, 64 or 128 weights along the input dimension, or -1 (one group per output
channel). Activation quantization a config asks for (fp8 input scales, dynamic per-token)
is not done: the weights are dequantized inside the GEMM and the activations stay in
--dtype, so results follow the dequantized-weight model, not vLLM's w8a8 rounding.
Anything else is a ValueError naming what the checkpoint asks for and what is supported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# --quantization names that a checkpoint's quant_method runs as here (vLLM's names).
HF_QUANT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "compressed-tensors": "fp8", "modelopt": "fp8"}
INT4_GROUP_SIZES = (32, 64, 128, -1)
INT4_BITS = (4,)
GPTQ_FORMATS = ("gptq", "gptq_v2")
MODELOPT_ALGOS = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel"}
FP8_STRATEGIES = ("tensor", "channel")


@dataclass(slots=True)
class HFQuantConfig:
    method: str  # "awq" | "gptq" | "fp8": the kind of weight (HF_QUANT_METHODS' values)
    quant_method: str  # as the checkpoint names it (awq, gptq, fp8, compressed-tensors, modelopt)
    bits: int = 4
    group_size: int = 128  # int4: weights a scale covers along the input dimension; -1: all of it
    zero_point: bool = True  # int4: asymmetric (a zero per group); false: GPTQ sym, zero 8
    desc_act: bool = False  # GPTQ act-order: g_idx maps each input row to its group
    zeros_minus_one: bool = False  # GPTQ v1 stores zero - 1
    fp8_strategy: str = "tensor"  # "tensor": one weight_scale; "channel": one per output row
    ignore: list[str] = field(default_factory=list)  # module names left unquantized (lm_head, ...)

    def describe(self) -> str:
        if self.method == "fp8":
            return f"{self.quant_method} fp8 e4m3 per-{self.fp8_strategy} scales"
        extra = ", act-order" if self.desc_act else ""
        return (f"{self.quant_method} int{self.bits} group {self.group_size}, "
                f"{'asymmetric' if self.zero_point else 'symmetric'}{extra}")


def _unsupported(what: str, value: Any, supported: Any) -> ValueError:
    shown = ", ".join(map(str, supported)) if isinstance(supported, (tuple, list)) else supported
    return ValueError(f"quantization_config {what} {value!r} is not supported; supported: {shown}.")


def read_quantization_config(hf: dict[str, Any], model_dir: str | None = None) -> dict[str, Any] | None:
    """config.json's ``quantization_config``, else a ModelOpt ``hf_quant_config.json`` beside
    it (its ``quantization`` section, as quant_method "modelopt"), else None."""
    qc = hf.get("quantization_config")
    if qc:
        return dict(qc)
    path = os.path.join(model_dir, "hf_quant_config.json") if model_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            doc = json.load(f)
        return {"quant_method": "modelopt", **(doc.get("quantization") or {})}
    return None


def parse_quant_config(qc: dict[str, Any] | None) -> HFQuantConfig | None:
    """``quantization_config`` -> HFQuantConfig, or None for an unquantized checkpoint."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in HF_QUANT_METHODS:
        raise _unsupported("quant_method", method, tuple(HF_QUANT_METHODS))
    if method in ("awq", "gptq"):
        return _parse_int4(method, qc)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise _unsupported("weight_block_size", qc["weight_block_size"], "none (per-tensor fp8 scales)")
        return HFQuantConfig("fp8", method, bits=8, fp8_strategy="tensor", ignore=list(qc.get("ignored_layers") or []))
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo not in MODELOPT_ALGOS:
            raise _unsupported("modelopt quant_algo", qc.get("quant_algo"), tuple(MODELOPT_ALGOS))
        return HFQuantConfig("fp8", method, bits=8, fp8_strategy=MODELOPT_ALGOS[algo],
                             ignore=list(qc.get("exclude_modules") or []))
    return _parse_compressed_tensors(qc)


def _parse_int4(method: str, qc: dict[str, Any]) -> HFQuantConfig:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in INT4_BITS:
        raise _unsupported(f"{method} bits", bits, INT4_BITS)
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group not in INT4_GROUP_SIZES:
        raise _unsupported(f"{method} group_size", group, INT4_GROUP_SIZES)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _unsupported("awq version", version, ("gemm",))
        if not qc.get("zero_point", True):
            raise _unsupported("awq zero_point", False, (True,))
        return HFQuantConfig("awq", method, bits, group, zero_point=True,
                             ignore=list(qc.get("modules_to_not_convert") or []))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in GPTQ_FORMATS:
        raise _unsupported("gptq checkpoint_format", fmt, GPTQ_FORMATS)
    if qc.get("lm_head"):
        raise _unsupported("gptq lm_head", True, "false (an unquantized LM head)")
    return HFQuantConfig("gptq", method, bits, group, zero_point=not qc.get("sym", True),
                         desc_act=bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq")


def _parse_compressed_tensors(qc: dict[str, Any]) -> HFQuantConfig:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported("compressed-tensors format", fmt, ("float-quantized", "naive-quantized"))
    groups = qc.get("config_groups") or {}
    strategies = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise _unsupported(f"compressed-tensors {name} weights", f"{w.get('type')} {w.get('num_bits')}-bit",
                               "float 8-bit (fp8 e4m3)")
        if w.get("strategy") not in FP8_STRATEGIES:
            raise _unsupported(f"compressed-tensors {name} weight strategy", w.get("strategy"), FP8_STRATEGIES)
        if not w.get("symmetric", True):
            raise _unsupported(f"compressed-tensors {name} symmetric", False, (True,))
        strategies.add(w["strategy"])
    if not strategies:
        raise ValueError("quantization_config of compressed-tensors has no config_groups with weights.")
    # Per-tensor scales are per-channel scales that happen to agree; one layout serves both.
    return HFQuantConfig("fp8", "compressed-tensors", bits=8,
                         fp8_strategy="channel" if "channel" in strategies else "tensor",
                         ignore=list(qc.get("ignore") or []))


def linear_weight_bytes(qcfg: HFQuantConfig | None, n: int, k: int, plain_bytes: int) -> int:
    """Bytes of one [n out, k in] linear weight as it is held: int4 nibbles plus an fp16
    scale and a byte zero per (group, output); fp8 bytes plus an fp32 scale per output;
    ``plain_bytes`` per weight when unquantized. (kv-size counts with it; the loaded model
    reports its real sizes.)"""
    if qcfg is None:
        return n * k * plain_bytes
    if qcfg.method == "fp8":
        return n * k + 4 * n
    groups = 1 if qcfg.group_size == -1 else -(-k // qcfg.group_size)
    return n * k // 2 + groups * n * 3 + (4 * k if qcfg.desc_act else 0)
