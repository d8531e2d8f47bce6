"""Which layers of a checkpoint attend through a sliding window, read from config.json with
the semantics transformers 5 gives each family (a row at position p sees keys
(p - window, p], transformers' ``kv_idx > q_idx - sliding_window``):

    Gemma 2 / 3          layer_types, else Gemma 2 alternates from a sliding layer 0 and
                         Gemma 3 runs sliding_window_pattern - 1 local layers to 1 global
    Qwen2 / Qwen3        window = sliding_window if use_sliding_window; layer_types, else
                         layer i slides where i >= max_window_layers (default 28)
    Mistral, Mixtral,    every layer slides when sliding_window is set (their mask is the
    Phi-3, Qwen3-MoE     sliding one whenever config.sliding_window is not None; Qwen3-MoE's
                         is None unless use_sliding_window)

The layers a window runs on take the window in the attention kernels, and a model with
such layers gets the hybrid KV cache (scheduler/kv/kv_groups.py). A family not listed here
whose config names a window (SmolLM3's, a GGUF's attention.sliding_window) has none of its
layers run it: ModelConfig caps its max_model_len at the window instead, where no row can
tell the difference.
"""

from __future__ import annotations

from typing import Any

from pagedserve.scheduler.kv.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION

# Gemma 2 / 3: sliding-window and global layers interleaved (layer_types), GeGLU, (1 + w)
# RMSNorm, scaled embeddings, query_pre_attn_scalar, soft-capping (worker/models/gemma.py).
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
EVERY_LAYER_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")
# Families whose window the config gates behind use_sliding_window (transformers sets
# sliding_window to None without it).
_GATED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def runs_sliding_window(arch: str) -> bool:
    """Whether ``arch``'s sliding layers run their window here (sliding_window_layers reads them)."""
    return arch in GEMMA_ARCHITECTURES + LAYER_TYPES_ARCHITECTURES + EVERY_LAYER_ARCHITECTURES


def sliding_window_layers(hf: dict[str, Any], arch: str) -> tuple[tuple[str, ...], int | None]:
    """(each layer's attention type, the window), or ((), None) where no layer slides."""
    n = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    if arch in _GATED and not hf.get("use_sliding_window", False):
        window = None
    if arch in GEMMA_ARCHITECTURES:
        types = hf.get("layer_types")
        if types is None:
            pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern") or 6)
            types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    elif window is None:
        return (), None
    elif arch in LAYER_TYPES_ARCHITECTURES:
        types = hf.get("layer_types")
        if types is None:
            first = int(hf.get("max_window_layers", 28))
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]
    elif arch in EVERY_LAYER_ARCHITECTURES:
        types = [SLIDING_ATTENTION] * n
    else:
        return (), None
    types = tuple(types)
    if len(types) != n or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"layer_types must list {n} of {FULL_ATTENTION!r} / {SLIDING_ATTENTION!r}, got {types}.")
    if SLIDING_ATTENTION not in types:
        return (types if arch in GEMMA_ARCHITECTURES else ()), None
    if not (isinstance(window, int) and window >= 1):
        raise ValueError(f"sliding layers need sliding_window >= 1, got {window!r}.")
    return types, window
