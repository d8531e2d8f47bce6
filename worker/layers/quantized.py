"""GGUF weights kept quantized (``--quantization gguf``): what the layers' weight loaders
receive instead of a tensor, and how a layer turns its shards into the kernel's layout.

    QuantTensor      one 2-D weight as the file holds it: rows of blocks, [rows, row bytes]
                     uint8, with its GGML type and its shape in weights
    QuantShards      what one layer collected: {first row: QuantTensor}, one entry a
                     checkpoint tensor (q, k, v of a fused QKV; gate, up), this rank's rows
    finish_quantized(model)   every layer's shards packed (kernels/cpu_gguf.py), each run of
                              same-type shards as one part; the plain fp32 weight dropped

On CUDA (no GPU kernel for most GGML types) a linear layer whose shards are all Q4_0 or all
Q4_1 becomes an Int4Weight of groups of 32 (kernels/quant/int4.py: the Triton int4 GEMM);
every other layer, and every embedding table, is dequantized at load to the model's dtype,
as --quantization none would load it.

A row of blocks is whole: a TP slice by rows (column-parallel, vocab-parallel) takes whole
rows; a slice by columns (row-parallel) takes whole blocks, and a split inside a block is a
startup error. Llama's q/k rows are permuted for rope at load (gguf_loader.py): a permutation
of whole rows, done on the blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels.cpu_gguf import BLOCKS, GGUFWeight, pack


class QuantizedTensor:
    """A weight a loader receives still quantized: ``shape`` (out, in), ``narrow`` takes a
    tensor-parallel slice, and the class's ``collector`` gathers one layer's slices and
    packs them (QuantShards here; worker/layers/hf_quantized.py for AWQ, GPTQ and fp8)."""

    __slots__ = ()
    collector: type


class QuantTensor(QuantizedTensor):
    """A 2-D GGUF weight, [rows, row bytes] uint8 (a numpy view of the file or a torch tensor)."""

    __slots__ = ("qtype", "shape", "data")

    def __init__(self, qtype: str, shape: tuple[int, int], data: Any) -> None:
        self.qtype, self.shape, self.data = qtype, (int(shape[0]), int(shape[1])), data

    def narrow(self, dim: int, start: int, size: int) -> "QuantTensor":
        if dim == 0:
            return QuantTensor(self.qtype, (size, self.shape[1]), self.data[start:start + size])
        block, block_bytes = BLOCKS[self.qtype]
        if start % block or size % block:
            raise ValueError(f"a {self.qtype} weight splits only at its blocks of {block} columns; this "
                             f"tensor-parallel shard takes columns [{start}, {start + size}).")
        b0 = start // block * block_bytes
        return QuantTensor(self.qtype, (self.shape[0], size), self.data[:, b0:b0 + size // block * block_bytes])

    def rows_tensor(self) -> torch.Tensor:
        """The rows as a contiguous uint8 tensor of our own (a copy of the file's bytes)."""
        if isinstance(self.data, torch.Tensor):
            return self.data.contiguous()
        import numpy as np

        return torch.from_numpy(np.array(self.data))  # a copy: the file is mapped read-only


class QuantShards:
    """The QuantTensors one layer received, by the row of its weight they start at."""

    __slots__ = ("rows", "cols", "by_row")

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols, self.by_row = rows, cols, {}

    def add(self, row: int, t: QuantTensor, name: str) -> None:
        if t.shape[1] != self.cols or row + t.shape[0] > self.rows:
            raise ValueError(f"shape mismatch loading {name}: a {t.shape} slice at row {row} of a "
                             f"({self.rows}, {self.cols}) weight.")
        self.by_row[row] = t

    def pack_cuda(self, gemm: bool) -> Any:
        """For a CUDA model: an Int4Weight when ``gemm`` (a linear layer's weight) and every
        shard is Q4_0, or every shard Q4_1; else the weight dequantized to fp32 [rows, cols]
        (rows nothing covered, a vocab shard's padding, are zeros)."""
        from pagedserve.kernels.quant.int4 import GGUF_Q4, from_gguf_q4

        qtypes = {t.qtype for t in self.by_row.values()}
        covered = sum(t.shape[0] for t in self.by_row.values())
        if gemm and len(qtypes) == 1 and next(iter(qtypes)) in GGUF_Q4 and covered == self.rows:
            ordered = [self.by_row[r] for r in sorted(self.by_row)]
            rows = torch.cat([t.rows_tensor() for t in ordered]) if len(ordered) > 1 else ordered[0].rows_tensor()
            return from_gguf_q4(rows, ordered[0].qtype, self.cols)
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = torch.zeros((self.rows, self.cols), dtype=torch.float32)
        for row, t in self.by_row.items():  # the gguf package's own fp32 values (no C++ build on a GPU node)
            w = dequantize(t.rows_tensor().numpy(), GGMLQuantizationType[t.qtype])
            out[row:row + t.shape[0]] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        return out

    def pack(self, alloc=None) -> GGUFWeight:
        """One part a run of same-type shards (rows in order); rows nothing covered (a
        vocab shard's padding) are zero blocks, which dequantize to 0."""
        parts, run, at = [], [], 0
        qtype = None

        def flush() -> None:
            if run:
                rows = torch.cat([t.rows_tensor() for t in run]) if len(run) > 1 else run[0].rows_tensor()
                parts.append(pack(rows, run[0].qtype, self.cols, alloc))
                run.clear()

        for row in sorted(self.by_row):
            t = self.by_row[row]
            if row != at:
                raise ValueError(f"rows [{at}, {row}) of a quantized weight were never loaded.")
            if t.qtype != qtype:
                flush()
                qtype = t.qtype
            run.append(t)
            at = row + t.shape[0]
        if at < self.rows:  # padding rows (the last vocab shard): zero blocks of the last type
            block, block_bytes = BLOCKS[qtype]
            zeros = torch.zeros((self.rows - at, self.cols // block * block_bytes), dtype=torch.uint8)
            run.append(QuantTensor(qtype, (self.rows - at, self.cols), zeros))
        flush()
        return GGUFWeight(parts)


QuantTensor.collector = QuantShards


def take_quant(module: nn.Module, param: nn.Parameter, row: int, loaded: Any, name: str) -> bool:
    """If ``loaded`` is a QuantizedTensor, keep it on ``module`` (rows from ``row`` of ``param``)
    and say so; the weight loaders then leave the plain parameter untouched."""
    if not isinstance(loaded, QuantizedTensor):
        return False
    shards = module.__dict__.get("_quant_shards")
    if shards is None:
        shards = module._quant_shards = loaded.collector(param.shape[0], param.shape[1])
    elif not isinstance(shards, loaded.collector):
        raise ValueError(f"loading {name}: one layer's weights come in two quantized formats.")
    shards.add(row, loaded, name)
    return True


def finish_quantized(model: nn.Module, alloc=None, device_type: str | None = None) -> dict[str, int]:
    """Pack every layer's QuantShards (its GEMM and, for an embedding, its row gather then use
    the blocks) and drop the plain weights they replace. A tied LM head shares its embedding's
    packed weight. ``device_type``: where the layers run ("cpu", "cuda"; None: each weight's
    own device). Returns {type: bytes} of what was packed (GGML types; "int4", "fp8")."""
    packed: dict[int, GGUFWeight] = {}  # id(the plain parameter) -> its packed blocks
    sizes: dict[str, int] = {}
    done: set[int] = set()
    for module in model.modules():
        shards = module.__dict__.pop("_quant_shards", None)
        if shards is None:
            continue
        if (device_type or module.weight.device.type) == "cuda" and isinstance(shards, QuantShards):
            w = shards.pack_cuda(gemm=hasattr(module, "_packed"))  # a GEMM's weight: linear layers, LM heads
            if isinstance(w, torch.Tensor):  # dequantized: the plain weight, as --quantization none
                module.weight.data = w.to(module.weight.device, module.weight.dtype)
                continue
        else:
            w = shards.pack(alloc)
        if hasattr(w, "to"):  # int4 / fp8 (kernels/quant/): to the layer's device; GGUF runs on CPU
            w = w.to(module.weight.device)
        for p in getattr(w, "parts", (w,)):
            sizes[p.qtype] = sizes.get(p.qtype, 0) + p.nbytes()
        packed[id(module.weight)] = w
        module.quantize_with(w)
        done.add(id(module))
    for module in model.modules():  # a tied LM head: its weight is the embedding's parameter
        if id(module) not in done and hasattr(module, "quantize_with") and id(getattr(module, "weight", None)) in packed:
            module.quantize_with(packed[id(module.weight)])
            done.add(id(module))
    for module in model.modules():  # the fp32 parameters are no longer read
        if id(module) in done and module.weight.numel():
            # 0 elements keep .dtype and .device answering; untouched pages never became memory
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
    return sizes
