"""Fast pure-torch paged attention: the CPU path (``backend="torch"``).

Same contract as ``paged_attention_ref`` (see attention_ref.py for the row layout), but
built for a 2-core CPU where memory traffic, not flops, sets the time:

* Decode rows (query length 1) are batched. Sequences are sorted by length and cut into
  groups whose padded length wastes at most ~25% of the gathered K/V; each group is
  gathered with one token-level ``index_select`` on the leading dim of the flattened
  cache (the gather torch does at memory speed: indexing a non-leading dim of a
  permuted view measured ~10x slower) and permuted once into
  ``[B, num_kv_heads, L, head_dim]`` so both matmuls are plain batched GEMMs. GQA is a
  reshape of q to ``[B, num_kv_heads, group, head_dim]``: K/V are never repeated.
* Gather/permute buffers are reused across calls (``_workspace``): a fresh 100 MB
  tensor per layer costs more in page faults than the copy itself (measured 5-8x).
  Groups are split into chunks of at most ``_CHUNK_TOKENS`` tokens so the buffers stay
  small and the permuted K/V are still in cache when the matmul reads them.
* Prefill/chunk rows go one sequence at a time through ``F.scaled_dot_product_attention``
  (``enable_gqa``), ``is_causal`` when the chunk is the whole context, an explicit
  offset-causal mask otherwise.

Decode math runs in fp32 (the permute copy converts bf16/fp16 for free); prefill runs
SDPA in fp32 or bf16 (CPU SDPA accumulates bf16 in fp32) and upcasts fp16.
Not thread-safe: the workspace is shared per process, like the model runner that calls it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

# Decode groups are padded to their longest member; a sequence joins the current group
# while its length is at least this fraction of the group's padded length.
_GROUP_FILL = 0.75
# Upper bound on tokens gathered per decode chunk (per K or V buffer).
_CHUNK_TOKENS = 16384

_WORKSPACE: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = math.prod(shape)
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel].view(shape)


def _group_decode(seq_ids: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Sorted-by-length groups, each cheap to pad, each at most _CHUNK_TOKENS tokens."""
    order = sorted(seq_ids, key=lambda i: -lens[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    padded = 0
    for i in order:
        if cur and (lens[i] < _GROUP_FILL * padded or (len(cur) + 1) * padded > _CHUNK_TOKENS):
            groups.append(cur)
            cur = []
        if not cur:
            padded = -(-lens[i] // block_size) * block_size
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def _decode_group(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq]
    ids: list[int],  # sequences of this group, longest first
    rows: list[int],  # q row of each sequence in ids
    lens: list[int],  # seq_len of each sequence in ids
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    dev = q.device
    b = len(ids)
    nb = -(-lens[0] // block_size)
    padded = lens[0]  # token-level gather: no need to round up to whole blocks
    ids_t = torch.tensor(ids, device=dev)
    lens_t = torch.tensor(lens, device=dev)
    blocks = block_table.index_select(0, ids_t)[:, :nb].long()  # [b, nb]
    # Token-level gather index. Padding positions (past a sequence's length, including
    # the unwritten tail of its last block) read the sequence's own token 0: cache
    # memory that was never written may hold NaN, and 0 * NaN in the PV matmul is NaN.
    pos = torch.arange(padded, device=dev).expand(b, padded)
    is_pad = pos >= lens_t[:, None]  # [b, padded]
    pos = pos.masked_fill(is_pad, 0)
    slots = (blocks.gather(1, pos // block_size) * block_size + pos % block_size).view(-1)

    gathered = _workspace("gather", (b * padded, num_kv_heads, head_dim), k_cache.dtype, dev)
    kp = _workspace("k", (b, num_kv_heads, padded, head_dim), torch.float32, dev)
    vp = _workspace("v", (b, num_kv_heads, padded, head_dim), torch.float32, dev)
    torch.index_select(k_cache.view(-1, num_kv_heads, head_dim), 0, slots, out=gathered)
    kp.copy_(gathered.view(b, padded, num_kv_heads, head_dim).transpose(1, 2))
    torch.index_select(v_cache.view(-1, num_kv_heads, head_dim), 0, slots, out=gathered)
    vp.copy_(gathered.view(b, padded, num_kv_heads, head_dim).transpose(1, 2))

    rows_t = torch.tensor(rows, device=dev)
    qg = q.index_select(0, rows_t).view(b, num_kv_heads, group, head_dim).float() * scale
    scores = _workspace("scores", (b, num_kv_heads, group, padded), torch.float32, dev)
    torch.matmul(qg, kp.transpose(-1, -2), out=scores)
    if lens[-1] < padded:
        scores.masked_fill_(is_pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, vp)  # [b, num_kv_heads, group, head_dim]
    out.index_copy_(0, rows_t, o.view(b, num_heads, head_dim).to(out.dtype))


def _prefill_seq(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks_row: torch.Tensor,  # [max_num_blocks_per_seq]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    q_len = q.shape[0]
    nb = -(-seq_len // block_size)
    blocks = blocks_row[:nb].long()
    k = k_cache.index_select(0, blocks).view(nb * block_size, num_kv_heads, head_dim)[:seq_len]
    v = v_cache.index_select(0, blocks).view(nb * block_size, num_kv_heads, head_dim)[:seq_len]
    dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
    qi = q.transpose(0, 1).to(dtype)  # [num_heads, q_len, head_dim]
    ki = k.transpose(0, 1).to(dtype)  # [num_kv_heads, seq_len, head_dim]
    vi = v.transpose(0, 1).to(dtype)
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Row j sits at absolute position seq_len - q_len + j and sees keys [0, that].
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    md = attn_metadata
    if out is None:
        out = torch.empty_like(q)
    lens = md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens.tolist()
    if md.query_lens_cpu is not None:
        q_lens = md.query_lens_cpu
    else:
        cu = md.cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    block_size = k_cache.shape[1]

    # Any sequence with one query row takes the batched decode path, wherever it sits
    # (the runner puts them first, but nothing here depends on that).
    decode_ids: list[int] = []
    decode_rows: list[int] = []
    row = 0
    prefill: list[tuple[int, int, int]] = []  # (seq, first row, q_len)
    for i, ql in enumerate(q_lens):
        if ql == 1:
            decode_ids.append(i)
            decode_rows.append(row)
        elif ql > 0:
            prefill.append((i, row, ql))
        row += ql

    if decode_ids:
        row_of = dict(zip(decode_ids, decode_rows))
        for ids in _group_decode(decode_ids, lens, block_size):
            _decode_group(q, k_cache, v_cache, md.block_table, ids, [row_of[i] for i in ids],
                          [lens[i] for i in ids], scale, out)
    for i, r0, ql in prefill:
        out[r0:r0 + ql] = _prefill_seq(q[r0:r0 + ql], k_cache, v_cache, md.block_table[i], lens[i], scale)
    return out
