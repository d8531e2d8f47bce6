"""AWQ and GPTQ int4 weights in one layout, its pure-torch reference, and the GEMM on it.

    qweight  int32 [k/8, n]     word i of output column c holds inputs 8i .. 8i+7 of W[c]:
                                nibble j (bits 4j .. 4j+3) is the code of input 8i + j
                                (GPTQ's own packing; AWQ's, packed along n in the order
                                0 2 4 6 1 3 5 7, is repacked into it once at load)
    scales   [groups, n]        the checkpoint's dtype (fp16 usually)
    zeros    uint8 [groups, n]  0..15, the real zero point (GPTQ v1's stored zero - 1 is undone
                                at load; a symmetric checkpoint's zero is 8)
    g_idx    int32 [k] | None   act-order (GPTQ desc_act): the group of each input; None:
                                input i is in group i // group_size
    mins     fp16 [groups, n] | None   a float offset per group instead of an integer zero
                                (GGUF's Q4_1: w = d q + m); zeros is then None

    W[c, i] = (code[i, c] - zeros[g, c]) * scales[g, c],   g = g_idx[i] or i // group_size
    W[c, i] = code[i, c] * scales[g, c] + mins[g, c]       with mins

in fp32. A tensor-parallel shard is a slice of whole groups (worker/layers/hf_quantized.py).

GGUF's Q4_0 and Q4_1 blocks (32 weights, an fp16 d, Q4_1 an fp16 m) are this layout with
groups of 32 (``from_gguf_q4``): Q4_0's d (q - 8) is a zero of 8, Q4_1's d q + m a min, each
weight the gguf package's own fp32 value; on CUDA the GGUF's Q4 layers run on the same kernel.

``Int4Weight.linear`` runs ``x W^T + b``: on CUDA the Triton kernel (triton_int4_gemm.py:
each tile dequantized in registers, the packed words read once per tile); elsewhere the
whole weight is dequantized on every call and multiplied with F.linear, so the weight stays
4-bit in memory but a step costs the dequantization on top of the plain GEMM.

On CPU the checkpoints run on the GGUF kernel instead (``as_q4_1``, at load): with fp16
scales and groups a multiple of 32, each 32 inputs of a row are one Q4_1 block, w = d q + m
with d = scale and m = -scale x zero, so kernels/cpu_gguf.py's vector GEMM reads the same 5
bits a weight. Act-order weights have their inputs sorted by group first (PermutedInputs:
x's columns are gathered in that order on each call). m is rounded to fp16 (exact for a
symmetric zero of 8): each weight may move by up to 2^-11 of scale x zero from the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK = 8  # 4-bit codes per int32 word


class Int4Weight:
    """W [n, k] in the layout above."""

    __slots__ = ("qweight", "scales", "zeros", "g_idx", "group_size", "mins")
    qtype = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, group_size: int, mins: torch.Tensor | None = None) -> None:
        k8, n = qweight.shape
        offset = zeros if mins is None else mins  # exactly one of them
        if (zeros is None) == (mins is None):
            raise ValueError("int4 weight: give zeros or mins, not both.")
        if qweight.dtype != torch.int32 or (zeros is not None and zeros.dtype != torch.uint8):
            raise ValueError(f"int4 weight: qweight must be int32 and zeros uint8, got {qweight.dtype}, "
                             f"{offset.dtype}.")
        if scales.shape != offset.shape or scales.shape[1] != n:
            raise ValueError(f"int4 weight: scales {tuple(scales.shape)} and zeros {tuple(offset.shape)} must both "
                             f"be [groups, {n}].")
        if g_idx is None and scales.shape[0] != -(-k8 * PACK // group_size):
            raise ValueError(f"int4 weight: {scales.shape[0]} groups for k = {k8 * PACK} in groups of {group_size}.")
        if g_idx is not None and g_idx.shape != (k8 * PACK,):
            raise ValueError(f"int4 weight: g_idx {tuple(g_idx.shape)} must be [{k8 * PACK}].")
        self.qweight, self.scales, self.zeros, self.g_idx, self.group_size = qweight, scales, zeros, g_idx, group_size
        self.mins = mins

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    @property
    def k(self) -> int:
        return self.qweight.shape[0] * PACK

    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.zeros, self.g_idx, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> "Int4Weight":
        def move(t):
            return None if t is None else t.to(device)
        return Int4Weight(self.qweight.to(device), self.scales.to(device), move(self.zeros), move(self.g_idx),
                          self.group_size, move(self.mins))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cuda":
            from pagedserve.kernels.quant.triton_int4_gemm import int4_gemm_triton, triton

            if triton is not None:
                return int4_gemm_triton(x, self, bias)
        return F.linear(x, dequantize_int4(self).to(x.dtype), bias)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [k/8, n] -> the codes [k, n] (int32, 0..15), input-major."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    # An arithmetic shift sign-extends a word whose top nibble is >= 8; the mask drops it.
    return ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [k, n] (0..15, k a multiple of 8) -> int32 [k/8, n], the inverse of unpack_codes."""
    k, n = codes.shape
    if k % PACK:
        raise ValueError(f"int4 codes pack 8 inputs to a word; k = {k} is not a multiple of 8.")
    c = codes.to(torch.int64).reshape(k // PACK, PACK, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (c << shifts[None, :, None]).sum(1)  # the nibbles do not overlap: a sum is an or
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the unsigned word as int32 bits


def group_index(w: Int4Weight) -> torch.Tensor:
    """The group of each input, int64 [k]."""
    if w.g_idx is not None:
        return w.g_idx.long()
    return torch.arange(w.k, device=w.qweight.device) // w.group_size


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The reference: W [n, k] fp32."""
    g = group_index(w)
    codes = unpack_codes(w.qweight).float()
    if w.mins is not None:
        return (codes * w.scales[g].float() + w.mins[g].float()).t().contiguous()
    return ((codes - w.zeros[g].float()) * w.scales[g].float()).t().contiguous()


GGUF_Q4 = {"Q4_0": 18, "Q4_1": 20}  # type -> bytes of a block of 32 weights


def from_gguf_q4(rows: torch.Tensor, qtype: str, k: int) -> Int4Weight:
    """GGUF rows [n, k / 32 * block bytes] uint8 of Q4_0 or Q4_1 as an Int4Weight of groups of
    32: a block is d (fp16), Q4_1's m (fp16), then 16 bytes whose low nibbles are weights
    0..15 and high nibbles 16..31."""
    if qtype not in GGUF_Q4 or k % 32:
        raise ValueError(f"from_gguf_q4 takes Q4_0 or Q4_1 rows of whole blocks of 32, got {qtype}, k = {k}.")
    n, nb = rows.shape[0], k // 32
    blocks = rows.reshape(n, nb, GGUF_Q4[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
    qs = blocks[..., -16:].to(torch.int32)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)  # [n, k], input order
    qweight = pack_codes(codes.t().contiguous())
    scales = d.t().contiguous()
    if qtype == "Q4_0":
        zeros = torch.full((nb, n), 8, dtype=torch.uint8)
        return Int4Weight(qweight, scales, zeros, None, 32)
    m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, nb)
    return Int4Weight(qweight, scales, None, None, 32, mins=m.t().contiguous())


class PermutedInputs:
    """A GEMM on W with its inputs reordered: ``x W^T = x[:, perm] W'^T``, W' = W[:, perm].
    Act-order int4 sorted by group (``as_q4_1``) so that each group's inputs are adjacent."""

    __slots__ = ("inner", "perm")
    qtype = "Q4_1"

    def __init__(self, inner, perm: torch.Tensor) -> None:
        self.inner, self.perm = inner, perm

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.perm.numel() * self.perm.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from pagedserve.kernels import cpu_gguf

        return cpu_gguf.linear(x.index_select(-1, self.perm), self.inner, bias)


def as_q4_1(w: Int4Weight, alloc=None):
    """W as Q4_1 blocks for kernels/cpu_gguf.py (a GGUFWeight; act-order: its inputs sorted by
    group, a PermutedInputs), or None where that would change more than m's fp16 rounding
    (non-fp16 scales, groups not whole Q4_1 blocks) or the kernel is not built here."""
    from pagedserve.kernels import cpu_gguf

    if w.scales.dtype != torch.float16 or w.k % 32 or w.qweight.device.type != "cpu" or not cpu_gguf.available():
        return None
    n, k = w.n, w.k
    nb = k // 32
    codes = unpack_codes(w.qweight)  # [k, n]
    perm = None
    if w.g_idx is None:
        if w.group_size % 32:
            return None
        group = torch.arange(nb) * 32 // w.group_size  # the group of each block of 32 inputs
    else:
        g = w.g_idx.long()
        if bool((torch.bincount(g) % 32).any()):  # a group that is not whole blocks once sorted
            return None
        perm = torch.argsort(g, stable=True)
        codes, group = codes[perm], g[perm][::32]
    d = w.scales[group].t().contiguous()  # [n, nb] fp16, the checkpoint's scale as it is
    if w.mins is not None:
        m = w.mins[group].t().contiguous()
    else:
        m = (-(w.scales[group].float() * w.zeros[group].float())).t().half().contiguous()
    q = codes.t().to(torch.uint8).reshape(n, nb, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)  # ggml's Q4_1: byte j = input j (low), input j + 16 (high)
    raw = torch.cat([d.view(torch.uint8).view(n, nb, 2), m.view(torch.uint8).view(n, nb, 2), qs], -1)
    q4 = cpu_gguf.GGUFWeight([cpu_gguf.pack(raw.reshape(n, nb * 20), "Q4_1", k, alloc)])
    return q4 if perm is None else PermutedInputs(q4, perm)
