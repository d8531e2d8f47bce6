"""AWQ / GPTQ int4 and fp8 weights kept quantized (``--quantization awq | gptq | fp8``): what
the layers' weight loaders receive instead of a tensor, how tensor parallelism slices it,
and how a layer's slices become one packed weight (kernels/quant/).

    Int4Tensor   one checkpoint weight W [n, k] in Int4Weight's layout (the loader,
                 worker/loading/hf_quant_loader.py, repacks AWQ and undoes GPTQ v1's zeros)
    Fp8Tensor    one fp8 weight [n, k] and its scale per output row
    Int4Shards / Fp8Shards   what one layer collected, by first output row (q, k, v of a
                 fused QKV; gate, up), concatenated along the outputs by ``pack``

Slicing, as worker/layers/quantized.py does for GGUF blocks:

    by outputs (column-parallel)  any rows: each output row has its own scales
    by inputs (row-parallel)      int4: whole groups only; a slice that starts or ends
                                  inside a group is a startup error naming both. One group
                                  over all inputs (group_size -1) splits anywhere (each
                                  rank keeps the row's scale). Act-order keeps every group's
                                  scales and slices g_idx with the inputs.
                                  fp8: anywhere (the scale is per output row)
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant import Fp8Weight, Int4Weight
from pagedserve.kernels.quant.int4 import PACK
from pagedserve.worker.layers.quantized import QuantizedTensor


class Int4Tensor(QuantizedTensor):
    """A checkpoint's int4 weight W [n, k] (Int4Weight's fields, on the CPU, unpacked nowhere).
    ``per_channel``: the checkpoint's group_size is -1 (one group over all inputs, whatever
    k is), so an input slice may split it."""

    __slots__ = ("w", "per_channel")

    def __init__(self, w: Int4Weight, per_channel: bool = False) -> None:
        self.w, self.per_channel = w, per_channel

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.n, self.w.k

    def narrow(self, dim: int, start: int, size: int) -> "Int4Tensor":
        w = self.w
        if dim == 0:
            cols = slice(start, start + size)
            return Int4Tensor(Int4Weight(w.qweight[:, cols], w.scales[:, cols], w.zeros[:, cols], w.g_idx,
                                         w.group_size), self.per_channel)
        step = PACK if self.per_channel else w.group_size
        if start % step or size % step:
            raise ValueError(f"an int4 weight splits only at its groups of {w.group_size} inputs; this "
                             f"tensor-parallel shard takes inputs [{start}, {start + size}) of {w.k}.")
        words = slice(start // PACK, (start + size) // PACK)
        if w.g_idx is not None:  # act-order: any group may hold any input; keep them all
            return Int4Tensor(Int4Weight(w.qweight[words], w.scales, w.zeros, w.g_idx[start:start + size],
                                         w.group_size))
        if self.per_channel:
            return Int4Tensor(Int4Weight(w.qweight[words], w.scales, w.zeros, None, size), True)
        groups = slice(start // w.group_size, (start + size) // w.group_size)
        return Int4Tensor(Int4Weight(w.qweight[words], w.scales[groups], w.zeros[groups], None, w.group_size))


class Fp8Tensor(QuantizedTensor):
    """A checkpoint's fp8 weight [n, k] with its fp32 scale per output row."""

    __slots__ = ("weight", "scale")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def narrow(self, dim: int, start: int, size: int) -> "Fp8Tensor":
        if dim == 0:
            return Fp8Tensor(self.weight[start:start + size], self.scale[start:start + size])
        return Fp8Tensor(self.weight[:, start:start + size], self.scale)


class _OutputShards:
    """Slices of one layer's weight by the output row they start at; ``ordered`` checks they
    tile all ``rows`` rows (no vocabulary padding here: embeddings are never int4 / fp8)."""

    __slots__ = ("rows", "cols", "by_row")

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols, self.by_row = rows, cols, {}

    def add(self, row: int, t: QuantizedTensor, name: str) -> None:
        n, k = t.shape
        if k != self.cols or row + n > self.rows:
            raise ValueError(f"shape mismatch loading {name}: a ({n}, {k}) slice at row {row} of a "
                             f"({self.rows}, {self.cols}) weight.")
        self.by_row[row] = t

    def ordered(self) -> list:
        at, out = 0, []
        for row in sorted(self.by_row):
            if row != at:
                raise ValueError(f"rows [{at}, {row}) of a quantized weight were never loaded.")
            out.append(self.by_row[row])
            at = row + out[-1].shape[0]
        if at != self.rows:
            raise ValueError(f"rows [{at}, {self.rows}) of a quantized weight were never loaded.")
        return out


class Int4Shards(_OutputShards):
    __slots__ = ()

    def pack(self, alloc=None) -> Int4Weight:
        ws = [t.w for t in self.ordered()]
        first = ws[0]
        for w in ws[1:]:
            # Fused projections (q, k, v; gate, up) share their input, so GPTQ gives them one
            # act-order permutation; different ones cannot share an input-side layout.
            same_g = (w.g_idx is None) == (first.g_idx is None) and (w.g_idx is None or torch.equal(w.g_idx, first.g_idx))
            if w.group_size != first.group_size or not same_g:
                raise ValueError("the fused projections of one layer differ in int4 group size or act-order g_idx.")

        def cat(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(ts, 1).contiguous() if len(ts) > 1 else ts[0].contiguous()

        return Int4Weight(cat([w.qweight for w in ws]), cat([w.scales for w in ws]), cat([w.zeros for w in ws]),
                          None if first.g_idx is None else first.g_idx.contiguous(), first.group_size)


class Fp8Shards(_OutputShards):
    __slots__ = ()

    def pack(self, alloc=None) -> Fp8Weight:
        ts = self.ordered()
        return Fp8Weight(torch.cat([t.weight for t in ts]).contiguous(), torch.cat([t.scale for t in ts]).contiguous())


Int4Tensor.collector = Int4Shards
Fp8Tensor.collector = Fp8Shards
