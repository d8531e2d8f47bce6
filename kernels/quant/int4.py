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

    W[c, i] = (code[i, c] - zeros[g, c]) * scales[g, c],   g = g_idx[i] or i // group_size

in fp32. A tensor-parallel shard is a slice of whole groups (worker/layers/hf_quantized.py).

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

    __slots__ = ("qweight", "scales", "zeros", "g_idx", "group_size")
    qtype = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor | None, group_size: int) -> None:
        k8, n = qweight.shape
        if qweight.dtype != torch.int32 or zeros.dtype != torch.uint8:
            raise ValueError(f"int4 weight: qweight must be int32 and zeros uint8, got {qweight.dtype}, {zeros.dtype}.")
        if scales.shape != zeros.shape or scales.shape[1] != n:
            raise ValueError(f"int4 weight: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both "
                             f"be [groups, {n}].")
        if g_idx is None and scales.shape[0] != -(-k8 * PACK // group_size):
            raise ValueError(f"int4 weight: {scales.shape[0]} groups for k = {k8 * PACK} in groups of {group_size}.")
        if g_idx is not None and g_idx.shape != (k8 * PACK,):
            raise ValueError(f"int4 weight: g_idx {tuple(g_idx.shape)} must be [{k8 * PACK}].")
        self.qweight, self.scales, self.zeros, self.g_idx, self.group_size = qweight, scales, zeros, g_idx, group_size

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    @property
    def k(self) -> int:
        return self.qweight.shape[0] * PACK

    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.zeros) + (() if self.g_idx is None else (self.g_idx,))
        return sum(t.numel() * t.element_size() for t in parts)

    def to(self, device: torch.device | str) -> "Int4Weight":
        g = None if self.g_idx is None else self.g_idx.to(device)
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), g, self.group_size)

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
    return ((codes - w.zeros[g].float()) * w.scales[g].float()).t().contiguous()


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
    m = (-(w.scales[group].float() * w.zeros[group].float())).t().half().contiguous()
    q = codes.t().to(torch.uint8).reshape(n, nb, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)  # ggml's Q4_1: byte j = input j (low), input j + 16 (high)
    raw = torch.cat([d.view(torch.uint8).view(n, nb, 2), m.view(torch.uint8).view(n, nb, 2), qs], -1)
    q4 = cpu_gguf.GGUFWeight([cpu_gguf.pack(raw.reshape(n, nb * 20), "Q4_1", k, alloc)])
    return q4 if perm is None else PermutedInputs(q4, perm)
