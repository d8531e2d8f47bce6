"""Unified paged attention in Triton: one launch for a mixed prefill/decode batch.

Grid, one program per (query tile, KV head[, KV split]):

    q rows of seq i:  [ r0 .. r0+q_len )  cut into tiles of BLOCK_Q rows
    program rows:     BLOCK_M = BLOCK_Q x GROUP_PAD   (row m = query m // GROUP_PAD,
                                                       head kv_head*G + m % GROUP_PAD)

so the K/V tile a program loads serves every query head of its KV head (GQA) at once.
Tiles are numbered ``cu_seqlens_q[i] // BLOCK_Q + i + local tile``: an upper bound the
host computes without reading device memory (``num_tokens // BLOCK_Q + num_seqs``); a
program finds its sequence by binary search and exits if its tile is past the end.

Each program walks its context in TILE_N-token tiles, looking up the physical block
of every column (``block_table[seq, pos // BLOCK_SIZE]``, widened to int64 before
multiplying by the block stride: a 32,768-block pool of 16 x 8 x 128 fp16 passes 2^31
elements), with an online softmax in fp32 (exp2, scale folded with log2 e).

Split-KV (flash-decoding, ``SPLIT_KV``): for decode-only batches with few sequences
the context of each row is cut into num_splits ranges handled by separate programs,
each writing a normalised partial output and its log2-sum-exp; the reduce kernel in
triton_split_kv_reduce.py merges them.

Sliding window (``USE_WINDOW``, Gemma's local layers): a row at position p sees keys
(p - window, p]; a program starts at the tile holding its first row's earliest key and
loads nothing before it (a hybrid KV cache has freed those blocks). Soft-cap
(``USE_SOFTCAP``, Gemma 2): each score s becomes c tanh(s / c), in log2 units
(c log2 e), before the mask.

Quantised cache (``KV_QUANT``, kv_quant.py): K/V tiles load as 1-byte codes (fp8 e4m3 /
e5m2 or int8; every code is exact in fp16 and bf16) and are converted in registers to the
dot's dtype; the per-(token, head) scales (a byte each: the row's UE5M3 absmax code, its bits
placed in fp32's exponent and mantissa fields, times 1 / QMAX) multiply the score columns
(``q . s k = s (q . k)``) and the probability columns before the PV dot, never the
[TILE_N, HEAD_DIM] tiles.
"""


from __future__ import annotations

import torch

from pagedserve.kernels.kv_quant import AMAX_CODE_BIAS, INV_QMAX, SCALE_NAN, check_fp8_device, check_scales
from pagedserve.kernels.metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU box without triton: kernels/ still imports
    triton = None

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64

if triton is not None:
    # kv_quant's scale-code constants, as compile-time constants of the kernels
    _AMAX_CODE_BIAS = tl.constexpr(AMAX_CODE_BIAS)
    _SCALE_NAN = tl.constexpr(SCALE_NAN)

    @triton.jit
    def _find_seq_idx(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
        # Annotated (as vLLM does): older Triton rejects a loop-carried variable that
        # starts as a constexpr literal and becomes a tensor.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
            if first_tile <= tile_idx:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _tanh(x):
        # exp of -2|x| never overflows; the sign comes back after
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)

    @triton.jit
    def _load_scale(scale_ptr, idx, mask, INV_QMAX: tl.constexpr):
        """Scale codes at idx -> fp32 scales: the UE5M3 absmax (code bits placed at fp32's
        exponent and mantissa, 255 -> NaN) times 1 / QMAX. Masked lanes: code 0, a finite scale."""
        c = tl.load(scale_ptr + idx, mask=mask, other=0).to(tl.int32)
        a = ((c + _AMAX_CODE_BIAS) << 20).to(tl.float32, bitcast=True)
        return tl.where(c == _SCALE_NAN, float("nan"), a) * INV_QMAX

    # num_seqs / num_splits vary per step: no specialisation (a value of 1 would
    # otherwise become a constexpr and compile a second variant).
    @triton.jit(do_not_specialize=["num_seqs", "num_splits", "window"])
    def _paged_attention_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        q_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] uint8 absmax codes, contiguous (KV_QUANT only)
        v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] uint8 absmax codes, contiguous (KV_QUANT only)
        block_table_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
        seq_lens_ptr,  # [num_seqs] int32
        cu_seqlens_q_ptr,  # [num_seqs + 1] int32
        part_out_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32 (SPLIT_KV only)
        part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32, log2 units (SPLIT_KV only)
        scale_log2,  # softmax scale * log2(e)
        num_seqs,
        stride_q_tok, stride_q_head,
        stride_o_tok, stride_o_head,
        stride_k_blk, stride_k_tok, stride_k_head,
        stride_v_blk, stride_v_tok, stride_v_head,
        stride_bt_seq,
        num_splits,  # runtime, not constexpr: a new split count must not recompile
        window,  # a row sees its `window` newest keys (USE_WINDOW only)
        softcap_log2,  # soft-cap c * log2(e) (USE_SOFTCAP only)
        NUM_QUERIES_PER_KV: tl.constexpr,
        GROUP_PAD: tl.constexpr,  # next power of 2 of NUM_QUERIES_PER_KV
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD
        SPLIT_KV: tl.constexpr,
        FP32_DOT: tl.constexpr,  # fp32 inputs: exact ("ieee") dots, not tf32
        KV_QUANT: tl.constexpr,  # 1-byte K/V codes with per-(token, head) scales
        NUM_KV_HEADS: tl.constexpr,  # scale row stride (KV_QUANT only)
        INV_QMAX: tl.constexpr,  # 1 / QMAX of the cache's format, fp32 (KV_QUANT only)
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
    ):
        tile_idx = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = _find_seq_idx(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        q_tile = tile_idx - (q_start // BLOCK_Q + seq)
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens cached before this step's rows

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, TILE_N)
        q_pos = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # row within the sequence's chunk
        head = kv_head * NUM_QUERIES_PER_KV + offs_m % GROUP_PAD
        row_ok = (q_pos < q_len) & (offs_m % GROUP_PAD < NUM_QUERIES_PER_KV)
        d_ok = offs_d < HEAD_DIM
        tok = (q_start + q_pos).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_abs = context_len + q_pos  # absolute position: sees keys [0, q_abs]

        # Keys any row of this tile can see end at the last valid row's position.
        kv_end = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
        num_tiles = tl.cdiv(kv_end, TILE_N)
        # ... and, in a window, start at the first row's earliest key.
        if USE_WINDOW:
            kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
        else:
            kv_lo = 0
        first_tile = kv_lo // TILE_N
        if SPLIT_KV:
            per_split = tl.cdiv(num_tiles - first_tile, num_splits)
            tile_lo = first_tile + split * per_split
            tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        else:
            tile_lo = first_tile
            tile_hi = num_tiles

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
        for t in range(tile_lo, tile_hi):
            k_pos = t * TILE_N + offs_n
            k_ok = (k_pos < kv_end) & (k_pos >= kv_lo)
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            in_blk = k_pos % BLOCK_SIZE
            k_off = blk * stride_k_blk + in_blk * stride_k_tok + kv_head * stride_k_head
            k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                        mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
            if KV_QUANT:
                k = k.to(q.dtype)
                sc_row = (blk * BLOCK_SIZE + in_blk) * NUM_KV_HEADS + kv_head  # [TILE_N] scale index
                k_sc = _load_scale(k_scale_ptr, sc_row, k_ok, INV_QMAX)
            if FP32_DOT:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            if KV_QUANT:
                s = s * (k_sc * scale_log2)[None, :]
            else:
                s = s * scale_log2
            if USE_SOFTCAP:
                s = softcap_log2 * _tanh(s / softcap_log2)
            seen = (k_pos[None, :] <= q_abs[:, None]) & k_ok[None, :]
            if USE_WINDOW:
                seen = seen & (k_pos[None, :] > q_abs[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 then, not -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = blk * stride_v_blk + in_blk * stride_v_tok + kv_head * stride_v_head
            v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
            if KV_QUANT:
                # Dequantize V's rows, then the dot. Scaling P instead put p x scale in the
                # dot's dtype: with e5m2's tiny 1 / QMAX those products fell into fp16's
                # subnormals and lost their digits.
                v_sc = _load_scale(v_scale_ptr, sc_row, k_ok, INV_QMAX)
                v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        has_keys = l_i > 0.0
        acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if SPLIT_KV:
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            part_row = (tok * tl.num_programs(1) * NUM_QUERIES_PER_KV + head) * num_splits + split
            tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
            tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        else:
            tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_inputs(q, k_cache, v_cache, md: AttentionMetadata, out, k_scale=None, v_scale=None) -> bool:
    """Raises ValueError on a bad call; returns whether the cache is quantised."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim] and k_cache [num_blocks, block_size, "
                         f"num_kv_heads, head_dim]; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}.")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match in shape and strides.")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    if not quantized and (q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes must match: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}.")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}.")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({k_cache.shape[3]}) differ.")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or (out is not None and out.stride(2) != 1):
        raise ValueError("head_dim must be the contiguous (stride 1) dimension of q, out and the caches.")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype}; got {tuple(out.shape)} {out.dtype}.")
    num_seqs = md.seq_lens.shape[0]
    for name, t, ndim in (("block_table", md.block_table, 2), ("seq_lens", md.seq_lens, 1),
                          ("cu_seqlens_q", md.cu_seqlens_q, 1)):
        if t.dtype != torch.int32 or t.dim() != ndim or t.device != q.device:
            raise ValueError(f"{name} must be a {ndim}-D int32 tensor on {q.device}; got {t.dim()}-D {t.dtype} on {t.device}.")
    if md.cu_seqlens_q.shape[0] != num_seqs + 1 or md.block_table.shape[0] < num_seqs:
        raise ValueError(f"cu_seqlens_q needs num_seqs + 1 = {num_seqs + 1} entries (got {md.cu_seqlens_q.shape[0]}) "
                         f"and block_table >= {num_seqs} rows (got {md.block_table.shape[0]}).")
    if md.block_table.stride(1) != 1 or md.cu_seqlens_q.stride(0) != 1 or md.seq_lens.stride(0) != 1:
        raise ValueError("block_table rows, seq_lens and cu_seqlens_q must be contiguous.")
    return quantized


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int, device: torch.device) -> int:
    """Splits so that decode programs fill the GPU: none once there are >= 2 programs per
    SM (past that, splitting only adds the merge: batch 64 x 2048 ran slower split than
    unsplit; loadtest/kernel_checks/gpu_kernels.py measures it), else ~4 programs per SM with >= 4 tiles each."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    want = -(-4 * num_sms // programs)
    tiles = -(-max_seq_len // tile_n)
    n = max(1, min(want, tiles // 4, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)  # a power of 2: few variants of the reduce kernel


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # None: choose; > 1 only for decode-only batches
    tile_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # W: a row sees its W newest keys, itself included; None: all
    softcap: float | None = None,  # c: scores -> c * tanh(scores / c); None: off
) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch' on this machine.")
    md = attn_metadata
    quantized = _check_inputs(q, k_cache, v_cache, md, out, k_scale, v_scale)
    if quantized:
        check_fp8_device(k_cache.dtype, k_cache.device)
    else:
        k_scale = v_scale = k_cache  # unused pointers
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = md.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    decode_only = md.max_seqlen_q <= 1
    block_m = 16 if decode_only or md.max_seqlen_q < 64 else 64  # tl.dot wants >= 16 rows
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    if num_splits is None:
        longest = min(md.max_seq_len, sliding_window) if sliding_window else md.max_seq_len  # keys a row reads
        num_splits = choose_num_splits(num_seqs, num_kv_heads, longest, tile_n, q.device) if decode_only else 1
    if num_splits > 1 and not decode_only:
        raise ValueError("split-KV is only for decode-only batches (max_seqlen_q == 1).")
    num_splits = min(num_splits, MAX_SPLITS)
    head_dim_pad = _next_pow2(max(head_dim, 16))
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, k_scale, v_scale, md.block_table, md.seq_lens, md.cu_seqlens_q, part_out, part_lse,
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_table.stride(0), num_splits, int(sliding_window or 0), float(softcap or 0.0) * _LOG2E,
        NUM_QUERIES_PER_KV=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, BLOCK_Q=block_q, BLOCK_M=block_m,
        SPLIT_KV=split, FP32_DOT=q.dtype == torch.float32, KV_QUANT=quantized, NUM_KV_HEADS=num_kv_heads,
        INV_QMAX=INV_QMAX.get(k_cache.dtype, 0.0), USE_WINDOW=bool(sliding_window), USE_SOFTCAP=bool(softcap),
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        from pagedserve.kernels.triton_split_kv_reduce import split_kv_reduce

        split_kv_reduce(part_out, part_lse, out)
    return out
