"""Quantize a tiny random HF checkpoint into the published AWQ, GPTQ and fp8 layouts, written
here from the formats' documentation (never downloaded), and the same model with the
dequantized weights (what transformers runs as the reference).

    int4 (per group of ``group`` inputs, per output):
        asymmetric  scale = (max - min) / 15 (fp16), zero = round(-min / scale)
        symmetric   scale = 2 max|w| / 15 (fp16), zero = 8                 (GPTQ sym)
        code = clamp(round(w / scale) + zero, 0, 15),  w' = (code - zero) * scale
    AWQ gemm   qweight int32 [k, n/8]: nibble j of word c = output 8c + (0 2 4 6 1 3 5 7)[j];
               qzeros int32 [k/g, n/8] likewise; scales fp16 [k/g, n]
    GPTQ       qweight int32 [k/8, n]: nibble j of word r = input 8r + j; qzeros int32
               [groups, n/8]: nibble j of word c = output 8c + j, zero - 1 (v1) or zero (v2);
               scales fp16 [groups, n]; g_idx int32 [k] (act-order: a permutation's groups)
    fp8        weight float8_e4m3fn [n, k] = w / scale; weight_scale fp32 [1] (tensor) or
               [n, 1] (channel; ModelOpt's per tensor: 0-d), scale = max|w| / 448
"""

from __future__ import annotations

import json
import os
import shutil
import zlib

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_int4(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None,
                  min_zero: int = 0):
    """w [n, k] fp32 -> (codes [k, n], zeros [groups, n], scales fp16 [groups, n], g_idx [k],
    the dequantized w' [n, k] fp32). ``min_zero``: GPTQ v1 cannot store a zero of 0."""
    n, k = w.shape
    if g_idx is None:
        g_idx = torch.arange(k) // (k if group == -1 else group)
    groups = int(g_idx.max()) + 1
    codes = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        if sym:
            s = (2 * wg.abs().amax(1) / 15).clamp_min(1e-6).half()
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp_max(0), wg.amax(1).clamp_min(0)
            s = ((hi - lo) / 15).clamp_min(1e-6).half()
            z = torch.round(-lo / s.float()).long().clamp(min_zero, 15)
        codes[cols] = (torch.round(wg / s.float()[:, None]).long() + z[:, None]).clamp(0, 15).t()
        zeros[g], scales[g] = z, s
    deq = ((codes - zeros[g_idx]).float() * scales[g_idx].float()).t().contiguous()
    return codes, zeros, scales, g_idx.to(torch.int32), deq


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: value j in bits 4j .. 4j+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = (nibbles.long() << shifts).sum(-1)
    return (w - ((w >> 31) << 32)).to(torch.int32)


def pack_along_outputs(vals: torch.Tensor, order=None) -> torch.Tensor:
    """[r, n] -> int32 [r, n/8]: word c holds outputs 8c .. 8c+7, nibble j = output 8c + order[j]."""
    r, n = vals.shape
    v = vals.reshape(r, n // 8, 8)
    return _words(v[..., list(order)] if order is not None else v)


def pack_along_inputs(codes: torch.Tensor) -> torch.Tensor:
    """codes [k, n] -> int32 [k/8, n]: nibble j of word r = input 8r + j."""
    k, n = codes.shape
    return _words(codes.reshape(k // 8, 8, n).permute(0, 2, 1))


def quantize_fp8(w: torch.Tensor, per_channel: bool):
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / 448.0).float()
    q = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
    deq = q.float() * (scale if per_channel else scale[0])
    return q, scale, deq


def quantize_linear(fmt: str, w: torch.Tensor, prefix: str, opts: dict) -> tuple[dict, torch.Tensor]:
    """One linear weight -> ({checkpoint tensor name: tensor}, dequantized weight)."""
    group = opts.get("group_size", 128)
    if fmt == "awq":
        codes, zeros, scales, _, deq = quantize_int4(w, group, sym=False)
        return {f"{prefix}.qweight": pack_along_outputs(codes, AWQ_ORDER),
                f"{prefix}.qzeros": pack_along_outputs(zeros, AWQ_ORDER), f"{prefix}.scales": scales}, deq
    if fmt == "gptq":
        v1 = opts.get("checkpoint_format", "gptq") == "gptq"
        g_idx = None
        if opts.get("desc_act"):
            k = w.shape[1]
            # GPTQ orders inputs by the Hessian of the layer's input: projections that share an
            # input (q, k, v; gate, up) share the permutation.
            shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(shared.encode())))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        codes, zeros, scales, g_idx, deq = quantize_int4(w, group, sym=opts.get("sym", True), g_idx=g_idx,
                                                         min_zero=1 if v1 else 0)
        out = {f"{prefix}.qweight": pack_along_inputs(codes), f"{prefix}.qzeros": pack_along_outputs(zeros - int(v1)),
               f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx}
        if opts.get("zero_bias"):  # AutoGPTQ writes one for every quantized linear
            out[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        return out, deq
    q, scale, deq = quantize_fp8(w, per_channel=opts.get("per_channel", False))
    if opts.get("modelopt") and not opts.get("per_channel"):  # ModelOpt writes 0-d scales
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.reshape(()),
                f"{prefix}.input_scale": torch.tensor(1.0)}, deq
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale,
            f"{prefix}.input_scale": torch.ones(1)}, deq


def quant_config(fmt: str, opts: dict) -> dict | None:
    group = opts.get("group_size", 128)
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": opts.get("sym", True),
                "desc_act": bool(opts.get("desc_act")), "checkpoint_format": opts.get("checkpoint_format", "gptq")}
    strategy = "channel" if opts.get("per_channel") else "tensor"
    if opts.get("modelopt"):
        return None  # hf_quant_config.json instead
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}


def write_quantized(src: str, dst: str, deq_dst: str, fmt: str, **opts) -> None:
    """``src`` (an fp32 HF checkpoint dir) -> ``dst`` quantized as ``fmt`` ("awq", "gptq",
    "fp8"), in two safetensors shards (the scales in the second: a layer's parts arrive apart),
    and ``deq_dst``: the same model with every quantized weight replaced by its dequantized
    value (fp32), for transformers."""
    state = load_file(os.path.join(src, "model.safetensors"))
    quant, plain, deq_state = {}, {}, dict(state)
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS:
            parts, deq = quantize_linear(fmt, t.float(), prefix, opts)
            quant.update(parts)
            deq_state[name] = deq
        else:
            plain[name] = t.contiguous()
    for d in (dst, deq_dst):
        if os.path.exists(d):
            shutil.rmtree(d)
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
    second = {k: v for k, v in quant.items() if k.endswith(("scales", "weight_scale"))}
    first = {**plain, **{k: v for k, v in quant.items() if k not in second}}
    save_file(first, os.path.join(dst, "model-00001-of-00002.safetensors"))
    save_file(second, os.path.join(dst, "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    qc = quant_config(fmt, opts)
    if qc is not None:
        cfg["quantization_config"] = qc
    else:  # a ModelOpt export: the scheme in hf_quant_config.json
        algo = "FP8_PER_CHANNEL_PER_TOKEN" if opts.get("per_channel") else "FP8"
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.0"},
                       "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                        "exclude_modules": ["lm_head"]}}, f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in deq_state.items()}, os.path.join(deq_dst, "model.safetensors"))
