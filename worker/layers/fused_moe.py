"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE): router + SwiGLU experts.

    h [n, H] ─▶ gate (replicated [E, H]) ─▶ softmax fp32, top-k ─▶ experts, grouped by
    expert ─▶ all-reduce ─▶ [n, H]

The experts run where the tensors are:

    CUDA   kernels/moe/triton_fused_moe.py: two grouped GEMM launches over the pairs sorted by
           expert, nothing read back to the host (a step can be a CUDA graph)
    CPU    kernels/moe/cpu_experts.py once the worker packed the experts (fp32 on AVX2 /
           AVX-512: ``pack_for_cpu``, worker/layers/cpu_backend.py), else the torch reference
           kernels/moe/grouped_torch.py (one GEMM per active expert)

Tensor parallelism shards each expert as a Megatron MLP: rank r holds the rows
[r*I/tp, (r+1)*I/tp) of every expert's gate and up (column-parallel) and the same columns of
its down projection (row-parallel); every rank routes every token (the gate is whole on
each), so the ranks' partial sums add up to the full output in one all-reduce per layer.

Checkpoints store one tensor per expert and projection; names differ by family:

    Mixtral     block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down), block_sparse_moe.gate
    Qwen3-MoE   mlp.experts.{e}.gate_proj / up_proj / down_proj, mlp.gate

They load into two stacked parameters per layer: ``w13_weight`` [E, 2I/tp, H] (shard ids
(e, 0) gate, (e, 1) up) and ``w2_weight`` [E, H, I/tp] (shard id (e, 2)).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_linear import Alloc
from pagedserve.kernels.moe import cpu_experts, grouped_experts, select_experts, triton_fused_moe
from pagedserve.worker.layers.linear import _divide, _param, copy_checked, read_shard
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

# checkpoint projection name -> index into (gate, up, down)
_EXPERT_PROJ = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}
_EXPERT_NAME = re.compile(r"^(.*\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                          r"\.weight$")


def map_expert_name(name: str) -> tuple[str, Any] | None:
    """A checkpoint's per-expert tensor -> (our stacked parameter, (expert, proj)); the router
    and anything else of the block -> its name under ``mlp.``; None: not an MoE tensor."""
    m = _EXPERT_NAME.match(name)
    if m:
        prefix, expert, proj = m.group(1), int(m.group(2)), _EXPERT_PROJ[m.group(3)]
        return f"{prefix}mlp.experts.{'w2' if proj == 2 else 'w13'}_weight", (expert, proj)
    if ".block_sparse_moe." in name:
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


class FusedMoE(nn.Module):
    """The experts of one layer, stacked; ``forward`` takes the router's choice."""

    # "auto": Triton for CUDA tensors (where triton imports), torch otherwise; "triton" / "torch"
    # force one (the interpreter tests run the Triton path on CPU tensors).
    backend = "auto"
    _cpu = None  # cpu_experts.CPUExperts once pack_for_cpu ran

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.intermediate_per_rank = _divide(intermediate_size, self.tp_size, "moe intermediate size")
        self.w13_weight = _param(num_experts, 2 * self.intermediate_per_rank, hidden_size, dtype=params_dtype)
        self.w2_weight = _param(num_experts, hidden_size, self.intermediate_per_rank, dtype=params_dtype)
        for p, projs in ((self.w13_weight, (0, 1)), (self.w2_weight, (2,))):
            p.weight_loader = self.weight_loader
            p.shard_ids = [(e, proj) for e in range(num_experts) for proj in projs]  # expected_weight_keys

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[int, int]) -> None:
        expert, proj = shard_id
        size = self.intermediate_per_rank
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config says {self.num_experts} experts.")
        if proj == 2:  # down: this rank's input columns
            copy_checked(param.data[expert], read_shard(loaded, 1, self.tp_rank * size, size), "expert down_proj")
        else:  # gate or up: this rank's output rows, at [gate_r ; up_r]
            copy_checked(param.data[expert].narrow(0, proj * size, size),
                         read_shard(loaded, 0, self.tp_rank * size, size), "expert gate/up_proj")

    def pack_for_cpu(self, alloc: Alloc | None = None) -> None:
        """The experts into cpu_experts' panels (fp32 on AVX2 / AVX-512: check
        ``cpu_experts.available`` first); the plain weights are freed."""
        self._cpu = cpu_experts.CPUExperts(self.w13_weight.data, self.w2_weight.data, alloc)
        for p in (self.w13_weight, self.w2_weight):  # a 0-element tensor keeps .dtype and .device answering
            p.data = torch.empty(0, dtype=p.dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None:
            out = cpu_experts.cpu_grouped_experts(x, self._cpu, topk_weights, topk_ids)
        elif self.backend == "triton" or (self.backend == "auto" and x.is_cuda and triton_fused_moe.available()):
            out = triton_fused_moe.fused_experts_triton(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            out = grouped_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class Router(nn.Module):
    """The gate: [E, H], whole on every rank (every rank routes every token)."""

    def __init__(self, hidden_size: int, num_experts: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = _param(num_experts, hidden_size, dtype=params_dtype)  # no loader: copied whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [n, E] logits, the model dtype (as transformers)


class SparseMoeBlock(nn.Module):
    """Where the dense layers have their SwiGLU MLP (``layer.mlp``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.dtype)

    @property
    def lora(self) -> None:
        return None

    @lora.setter
    def lora(self, hook: Any) -> None:
        # worker/lora sets each layer's mlp.lora; adapters on experts would be silently unused.
        if hook is not None:
            raise ValueError("LoRA adapters on mixture-of-experts layers are not supported.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, topk_weights, topk_ids)
