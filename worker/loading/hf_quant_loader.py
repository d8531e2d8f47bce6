"""AWQ, GPTQ and fp8 checkpoints: their per-layer tensors, gathered into one quantized weight
each, in the layout the kernels take (kernels/quant/), under the name the model expects.

    AWQ (gemm)   P.qweight  int32 [k, n/8]     8 outputs a word, nibble j = output 8c + o[j],
                 P.qzeros   int32 [k/g, n/8]   o = 0 2 4 6 1 3 5 7 (AutoAWQ's interleave)
                 P.scales   fp16 [k/g, n]
    GPTQ         P.qweight  int32 [k/8, n]     8 inputs a word, nibble j = input 8r + j
                 P.qzeros   int32 [g, n/8]     8 outputs a word in order; v1 ("gptq") stores
                                               zero - 1, v2 ("gptq_v2") the zero itself
                 P.scales   fp16 [g, n]
                 P.g_idx    int32 [k]          the group of each input (act-order permutes it;
                                               without it, i // group_size, and then dropped)
    fp8          P.weight        float8_e4m3fn [n, k]
                 P.weight_scale  fp32 / bf16: [] or [1] (per tensor), [n] or [n, 1] (per row)
                 P.input_scale, *.k_scale, *.v_scale: activation / KV scales, not used here

    -> (P.weight, Int4Tensor | Fp8Tensor), handed to the layer's weight loader

AWQ's words are unpacked and repacked along the inputs once, at load; GPTQ's qweight is
already that layout. The quantized parts of a layer may come in any order and from any
shard file, so they are read whole (at 4 or 8 bits) and a layer's weight is yielded when the
checkpoint has been read through; every other tensor passes straight on, lazily.
``dequantize=True`` (``--quantization none``) yields each weight dequantized to fp32 instead.
AutoGPTQ writes a bias of zeros for every quantized linear layer, biased or not: a zero bias of
a quantized layer is dropped (as vLLM does); any other passes on.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import torch

from pagedserve.kernels.quant.fp8 import FP8_DTYPE, Fp8Weight, dequantize_fp8
from pagedserve.kernels.quant.int4 import Int4Weight, dequantize_int4, pack_codes
from pagedserve.worker.layers.hf_quantized import Fp8Tensor, Int4Tensor
from pagedserve.worker.loading.quant_config import HFQuantConfig

logger = logging.getLogger(__name__)

INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx", "bias")
UNUSED_FP8_PARTS = ("input_scale", "k_scale", "v_scale")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output o of a word is its nibble AWQ_REVERSE_ORDER[o]


def _dtype(loaded: Any) -> str:
    """safetensors' dtype name of a lazy slice (F8_E4M3, I32, ...), or a tensor's torch dtype."""
    return loaded.get_dtype() if hasattr(loaded, "get_dtype") else str(loaded.dtype)


def _full(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # [:] refuses a 0-d slice


def is_fp8(loaded: Any) -> bool:
    return _dtype(loaded) in ("F8_E4M3", str(FP8_DTYPE))


def iter_hf_quantized(weights: Iterable[tuple[str, Any]], qcfg: HFQuantConfig,
                      dequantize: bool = False) -> Iterator[tuple[str, Any]]:
    """``weights`` (name, tensor or lazy slice) of a checkpoint quantized as ``qcfg`` says ->
    (name, what the model's loaders take), see the module doc."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    unused = 0
    for name, loaded in weights:
        prefix, _, part = name.rpartition(".")
        if qcfg.method == "fp8":
            if part in UNUSED_FP8_PARTS:
                unused += 1
                continue
            held = part == "weight_scale" or (part == "weight" and is_fp8(loaded))
        else:
            held = part in INT4_PARTS
        if held:
            pending.setdefault(prefix, {})[part] = _full(loaded)
        else:
            yield name, loaded
    if unused:
        logger.info("%d activation / KV-cache scales of the checkpoint are not used: the weights are dequantized "
                    "in the GEMM and activations stay in the model's dtype.", unused)
    for prefix in list(pending):
        parts = pending.pop(prefix)
        bias = parts.pop("bias", None)
        if parts:
            w = _build(prefix, parts, qcfg)
            if dequantize:
                yield f"{prefix}.weight", (dequantize_fp8(w) if isinstance(w, Fp8Weight) else dequantize_int4(w))
            else:
                yield f"{prefix}.weight", (Fp8Tensor(w.weight, w.scale) if isinstance(w, Fp8Weight)
                                           else Int4Tensor(w, per_channel=qcfg.group_size == -1))
        if bias is not None and (not parts or bool(bias.any())):
            yield f"{prefix}.bias", bias


def _need(prefix: str, parts: dict[str, torch.Tensor], names: tuple[str, ...], qcfg: HFQuantConfig) -> None:
    missing = [n for n in names if n not in parts]
    if missing:
        raise ValueError(f"{qcfg.quant_method} checkpoint: {prefix} has {', '.join(sorted(parts))} but lacks "
                         f"{', '.join(missing)}.")


def _build(prefix: str, parts: dict[str, torch.Tensor], qcfg: HFQuantConfig) -> Int4Weight | Fp8Weight:
    if qcfg.method == "fp8":
        return _build_fp8(prefix, parts, qcfg)
    _need(prefix, parts, ("qweight", "qzeros", "scales"), qcfg)
    return (_build_awq if qcfg.method == "awq" else _build_gptq)(prefix, parts, qcfg)


def _unpack_outputs(words: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [r, n/8] packed along the outputs -> codes [r, n] (uint8); ``order``: the
    nibble that holds each output of a word (None: output j in nibble j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [r, n/8, 8], nibble-major
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(words.shape[0], -1).to(torch.uint8)


def _check_int4_shapes(prefix: str, qcfg: HFQuantConfig, k: int, n: int, scales: torch.Tensor,
                       zeros: torch.Tensor, act_order: bool) -> int:
    """The group size in inputs (-1 means all k); scales and zeros must be [groups, n]."""
    group = k if qcfg.group_size == -1 else qcfg.group_size
    groups = -(-k // group)
    if scales.shape[1] != n or zeros.shape != scales.shape or (not act_order and scales.shape[0] != groups):
        raise ValueError(f"{qcfg.quant_method} checkpoint: {prefix}.scales {tuple(scales.shape)} / qzeros (unpacked "
                         f"{tuple(zeros.shape)}) do not fit a [{n}, {k}] weight in groups of {group} inputs "
                         f"({groups} groups).")
    return group


def _build_awq(prefix: str, parts: dict[str, torch.Tensor], qcfg: HFQuantConfig) -> Int4Weight:
    qweight = parts["qweight"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    codes = _unpack_outputs(qweight, AWQ_REVERSE_ORDER)  # [k, n]
    zeros = _unpack_outputs(parts["qzeros"], AWQ_REVERSE_ORDER)
    scales = parts["scales"]
    group = _check_int4_shapes(prefix, qcfg, k, n, scales, zeros, act_order=False)
    return Int4Weight(pack_codes(codes), scales.contiguous(), zeros.contiguous(), None, group)


def _build_gptq(prefix: str, parts: dict[str, torch.Tensor], qcfg: HFQuantConfig) -> Int4Weight:
    qweight = parts["qweight"].contiguous()
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    zeros = _unpack_outputs(parts["qzeros"], None)
    if qcfg.zeros_minus_one:  # v1: stored zero - 1 (a zero of 0 was stored clamped, as 0: read back as 1)
        zeros = zeros + 1
    scales = parts["scales"]
    g_idx = parts.get("g_idx")
    group = k if qcfg.group_size == -1 else qcfg.group_size
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if g_idx.shape != (k,):
            raise ValueError(f"gptq checkpoint: {prefix}.g_idx {tuple(g_idx.shape)} must be [{k}].")
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group):
            g_idx = None  # no act-order: the group follows from the input
        elif int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
            raise ValueError(f"gptq checkpoint: {prefix}.g_idx names groups outside [0, {scales.shape[0]}).")
    _check_int4_shapes(prefix, qcfg, k, n, scales, zeros, act_order=g_idx is not None)
    return Int4Weight(qweight, scales.contiguous(), zeros.contiguous(), g_idx, group)


def _build_fp8(prefix: str, parts: dict[str, torch.Tensor], qcfg: HFQuantConfig) -> Fp8Weight:
    _need(prefix, parts, ("weight", "weight_scale"), qcfg)
    weight, scale = parts["weight"], parts["weight_scale"].to(torch.float32)
    n = weight.shape[0]
    if scale.numel() == 1:  # per tensor: the same scale for every row
        scale = scale.reshape(1).expand(n)
    elif scale.numel() == n and scale.shape in ((n,), (n, 1)):
        scale = scale.reshape(n)
    else:
        raise ValueError(f"{qcfg.quant_method} checkpoint: {prefix}.weight_scale {tuple(scale.shape)} is neither "
                         f"per tensor nor per output row of a {tuple(weight.shape)} weight (block scales are not "
                         "supported).")
    return Fp8Weight(weight.contiguous(), scale.contiguous())
