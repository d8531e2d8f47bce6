"""Fast pure-torch paged attention: the CPU path (``backend="torch"``).

Same contract as ``paged_attention_ref`` (see attention_ref.py for the row layout), but
built for a 2-core CPU where memory traffic, not flops, sets the time:

* Decode rows (query length 1) are batched. Sequences are sorted by length and cut into
  groups whose padded length wastes at most ~25% of the gathered K/V. Each group's K
  (and V) is one ``index_select`` of [head_dim] rows from the cache viewed as
  [-1, head_dim], landing directly in ``[B, num_kv_heads, L, head_dim]``, so both
  matmuls are plain batched GEMMs (indexing a non-leading dim of a permuted cache view
  is far slower, and a slot gather plus a permute copy is slower too). GQA is a reshape of q
  to ``[B, num_kv_heads, group, head_dim]``: K/V are never repeated.
* The index tensors (which cache rows each group reads) depend only on the step's
  metadata: the first layer builds them (``_plan``) and the other layers reuse them.
* Gather buffers are reused across calls (``_workspace``): a fresh 100 MB
  tensor per layer costs more in page faults than the copy itself (several times more).
  Groups are split into chunks of at most ``_CHUNK_TOKENS`` tokens so the buffers stay
  small and the gathered K/V are still in cache when the matmul reads them.
* Prefill/chunk rows go one sequence at a time through the fused C++ loop as one row group
  (cpu_decode_attention.py: what verifies drafts; row j of a chunk is a decode row of
  length seq_len - q_len + j + 1), faster than SDPA at prompt lengths; where that loop
  cannot run (bf16/fp16 q, no extension), through ``F.scaled_dot_product_attention``
  (``enable_gqa``), ``is_causal`` when the chunk is the whole context, an explicit
  offset-causal mask otherwise.

Decode math runs in fp32 (bf16/fp16 K/V are gathered, then converted in one copy); prefill runs
the fused loop in fp32, SDPA in bf16 (CPU SDPA accumulates bf16 in fp32), and upcasts fp16.
A quantised cache (kv_quant.py): decode gathers the 1-byte values and their scales with the
same row index (a scale sits at [slot, head], a value row at [slot, head, :]), converts the
values in the same one copy, and applies the scales to the scores and the probabilities;
prefill dequantises the sequence's K/V into the SDPA dtype.
A sliding-window layer (``sliding_window`` W) gathers each decode row's W newest keys only
(its own plan, kept beside the full layers' one), and the prefill paths mask past the window
and read no block before it; Gemma 2's ``softcap`` bends the scores (c * tanh(s / c)) before
the mask, on every path.
Not thread-safe: the workspace is shared per process, like the model runner that calls it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_decode_attention import decode_attention_cpu
from pagedserve.kernels.kv_quant import check_scales, dequantize_rows, row_scales
from pagedserve.kernels.metadata import AttentionMetadata

# Decode groups are padded to their longest member; a sequence joins the current group
# while its length is at least this fraction of the group's padded length.
_GROUP_FILL = 0.75
# Upper bound on tokens gathered per decode chunk (per K or V buffer).
_CHUNK_TOKENS = 8192  # 4k-8k beat 16k-64k at batch 256 (cache reuse)

_WORKSPACE: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = math.prod(shape)
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first made under inference_mode (the engine): an
        # inference tensor could not be written to by a later caller outside it.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel].view(shape)


def _gather(cache: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """cache rows (as [-1, head_dim]) -> fp32 workspace of `shape`; one pass for fp32."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.float32:
        return torch.index_select(flat, 0, rows, out=_workspace(name, shape, torch.float32, cache.device).view(-1, shape[-1])).view(shape)
    low = torch.index_select(flat, 0, rows, out=_workspace("low", shape, cache.dtype, cache.device).view(-1, shape[-1]))
    return _workspace(name, shape, torch.float32, cache.device).copy_(low.view(shape))


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


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [b] q/out row of each sequence
    kv_rows: torch.Tensor  # [b * num_kv_heads * padded] rows of a cache viewed as [-1, head_dim]
    is_pad: torch.Tensor | None  # [b, padded] bool; None when every sequence fills `padded`
    padded: int  # longest context in the group


@dataclass(slots=True)
class _StepPlan:
    """Everything about one step's batch that does not depend on the layer."""

    key: tuple
    md_ref: weakref.ref
    decode: list[_DecodeGroup]
    # (seq, first row, q_len, seq_len, each row's length, the rows as one group) per prefill
    prefill: list[tuple[int, int, int, int, torch.Tensor, torch.Tensor]]


# One plan per step, built by the first layer and reused by the others (the index
# tensors are a large share of a decode call at big batches when rebuilt per layer);
# the sliding-window layers' plan (their decode rows gather only the window) beside it.
_PLAN: _StepPlan | None = None
_WINDOW_PLAN: _StepPlan | None = None


def _build_decode_group(block_table: torch.Tensor, ids: list[int], rows: list[int], lens: list[int],
                        block_size: int, num_kv_heads: int, starts: list[int] | None = None) -> _DecodeGroup:
    """``lens``: the tokens each sequence reads; ``starts``: the position of its first
    (a sliding window's start; None: every sequence from position 0)."""
    dev = block_table.device
    b = len(ids)
    padded = lens[0]  # longest first; token-level gather, so no rounding up to blocks
    if starts is None:
        nb = -(-padded // block_size)
        blocks = block_table.index_select(0, torch.tensor(ids, device=dev))[:, :nb].long()  # [b, nb]
    else:
        blocks = block_table.index_select(0, torch.tensor(ids, device=dev)).long()  # [b, width]
    lens_t = torch.tensor(lens, device=dev)
    # Token-level index. Padding positions (past a sequence's length, including the
    # unwritten tail of its last block) read the sequence's own token 0 (its window's first):
    # cache memory that was never written may hold NaN, and 0 * NaN in the PV matmul is NaN.
    pos = torch.arange(padded, device=dev).expand(b, padded)
    is_pad = pos >= lens_t[:, None]  # [b, padded]
    pos = pos.masked_fill(is_pad, 0)
    if starts is not None:
        pos = pos + torch.tensor(starts, device=dev)[:, None]
    slots = blocks.gather(1, pos // block_size) * block_size + pos % block_size  # [b, padded]
    # Rows of the cache viewed as [num_slots * num_kv_heads, head_dim], ordered so one
    # index_select lands in [b, num_kv_heads, padded, head_dim] (a slot gather followed
    # by a permute copy is slower: an extra pass over the gathered K/V).
    kv_rows = (slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=dev)[None, :, None]).view(-1)
    return _DecodeGroup(torch.tensor(rows, device=dev), kv_rows, is_pad if lens[-1] < padded else None, padded)


def _plan(md: AttentionMetadata, block_size: int, num_kv_heads: int, first_seq: int = 0,
          window: int | None = None) -> _StepPlan:
    """``first_seq``: sequences before it were already handled (by the fused decode kernel).
    ``window``: a sliding-window layer's plan (each decode row gathers its W newest keys)."""
    global _PLAN, _WINDOW_PLAN
    cached = _WINDOW_PLAN if window else _PLAN
    lens = md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens.tolist()
    if md.query_lens_cpu is not None:
        q_lens = md.query_lens_cpu
    else:
        cu = md.cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    key = (id(md.block_table), tuple(lens), tuple(q_lens), block_size, num_kv_heads, first_seq, window)
    if cached is not None and cached.md_ref() is md and cached.key == key:
        return cached
    # Any sequence with one query row takes the batched decode path, wherever it sits
    # (the runner puts them first, but nothing here depends on that).
    row_of: dict[int, int] = {}
    prefill: list[tuple[int, int, int, int, torch.Tensor, torch.Tensor]] = []
    row = 0
    for i, ql in enumerate(q_lens):
        if i < first_seq:
            pass
        elif ql == 1:
            row_of[i] = row
        elif ql > 0:
            dev = md.block_table.device
            prefill.append((i, row, ql, lens[i],
                            torch.arange(lens[i] - ql + 1, lens[i] + 1, dtype=torch.int32, device=dev),
                            torch.tensor([0, ql], dtype=torch.int32, device=dev)))
        row += ql
    if window:
        starts = [max(0, n - window) for n in lens]
        reads = [n - s for n, s in zip(lens, starts)]
        decode = [
            _build_decode_group(md.block_table, ids, [row_of[i] for i in ids], [reads[i] for i in ids], block_size,
                                num_kv_heads, [starts[i] for i in ids])
            for ids in _group_decode(list(row_of), reads, block_size)
        ]
        _WINDOW_PLAN = _StepPlan(key, weakref.ref(md), decode, prefill)
        return _WINDOW_PLAN
    decode = [
        _build_decode_group(md.block_table, ids, [row_of[i] for i in ids], [lens[i] for i in ids], block_size,
                            num_kv_heads)
        for ids in _group_decode(list(row_of), lens, block_size)
    ]
    _PLAN = _StepPlan(key, weakref.ref(md), decode, prefill)
    return _PLAN


def _gather_scales(scales: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...], name: str,
                   dtype: torch.dtype) -> torch.Tensor:
    """absmax codes (as [-1]) at the same rows as the values -> fp32 scales [b, num_kv_heads, 1, padded]
    of a ``dtype`` cache."""
    b, kvh, padded, _ = shape
    codes = torch.index_select(scales.view(-1), 0, rows, out=_workspace(name + "_s8", (rows.numel(),), scales.dtype,
                                                                         scales.device))
    return row_scales(codes, dtype).view(b, kvh, 1, padded)


def _decode_group(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    g: _DecodeGroup,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    b = g.rows.shape[0]
    shape = (b, num_kv_heads, g.padded, head_dim)
    kp = _gather(k_cache, g.kv_rows, shape, "k")
    vp = _gather(v_cache, g.kv_rows, shape, "v")
    qg = q.index_select(0, g.rows).view(b, num_kv_heads, group, head_dim).float() * scale
    scores = _workspace("scores", (b, num_kv_heads, group, g.padded), torch.float32, q.device)
    torch.matmul(qg, kp.transpose(-1, -2), out=scores)
    if k_scale is not None:
        scores.mul_(_gather_scales(k_scale, g.kv_rows, shape, "k", k_cache.dtype))
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    if g.is_pad is not None:
        scores.masked_fill_(g.is_pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if v_scale is not None:
        probs.mul_(_gather_scales(v_scale, g.kv_rows, shape, "v", v_cache.dtype))
    o = torch.matmul(probs, vp)  # [b, num_kv_heads, group, head_dim]
    out.index_copy_(0, g.rows, o.view(b, num_heads, head_dim).to(out.dtype))


def _prefill_seq(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks_row: torch.Tensor,  # [max_num_blocks_per_seq]
    seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    q_len = q.shape[0]
    nb = -(-seq_len // block_size)
    # A window: keys from the first row's window on, whole blocks (those before may be freed).
    b0 = max(0, seq_len - q_len - window + 1) // block_size if window else 0
    lo = b0 * block_size  # the absolute position of the first key read
    blocks = blocks_row[b0:nb].long()
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - lo]
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - lo]
    dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
    if softcap:
        dtype = torch.float32  # the explicit softmax below runs in fp32
    if k_scale is not None:
        k = dequantize_rows(k, k_scale.index_select(0, blocks).view(-1, num_kv_heads)[:seq_len - lo], dtype)
        v = dequantize_rows(v, v_scale.index_select(0, blocks).view(-1, num_kv_heads)[:seq_len - lo], dtype)
    # 4-D [1, heads, len, head_dim]: CPU SDPA takes its flash kernel only for 4-D inputs;
    # 3-D ones fall back to the math path, which is slower at prompt lengths.
    qi = q.transpose(0, 1).to(dtype)[None]  # [1, num_heads, q_len, head_dim]
    ki = k.transpose(0, 1).to(dtype)[None]  # [1, num_kv_heads, seq_len, head_dim]
    vi = v.transpose(0, 1).to(dtype)[None]
    if q_len == seq_len and not window and not softcap:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Row j sits at absolute position seq_len - q_len + j and sees keys [0, that]
        # (with a window, (that - W, that]); key column c is absolute position lo + c.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(lo, seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        if softcap:
            group = q.shape[1] // num_kv_heads
            ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
            scores = torch.matmul(qi, ki.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            o = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), vi)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # W: a row sees its W newest keys (attention_ref.py); None: all
    softcap: float | None = None,  # c: scores -> c * tanh(scores / c); None: off
) -> torch.Tensor:
    md = attn_metadata
    window = sliding_window or None
    check_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    # Leading decode rows (one per sequence, as the runner lays them out) go through the
    # fused C++ loop when it is available: it reads each K/V row once instead of three times.
    nd = md.num_decode_tokens
    whole = nd == q.shape[0] == md.block_table.shape[0] == md.seq_lens.shape[0]  # no slices to take
    if nd and md.max_seqlen_q >= 1 and decode_attention_cpu(
            q if whole else q[:nd], k_cache, v_cache, md.block_table if whole else md.block_table[:nd],
            md.seq_lens if whole else md.seq_lens[:nd], scale, out if whole else out[:nd], k_scale, v_scale,
            md.decode_row_groups, sliding_window=window, softcap=softcap):
        if nd == q.shape[0]:
            return out
    else:
        nd = 0
    plan = _plan(md, k_cache.shape[1], k_cache.shape[2], first_seq=nd, window=window)
    for g in plan.decode:
        _decode_group(q, k_cache, v_cache, g, scale, out, k_scale, v_scale, softcap)
    for i, r0, ql, seq_len, row_lens, group in plan.prefill:
        # A chunk's rows are a verify group as long as the chunk: the fused loop reads each
        # K/V block once for all of them, each row up to its own position (causal).
        if not decode_attention_cpu(q[r0:r0 + ql], k_cache, v_cache, md.block_table[i:i + 1], row_lens, scale,
                                    out[r0:r0 + ql], k_scale, v_scale, group, sliding_window=window, softcap=softcap):
            out[r0:r0 + ql] = _prefill_seq(q[r0:r0 + ql], k_cache, v_cache, md.block_table[i], seq_len, scale,
                                           k_scale, v_scale, window, softcap)
    return out
