"""Random paged batches for kernel tests, benchmarks and the GPU check.

A batch is what the model runner hands a layer after ``write_kv_cache``: q rows for this
step, K/V caches holding every sequence's context (including this step's tokens), and
AttentionMetadata. Block ids are a random permutation, so no sequence owns contiguous
blocks; with ``high_block_ids`` they come from the end of the pool, where an int32
``block_id * stride_blk`` overflows once the pool passes 2^31 elements. Unused cache
memory is NaN (``poison``): reading a block or slot the batch does not own poisons the
output instead of passing silently. With ``kv_dtype`` (a quantised format, kv_quant.py) the
caches are quantised after filling and come with their scales; unused slots then have NaN
scale codes (255), which poison the same way. With ``sliding_window`` the blocks no row's
window reaches are NaN too (a hybrid KV cache has freed them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_quant import quantize_rows
from pagedserve.kernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    attn_metadata: AttentionMetadata
    scale: float
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_blocks: int | None = None,
    high_block_ids: bool = False,
    seed: int = 0,
    poison: bool = True,  # False: torch.empty pool, so a multi-GB pool costs only the pages written
    kv_dtype: torch.dtype | None = None,  # a quantised cache format (float8_e4m3fn, float8_e5m2, int8)
    sliding_window: int | None = None,  # blocks wholly before every row's window are poisoned (freed)
) -> PagedBatch:
    assert len(query_lens) == len(seq_lens)
    assert all(0 <= ql <= sl for ql, sl in zip(query_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-sl // block_size) for sl in seq_lens]
    needed = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = needed + 4
    assert num_blocks >= needed
    # Ids from the pool's tail when asked, shuffled either way.
    first = num_blocks - needed if high_block_ids else 0
    pool = first + torch.randperm(num_blocks - first, generator=gen)[:needed]
    max_blocks = max(blocks_per_seq, default=1)
    # Padding columns hold the last valid block id: in range, but not this sequence's.
    block_table = torch.full((len(seq_lens), max(max_blocks, 1)), num_blocks - 1, dtype=torch.int32)
    off = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = pool[off:off + n].to(torch.int32)
        off += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if poison:
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    else:
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
    # Only the slots a sequence owns get data; the tail of its last block stays NaN.
    slots = torch.cat([
        (block_table[i, (p := torch.arange(sl)) // block_size].long() * block_size + p % block_size)
        for i, sl in enumerate(seq_lens)
    ]) if seq_lens else torch.empty(0, dtype=torch.long)
    n = slots.numel()
    k_vals = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_vals = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots_d = slots.to(device)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots_d, k_vals.to(device))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots_d, v_vals.to(device))
    if sliding_window and poison:
        # A hybrid KV cache frees a sliding layer's blocks that no row's window reaches any
        # more: another request may own them. NaN there: a kernel that reads them fails.
        for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
            for b in range(max(0, sl - ql - sliding_window + 1) // block_size):
                k_cache[int(block_table[i, b])] = float("nan")
                v_cache[int(block_table[i, b])] = float("nan")

    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
    cu = [0]
    for ql in query_lens:
        cu.append(cu[-1] + ql)
    slot_mapping = []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for p in range(sl - ql, sl):
            slot_mapping.append(int(block_table[i, p // block_size]) * block_size + p % block_size)
    num_decode = 0
    for ql in query_lens:
        if ql != 1:
            break
        num_decode += 1
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decode_tokens=num_decode,
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
    )
    if kv_dtype is None:
        return PagedBatch(q, k_cache, v_cache, md, head_dim ** -0.5)
    (k_cache, k_scale), (v_cache, v_scale) = quantize_rows(k_cache, kv_dtype), quantize_rows(v_cache, kv_dtype)
    return PagedBatch(q, k_cache, v_cache, md, head_dim ** -0.5, k_scale, v_scale)
