"""Paged attention and KV-cache writes: Triton on CUDA, fast torch elsewhere.

The model calls exactly two functions per layer and step, in this order:

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, backend[, k_scale, v_scale])
    out = paged_attention(q, k_cache, v_cache, attn_metadata, scale, backend[, k_scale=, v_scale=,
                          sliding_window=, softcap=])

A sliding-window layer passes its window W (a row sees its W newest keys, itself
included: attention_ref.py) and Gemma 2 its score soft-cap; every backend takes both,
and reads no key before a row's window (a hybrid KV cache has freed those blocks).

A quantised cache (``--kv-cache-dtype fp8 | fp8_e5m2 | int8``, see kv_quant.py) is told by
the caches' dtype and carries a 1-byte scale per (token, head): writes quantise, every
attention path dequantises as it reads.
``backend`` comes from ``resolve_attention_backend("auto", device)`` once, at start-up.
Triton is imported lazily, so this package imports on a machine without triton or CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from pagedserve.kernels.attention_torch import paged_attention_torch
from pagedserve.kernels.cpu_decode_attention import write_kv_cpu
from pagedserve.kernels.kv_quant import QUANT_DTYPES, kv_cache_torch_dtype
from pagedserve.kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "QUANT_DTYPES",
    "kv_cache_torch_dtype",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_torch",
    "resolve_attention_backend",
    "triton_available",
    "write_kv_cache",
    "write_kv_cache_ref",
]

# The torch reference (attention_ref.py) is the tests' oracle, never a backend to run.
BACKENDS = ("torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend(backend: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on CUDA when triton is importable, else "torch"."""
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be 'auto' or one of {BACKENDS}, got {backend!r}.")
    return backend


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0: skip
    backend: str = "torch",
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    if backend == "triton":
        from pagedserve.kernels.triton_cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif backend == "torch":
        if k_scale is None and key.device.type == "cpu" and write_kv_cpu(key, value, k_cache, v_cache, slot_mapping):
            return
        write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}.")


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # W: a row sees its W newest keys, itself included; None: all
    softcap: float | None = None,  # c: scores -> c * tanh(scores / c) before the softmax; None: off
) -> torch.Tensor:
    """Attention of this step's rows over their cached context (written beforehand)."""
    md = attn_metadata
    sc = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, softcap=softcap)
    if backend == "triton":
        from pagedserve.kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, md, scale, out=out, **sc)
    if backend == "torch":
        return paged_attention_torch(q, k_cache, v_cache, md, scale, out=out, **sc)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}.")
