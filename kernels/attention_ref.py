"""Pure-torch reference for paged attention over a mixed batch, and the KV-cache write.

This is the CPU path and the oracle the Triton kernels are tested against.

Layout of one step's batch (``cu_seqlens_q`` = [0, 3, 4, 9]):

    q rows:      [ s0 s0 s0 | s1 | s2 s2 s2 s2 s2 ]
                   prefill    dec   prefill chunk
    seq_lens:      s0: 3       s1: 41  s2: 133   (context incl. the new rows)

Row j of sequence i sits at absolute position ``seq_lens[i] - q_len_i + j`` and attends
to cached positions ``[0, that position]`` (causal inside the chunk, everything before it).
A sliding-window layer (``sliding_window`` W, Gemma's local layers, transformers' mask
``kv_idx > q_idx - W``) sees only ``(that position - W, that position]``: the W newest
keys, itself included. ``softcap`` c (Gemma 2) bends each scaled score s into
``c * tanh(s / c)`` before the mask and the softmax.

A quantised cache (kv_quant.py) comes with ``k_scale`` / ``v_scale``: writes quantise each
(token, head) row, reads dequantise to fp32 before the math.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_quant import check_scales, dequantize_rows, quantize_rows


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block_id * block_size + offset; < 0: skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if quantized:
            x, s = quantize_rows(x, cache.dtype)
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, s)
            # index_copy_ has no fp8 kernel on CPU: copy the bytes.
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def gather_kv_ref(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
                  seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence's blocks as fp32 [seq_len, num_kv_heads, head_dim]."""
    x = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
    if scales is None:
        return x.float()
    return dequantize_rows(x, scales[blocks].reshape(-1, scales.shape[2])[:seq_len])


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. this step's rows
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # W: a row sees its W newest keys (itself included); None: all
    softcap: float | None = None,  # c: scores -> c * tanh(scores / c) (Gemma 2); None: off
) -> torch.Tensor:
    """Slow and obviously correct: one sequence at a time, fp32 math."""
    check_scales(k_cache, v_cache, k_scale, v_scale)
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = cu[i], cu[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        k = gather_kv_ref(k_cache, k_scale, blocks, seq_len)
        v = gather_kv_ref(v_cache, v_scale, blocks, seq_len)
        if sliding_window:  # keys before the first row's window may sit in freed blocks: never read them
            lo = max(0, seq_len - q_len - sliding_window + 1)
            k[:lo] = 0
            v[:lo] = 0
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(hidden.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
