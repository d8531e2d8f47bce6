"""Decode attention on CPU as one fused C++ loop (a torch C++ extension, built on first use),
and the write of a step's K/V rows into the cache that feeds it (``write_kv_cpu``).

The torch path gathers every decode sequence's K/V into a padded buffer and then runs two
batched matmuls over it: K/V cross memory three times (gather read, gather write, matmul
read). This kernel walks the block table instead and reads each K/V row exactly once,
with an online softmax per (sequence, KV head) and all query heads of that KV head
sharing each loaded row (GQA):

    for (seq, kv_head) in parallel:              # at::parallel_for, torch's intra-op threads
        for block in block_table[seq]:            # 16 tokens x head_dim, contiguous per token
            s[g, t] = q[g] . k[t] * scale         # g: the query heads of this kv head
            online softmax: m, l, acc[g] += p[g, t] * v[t]
        out[g] = acc[g] / l[g]

A sliding-window layer's rows start at their window (no block before it is read: a hybrid
KV cache has freed those), and Gemma 2's soft-capped scores take the portable block.

Rows of one sequence (``row_groups``: speculative decoding verifies k drafts as k + 1 decode
rows over the same block table, lengths L-k .. L) are one work item: each K/V block is read
from memory once for all of them, every row's heads take the block while it is within that
row's length, so the drafts cost compute, not a second pass over the context. When there
are fewer (sequence, KV head) items than twice the threads (batch 1), a group's rows are
split into parts, one item each, so both threads of a 2-core box verify.

q in fp32 only (the CPU engine's dtype for exactness against transformers); the cache in fp32
or quantised (kv_quant.py: 1-byte fp8 e4m3 / e5m2 / int8 codes, dequantised block by block
into L1 with their scales folded in, so a quantised context reads a quarter of the bytes).
Where the compiler targets AVX-512 (``-march=native``), a block is computed 16 tokens at a
time: per query head, the 16 scores out of one transpose-and-add tree, the softmax with a
vectorised exp (degree-7 polynomial, ~1 ulp), q and the accumulator in registers (D = 32, 64,
128; other D load each K and V row once for all the group's heads). With AVX2 and FMA only
(D % 8 == 0), a block's K is transposed once in L1 and every row's heads score 8 tokens per
broadcast FMA, no horizontal sums; P.V keeps each head's accumulator in registers; the exp
is built in the exponent field.
Elsewhere the portable loop runs. The calls release the GIL, so a serving process's event
loop runs while a step is in attention. Anything else, or a machine where the extension
cannot be built, falls back to the torch path. Built once per CPU kind into torch's
extension cache (kernels/cpu_build.py). The C++ is kernels/cpu_decode_attention.cpp, and
the dequantisation of a quantised block kernels/cpu_kv_dequant.h.
"""

from __future__ import annotations

import torch

from .cpu_build import LazyExtension, read_source
from .kv_quant import AMAX_CODE_BIAS, INV_QMAX, SCALE_NAN

_NO_GROUPS = torch.empty(0, dtype=torch.int32)

# cache dtype -> the extension's format code
_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}

# The -D pair: kv_quant.py's scale-code bias and NaN code, which cpu_kv_dequant.h decodes.
_EXT = LazyExtension("pagedserve_cpu_decode_attention_v15", read_source("cpu_decode_attention.cpp"),
                     ["-O3", "-march=native", "-fno-math-errno",
                      f"-DPS_AMAX_CODE_BIAS={AMAX_CODE_BIAS}", f"-DPS_SCALE_NAN={SCALE_NAN}"],
                     "CPU decode-attention", "using the torch path")
_load = _EXT.get
available = _EXT.available


def write_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0: skip
) -> bool:
    """The step's K/V rows into an fp32 cache in one call; False when it cannot (caller
    falls back to attention_ref.write_kv_cache_ref)."""
    for x in (key, value):
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3 or x.stride(2) != 1
                or x.stride(1) != x.shape[2]):
            return False
    if (k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32 or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or tuple(k_cache.shape[2:]) != tuple(key.shape[1:])
            or value.shape != key.shape or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or slot_mapping.device.type != "cpu" or slot_mapping.numel() != key.shape[0]):
        return False
    mod = _load()
    if mod is None:
        return False
    mod.write_kv(key, value, k_cache, v_cache, slot_mapping)
    return True


def decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32, one decode row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or quantised
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    row_groups: torch.Tensor | None = None,  # [num_groups + 1] int32: rows sharing one sequence (above)
    sliding_window: int | None = None,  # W: a row of length L reads keys [L - W, L) only (attention_ref.py)
    softcap: float | None = None,  # Gemma 2's score soft-cap (the portable block runs then)
) -> bool:
    """Fills ``out`` and returns True, or returns False when it cannot (caller falls back)."""
    fmt = _FORMATS.get(k_cache.dtype)
    if (fmt is None or q.dtype != torch.float32 or q.device.type != "cpu" or v_cache.dtype != k_cache.dtype
            or q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or out.stride(-1) != 1 or q.shape[1] % k_cache.shape[2] != 0):
        return False
    if fmt and (k_scale is None or v_scale is None or not k_scale.is_contiguous() or not v_scale.is_contiguous()
                or k_scale.dtype != torch.uint8 or v_scale.dtype != torch.uint8):
        return False
    mod = _load()
    if mod is None:
        return False
    # Each conversion a dispatch only when needed: the runner's tensors are int32 already.
    bt = block_table if block_table.dtype == torch.int32 and block_table.is_contiguous() else \
        block_table.to(torch.int32).contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() else \
        seq_lens.to(torch.int32).contiguous()
    groups = _NO_GROUPS if row_groups is None else row_groups if (
        row_groups.dtype == torch.int32 and row_groups.is_contiguous()) else row_groups.to(torch.int32).contiguous()
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    if fmt == 0:
        mod.decode_attention(q, k_cache, v_cache, bt, lens, float(scale), out, groups, window, cap)
    else:
        mod.decode_attention_quant(q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, bt,
                                   lens, float(scale), out, fmt, INV_QMAX[k_cache.dtype], groups, window, cap)
    return True
