"""Tensor-parallel linear layers (Megatron style), each parameter with a weight loader.

    ColumnParallelLinear      W [out, in] split by rows:    rank r holds W[r*out/tp : (r+1)*out/tp]
    RowParallelLinear         W [out, in] split by columns; partial sums all-reduced
    MergedColumnParallelLinear  gate_proj ‖ up_proj fused in one matmul, per rank:
                                [gate_r ; up_r]  (shard_id 0, 1)
    QKVParallelLinear         q_proj ‖ k_proj ‖ v_proj fused, per rank:
                                [q heads_r ; k heads_r ; v heads_r]  (shard_id "q", "k", "v")

A weight loader receives either a tensor or a safetensors slice (``safe_open().get_slice``)
and reads only this rank's rows/columns of it, so no rank materialises the full tensor.

On CPU, after loading, ``pack_for_cpu(backend)`` may move a layer's weight into oneDNN's
blocked layout or the panel layout of kernels/cpu_gemm.py (pagedserve.kernels.cpu_linear;
chosen by a load-time probe in worker/layers/cpu_backend.py). The plain weight is then
dropped, so memory stays the same. With ``--quantization gguf`` a loader receives a
QuantTensor (GGUF blocks, worker/layers/quantized.py) instead of a tensor: it keeps this
rank's rows (or whole-block columns) of it, and ``finish_quantized`` packs them for
kernels/cpu_gguf.py; the fp32 parameter is never written. AWQ / GPTQ int4 and fp8 weights
arrive the same way (worker/layers/hf_quantized.py: whole groups) and run on kernels/quant/.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_linear import Alloc, cpu_linear, pack_cpu_weight
from pagedserve.worker.layers.quantized import QuantizedTensor, take_quant
from pagedserve.worker.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def read_shard(loaded: Any, dim: int, start: int, size: int) -> Any:
    """``loaded[..., start:start+size, ...]`` along ``dim`` (tensor, QuantizedTensor or safetensors slice)."""
    if isinstance(loaded, (torch.Tensor, QuantizedTensor)):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


class _RowWindow:
    """Rows [start, start + size) of a safetensors slice, itself sliceable like one."""

    def __init__(self, loaded: Any, start: int, size: int) -> None:
        self.loaded, self.start, self.size = loaded, start, size

    def get_shape(self) -> list[int]:
        return [self.size, *self.loaded.get_shape()[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0]
        lo, hi, _ = rows.indices(self.size)
        return self.loaded[(slice(self.start + lo, self.start + hi), *index[1:])]


def narrow_rows(loaded: Any, start: int, size: int) -> Any:
    """Rows [start, start + size) of a checkpoint tensor, still lazy for a safetensors slice:
    one part of a fused tensor (Phi-3's qkv_proj), handed to a loader that reads its shard."""
    if isinstance(loaded, (torch.Tensor, QuantizedTensor)):
        return loaded.narrow(0, start, size)
    return _RowWindow(loaded, start, size)


def read_full(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch loading {name}: parameter {tuple(dst.shape)}, "
                         f"checkpoint slice {tuple(src.shape)}.")
    dst.copy_(src)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({tp}).")
    return n // tp


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    # Uninitialised on purpose: the loader fills every parameter and checks it did.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class PackableLinear(nn.Module):
    """The GEMM of every linear layer here: ``F.linear`` on the plain weight, or, once
    ``pack_for_cpu`` ran, the chosen CPU backend on the packed one."""

    _packed = None  # pack_cpu_weight(W, backend): an mkldnn tensor or a PanelWeight; or a GGUFWeight

    def quantize_with(self, w) -> None:
        """Run the GEMM on GGUF blocks (worker/layers/quantized.py's finish_quantized)."""
        self._packed = w

    def pack_for_cpu(self, backend: str = "onednn", alloc: Alloc | None = None, free_plain: bool = True) -> None:
        self._packed = pack_cpu_weight(self.weight.data, backend, alloc)
        if free_plain:  # no longer read; a 0-element tensor keeps .dtype and .device answering
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._packed is not None:
            return cpu_linear(x, self._packed, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W's output features sharded; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output features")
        self.weight = _param(self.output_size_per_partition, input_size, dtype=params_dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(self.output_size_per_partition, dtype=params_dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        shard = read_shard(loaded, 0, self.tp_rank * size, size)
        if not take_quant(self, param, 0, shard, "column-parallel weight"):
            copy_checked(param.data, shard, "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate ‖ up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype)
        for size in self.output_sizes:
            _divide(size, self.tp_size, "merged output features")

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index into output_sizes).")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = read_shard(loaded, 0, self.tp_rank * size, size)
        if not take_quant(self, param, offset, shard, f"merged shard {shard_id}"):
            copy_checked(param.data.narrow(0, offset, size), shard, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused; heads (not features) are what gets split across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
        out = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, params_dtype)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        shard = read_shard(loaded, 0, self.tp_rank * size, size)
        if not take_quant(self, param, offset, shard, f"qkv shard {shard_id}"):
            copy_checked(param.data.narrow(0, offset, size), shard, f"qkv shard {shard_id}")


class RowParallelLinear(PackableLinear):
    """y = sum_r x_r W_r^T + b with W's input features sharded. The input arrives
    already sharded (from a column-parallel layer); the bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input features")
        self.weight = _param(output_size, self.input_size_per_partition, dtype=params_dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(output_size, dtype=params_dtype)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[1]
        shard = read_shard(loaded, 1, self.tp_rank * size, size)
        if not take_quant(self, param, 0, shard, "row-parallel weight"):
            copy_checked(param.data, shard, "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        copy_checked(param.data, read_full(loaded), "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._gemm(x, self.bias)
        out = tensor_model_parallel_all_reduce(self._gemm(x, None))
        return out if self.bias is None else out.add_(self.bias)
