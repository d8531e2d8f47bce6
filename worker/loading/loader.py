"""Load a checkpoint into our model: safetensors or GGUF, never pickle.

    DIR/model.safetensors                          one file
    DIR/model.safetensors.index.json + shards      sharded ({"weight_map": {name: file}})
    FILE.gguf (or config.json's "gguf_file")       dequantized tensor by tensor (gguf_loader.py),
                                                   unless DIR/dequantized/ caches them;
                                                   with --quantization gguf kept in their blocks
                                                   (iter_gguf_native), packed once loaded
    DIR with quantization_config (AWQ, GPTQ, fp8)  each layer's quantized tensors gathered into
                                                   one packed weight (hf_quant_loader.py)

Every tensor is handed to the model as a lazy ``safe_open(...).get_slice(name)``; each
parameter's weight loader reads only this rank's rows/columns, so a TP rank never reads
(or even pages in) the other ranks' shards. A GGUF tensor is dequantized whole (its blocks
run along rows) and then sliced the same way. At the end every parameter must have been
written, or loading fails: an uninitialised weight would silently produce garbage.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import defaultdict
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.kernels import resolve_attention_backend

from pagedserve.worker.loading.gguf_loader import iter_gguf_native, iter_gguf_weights
from pagedserve.worker.loading.hf_quant_loader import iter_hf_quantized
from pagedserve.worker.loading.quant_config import HF_QUANT_METHODS, HFQuantConfig
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models import get_model_class

logger = logging.getLogger(__name__)

_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_path, f))]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}.")
        return [os.path.join(model_path, f) for f in files]
    if os.path.isfile(single):
        return [single]
    pickles = [os.path.basename(p) for pat in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_path, pat))]
    if pickles:
        raise ValueError(f"{model_path!r} has only pickle checkpoints ({', '.join(sorted(pickles))}); "
                         "pagedserve loads safetensors only, since unpickling can run arbitrary code. "
                         "Convert with transformers: model.save_pretrained(dir, safe_serialization=True).")
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path!r}.")


def iter_weight_slices(model_path: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of the checkpoint; a name seen twice is an error."""
    seen: dict[str, str] = {}
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in both {seen[name]} and {path}.")
                seen[name] = path
                yield name, f.get_slice(name)


def load_weights_into(model: nn.Module, model_path: str, gguf_file: str | None = None,
                      quantization: str | None = None, hf_config: dict | None = None,
                      quant_config: HFQuantConfig | None = None) -> None:
    """``quantization="gguf"``: the GGUF's block weights stay quantized (``hf_config``: the
    model's config dict, for the q/k row permutation). ``quant_config`` (a checkpoint's
    quantization_config): its weights stay packed for ``quantization`` "awq" / "gptq" /
    "fp8", and are dequantized at load when ``quantization`` is None."""
    if quantization == "gguf":
        weights = iter_gguf_native(gguf_file, hf_config or {})
    elif gguf_file:  # dequantized: from the prepared directory's fp32 copy (model_source.py)
        from pagedserve.worker.loading.model_source import dequantized_copy

        copy = dequantized_copy(model_path, gguf_file)
        weights = iter_weight_slices(copy) if copy is not None else iter_gguf_weights(gguf_file)
    else:
        weights = iter_weight_slices(model_path)
        if quant_config is not None:
            weights = iter_hf_quantized(weights, quant_config, dequantize=quantization is None)
    loaded = model.load_weights(weights)
    missing = model.expected_weight_keys() - loaded
    if missing:
        by_param: dict[str, list[str]] = defaultdict(list)
        for key in sorted(missing):
            name, _, shard = key.partition("#")
            by_param[name].append(shard)
        shown = [n if s == [""] else f"{n} (shard {', '.join(s)})" for n, s in sorted(by_param.items())]
        raise ValueError(f"checkpoint {model_path!r} is missing {len(missing)} tensor(s) for: "
                         f"{', '.join(shown[:8])}{' ...' if len(shown) > 8 else ''}.")
    if quantization == "gguf":
        _pack_quantized(model)
    elif quantization in HF_QUANT_METHODS.values():
        _pack_hf_quantized(model, quant_config)


def _pack_hf_quantized(model: nn.Module, quant_config: HFQuantConfig) -> None:
    """Every layer's int4 / fp8 shards into one packed weight on its device, and the start-up
    line that counts the bytes they hold."""
    from pagedserve.worker.layers.quantized import finish_quantized

    from pagedserve.kernels.quant.int4 import Int4Weight, as_q4_1
    from pagedserve.worker import cpu_memory

    sizes = finish_quantized(model)
    on_gguf = 0
    for m in model.modules():  # CPU: int4 layers the GGUF kernel can run as Q4_1 (kernels/quant/int4.py)
        if isinstance(getattr(m, "_packed", None), Int4Weight):
            q4 = as_q4_1(m._packed, lambda shape, dtype: cpu_memory.zeros(shape, dtype, torch.device("cpu")))
            if q4 is not None:
                m._packed, on_gguf = q4, on_gguf + 1
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    mib = 1 << 20
    logger.info("Weights: %.1f MiB quantized (%s: %s%s) + %.1f MiB plain (embeddings, LM head, norms, biases)",
                sum(sizes.values()) / mib, quant_config.describe(),
                ", ".join(f"{q} {b / mib:.1f} MiB" for q, b in sorted(sizes.items())),
                f"; {on_gguf} int4 GEMMs on the CPU GGUF kernel as Q4_1" if on_gguf else "", plain / mib)


def _pack_quantized(model: nn.Module) -> None:
    """Every layer's GGUF shards into the kernel's layout (in huge pages, as the panel GEMM's
    weights), and the start-up line that counts the bytes a step reads."""
    from pagedserve.kernels import cpu_gguf
    from pagedserve.worker import cpu_memory
    from pagedserve.worker.layers.quantized import finish_quantized

    sizes = finish_quantized(model, lambda shape, dtype: cpu_memory.zeros(shape, dtype, torch.device("cpu")))
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    mib = 1 << 20
    on_cuda = next(model.parameters()).device.type == "cuda"
    kernel = "the Triton int4 GEMM for Q4_0 / Q4_1 layers" if on_cuda else f"the {cpu_gguf.isa()} kernel"
    logger.info("Weights: %.1f MiB in GGUF blocks (%s; %s) + %.1f MiB plain (norms, biases%s)",
                sum(sizes.values()) / mib, ", ".join(f"{q} {b / mib:.1f} MiB" for q, b in sorted(sizes.items())),
                kernel, plain / mib, "; the other types dequantized at load" if on_cuda else "")


def load_model(model_config: ModelConfig, device: str | torch.device = "cpu",
               attention_backend: str | None = None) -> nn.Module:
    """Build the model for ``model_config`` on ``device`` (this process's TP rank) and fill it
    from the checkpoint. Returns it in eval mode, parameters in ``model_config.dtype``."""
    device = torch.device(device)
    attention_backend = resolve_attention_backend(attention_backend or "auto", device)
    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config, attention_backend=attention_backend)
    load_weights_into(model, model_config.model_path, model_config.gguf_file, model_config.quantization,
                      model_config.hf_config, model_config.quant_config)
    return model.eval()
