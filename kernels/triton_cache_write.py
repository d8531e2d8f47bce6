"""KV-cache write in Triton: this step's K/V rows into their slots.

    slot = block_id * block_size + offset   (slot_mapping[t] < 0: row t is skipped,
                                             e.g. padding of a captured batch)

One program per token copies its [num_kv_heads, head_dim] K and V rows; the block
offset is computed in int64 because block_id * stride_blk overflows int32 in large pools.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr,  # [num_tokens, num_kv_heads, head_dim]
        value_ptr,  # [num_tokens, num_kv_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping_ptr,  # [num_tokens] int64
        stride_key_tok, stride_key_head,
        stride_value_tok, stride_value_head,
        stride_kc_blk, stride_kc_tok, stride_kc_head,
        stride_vc_blk, stride_vc_tok, stride_vc_head,
        NUM_KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot < 0:
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :],
                    mask=mask)
        kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok + offs_h[:, None] * stride_kc_head + offs_d[None, :]
        vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok + offs_h[:, None] * stride_vc_head + offs_d[None, :]
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0: skip
) -> None:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch' on this machine.")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}.")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be [num_blocks, block_size, "
                         f"{key.shape[1]}, {key.shape[2]}].")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}.")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous (stride 1) dimension of key, value and the caches.")
    if len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, caches and slot_mapping must be on one device.")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=1 << max(0, (num_kv_heads - 1).bit_length()),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=1 << max(0, (head_dim - 1).bit_length()),
        BLOCK_SIZE=k_cache.shape[1],
    )
