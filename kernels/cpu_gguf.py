"""``y = x W^T + b`` on CPU with W kept in GGUF's quantized blocks (a C++ extension, AVX2 with
FMA and F16C, or scalar C++; built at worker start like cpu_gemm.py):

    Q8_0  Q4_0  Q4_1    blocks of 32 weights along a row: a scale d (and a min m), 8- or 4-bit q
    Q5_0  Q5_1          the same with 5-bit q (the fifth bits in a 32-bit mask): what llama.cpp's
                        K-quant presets write where a row is not whole super-blocks of 256
    Q4_K  Q5_K  Q6_K    super-blocks of 256: 8 sub-blocks of 32 (Q6_K: 16 of 16), each with a
                        scale (and a min) of 6 or 8 bits under the super-block's fp16 d (dmin)

A decode step at batch 1 reads every weight once, so its speed is the speed at which it reads
W: a Q4_1 weight is 5 bits where the fp32 copy is 32. The file's rows are repacked once at load,
eight rows to a group, so that each block position of the 8 rows is one run of bytes:

    file    row n: [blk 0][blk 1] ... [blk K/B-1]                  B weights a block
    packed  group g (rows 8g .. 8g+7), block b:
            [8 scales (f16)][8 mins (f16)] ... [q for weight k: 8 rows' q side by side]

so one 8-byte load holds one weight position of 8 rows: widened to 8 int32 lanes, converted to
fp32 and scaled, it is one 256-bit vector of 8 outputs' weights, and one FMA per row of x
adds it times the broadcast x[m, k] into 8 outputs' sums. A group's bytes are one stream from
memory; the groups are split over torch's intra-op threads. No byte is re-rounded: each row's
block holds the file's scales and quants (the K-quants' 6-bit scales unpacked to a byte each:
+2.8% for Q4_K, +2.3% for Q5_K; the other types keep the file's size). kernels/cpu_gguf.cpp
lays the packed blocks out byte by byte.

Up to 4 rows of x take the weights dequantized in registers, in one pass over the group: one
row (a decode step) sums q x unscaled per accumulator chain and multiplies by the scale once
a sub-block, 2 to 4 rows scale each weight vector once and feed it to every row. More rows
(a batch, a prefill) dequantize each group once into an fp32 strip (L1/L2), as the gguf
package's ``dequantize`` computes each weight (d q, (d sc) q, then + m), and run fp32 tiles
of 8 rows over it, 64 rows of x at a time, at about the speed of torch's own GEMM on the
dequantized weight (there the FMAs, not the bytes, are the cost). In registers a min (Q4_1's
m, the K-quants' dmin mn, and Q4_0's and Q5_0's offsets as 8 d and 16 d) multiplies the sum of x
over its 32 weights, once a block, instead of every weight. Without AVX2 each row is dequantized (scalar C++) and dotted. Results differ
from ``F.linear`` on the dequantized weight in rounding only (~1e-7 of sum |w x|).

int8 activations (``GGUFWeight.int8``; every type here, with AVX2), as llama.cpp computes
them: each row of x is quantized per 32 values (dx = max|x| / 127, qx = round(x / dx)),
and a block's dot is an integer sum of q_w qx (``maddubs``: 32 products in a few instructions
where the fp32 path converts and multiplies each weight), times d_w dx (the K-quants: per
sub-block, d sc dx); a min (Q4_1's m, the K-quants' dmin mn) multiplies the fp32 sum of x. For every number of rows of x (the weight bytes of a group, shuffled
so that each row's pairs of weights sit side by side, are reused by 4 rows at a time). The error
is x's rounding: ~1e-3 of sum |w x| (tests/test_gguf_int8.py measures the model's next-token KL).
On a CPU with AVX-512 VNNI (and VL, VBMI: Intel Ice Lake and later servers, AMD Zen 4 and later)
the int8 kernels are kernels/cpu_gguf_vnni.h's instead: ``dpbusd`` sums four u8 x s8 products into
int32 in one instruction, on the same packed bytes (one byte permutation a 32-byte load), with
bit-identical results; ``isa()`` says which (``loadtest.kernel_checks.cpu_gguf`` times both).
"""

from __future__ import annotations

from typing import Callable

import torch

from .cpu_build import LazyExtension, read_source

# GGUF type name -> ggml's type id (what the extension takes)
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# GGUF type name -> (weights a block, bytes of one row's block in the file)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
GROUP = 8  # output rows a packed group interleaves (one 256-bit vector of fp32 outputs)
# The types whose kernels can multiply int8 activations (GGUFWeight.int8; AVX2 builds).
INT8_QTYPES = tuple(QTYPES)

_EXT = LazyExtension("pagedserve_cpu_gguf_v2", read_source("cpu_gguf.cpp"),
                     # -ffp-contract=off: the scalar dequantization rounds each product as numpy
                     # does (the vector paths use explicit FMAs where they want them)
                     ["-O3", "-march=native", "-ffp-contract=off"],
                     "CPU GGUF GEMM", "GGUF weights are dequantized to fp32 at load")

# shape, dtype -> a new tensor for the packed weights (the worker passes one in huge pages)
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def available() -> bool:
    return _EXT.get() is not None


def isa() -> str:
    """The vector path the extension was built with: "avx512vnni" (the int8 kernels on AVX-512
    VNNI, the fp32 ones on AVX2), "avx2" or "scalar"."""
    return _EXT.get().isa()


def borrow_cores(cores: list[int], idle: bool = True, nice: int = 19, spin_us: int = 200) -> int:
    """GEMMs on GGUF weights also run on ``cores``, one helper thread each, at SCHED_IDLE
    (``idle``) or at ``nice``: they take chunks of each GEMM in the time those cores leave
    idle, and the calling thread never waits for one that is preempted (cpu_borrowed_cores.h).
    A helper spins ``spin_us`` after a GEMM before it sleeps. An empty list stops them.
    Returns how many run (0 without the extension)."""
    ext = _EXT.get()
    return ext.borrow_cores(list(cores), idle, nice, spin_us) if ext is not None else 0


def borrowed_cores() -> list[int]:
    """The cores helpers run on now."""
    ext = _EXT.get()
    return list(ext.borrowed_cores()) if ext is not None else []


def borrowed_counts() -> tuple[int, int]:
    """(chunks the helpers computed, chunks the caller took back from a helper that did not run)."""
    ext = _EXT.get()
    return tuple(ext.borrowed_counts()) if ext is not None else (0, 0)


def packed_shape(qtype: str, n: int, k: int) -> tuple[int, int, int]:
    block = BLOCKS[qtype][0]
    if k % block:
        raise ValueError(f"a {qtype} row holds whole blocks of {block} weights; K = {k} does not.")
    return -(-n // GROUP), k // block, _EXT.get().format(QTYPES[qtype])[2]


class GGUFPart:
    """Rows [offset, offset + n) of W, K columns, in one GGUF type's packed groups."""

    __slots__ = ("qtype", "qid", "n", "k", "packed")

    def __init__(self, qtype: str, n: int, k: int, packed: torch.Tensor) -> None:
        self.qtype, self.qid, self.n, self.k, self.packed = qtype, QTYPES[qtype], n, k, packed

    def nbytes(self) -> int:
        return self.packed.numel()


class GGUFWeight:
    """W [N, K] as consecutive row ranges, each a GGUFPart (a fused projection whose pieces
    come in different types, e.g. a Q4_K_M file's Q4_K q, k and Q6_K v, is several parts)."""

    __slots__ = ("parts", "n", "k", "int8")

    def __init__(self, parts: list[GGUFPart], int8: bool = False) -> None:
        """``int8``: rows of x quantized to int8 where the kernel has that path (module doc)."""
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("a GGUFWeight needs parts of one K.")
        self.parts, self.n, self.k = list(parts), sum(p.n for p in parts), parts[0].k
        self.int8 = int8

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def qtypes(self) -> list[str]:
        return [p.qtype for p in self.parts]


def pack(raw: torch.Tensor,  # [N, K / block * block bytes] uint8: the file's rows, in order
         qtype: str, k: int, alloc: Alloc | None = None) -> GGUFPart:
    if qtype not in QTYPES:
        raise ValueError(f"no GGUF kernel for {qtype}; supported: {', '.join(QTYPES)}.")
    raw = raw.contiguous()
    shape = packed_shape(qtype, raw.shape[0], k)
    out = alloc(shape, torch.uint8) if alloc is not None else torch.empty(shape, dtype=torch.uint8)
    _EXT.get().pack(raw, QTYPES[qtype], k, out)
    return GGUFPart(qtype, raw.shape[0], k, out)


def dequantize_rows(w: GGUFWeight,
                    ids: torch.Tensor) -> torch.Tensor:  # [n] int64 row ids -> [n, K] fp32
    """Rows ``ids`` of W in fp32, as the gguf package's ``dequantize`` computes them."""
    ids = ids.reshape(-1).to(torch.int64)
    if len(w.parts) == 1:
        out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
        _EXT.get().dequantize_rows(out, w.parts[0].packed, w.parts[0].qid, ids.contiguous())
        return out
    out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
    start = 0
    for p in w.parts:
        sel = ((ids >= start) & (ids < start + p.n)).nonzero().view(-1)
        if sel.numel():
            rows = torch.empty((sel.numel(), w.k), dtype=torch.float32)
            _EXT.get().dequantize_rows(rows, p.packed, p.qid, (ids[sel] - start).contiguous())
            out[sel] = rows
        start += p.n
    return out


def linear(x: torch.Tensor,  # [..., K], any float dtype (computed in fp32)
           w: GGUFWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., N], x's dtype
    if x.dim() == 2 and x.dtype == torch.float32 and len(w.parts) == 1 and x.stride(-1) == 1 \
            and (bias is None or bias.dtype == torch.float32):  # a layer of the fp32 engine: one call
        p = w.parts[0]
        return _EXT.get().linear(x, p.packed, p.qid, w.n, bias, w.int8)
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, w.n), dtype=torch.float32)
    b32 = bias.float() if bias is not None and bias.dtype != torch.float32 else bias
    if m:
        mod, start = _EXT.get(), 0
        for p in w.parts:  # a part's columns of out: rows ldy apart, as the kernel takes them
            mod.gemm(out[:, start:start + p.n], x2, p.packed, p.qid, None if b32 is None else b32[start:start + p.n],
                     w.int8)
            start += p.n
    out = out.view(*lead, w.n)
    return out if dtype == torch.float32 else out.to(dtype)
