"""The LoRA deltas of one projection over a step's rows: torch on CPU, Triton on CUDA.

For each adapter of the step and each run of its rows [s, e) (manager.py makes them):

    xa = x[s:e] @ A^T                      [n, k*r]   one shrink for all of the projection's
                                                      modules the adapter targets (A packed)
    out[s:e, o0:o1] += xa[:, c0:c1] @ B^T   [n, out]  one expand per module, into its columns

The torch path loops over the runs with the slots' views (slot_pool.py); the Triton path
(kernels/triton_lora_shrink.py, triton_lora_expand.py) does every run of every slot in one
shrink and one expand per module, from the step's segments and the pool's tables.

Rows of the base model get nothing. A step without any adapter returns at the first line:
the cost of LoRA being on is one attribute read per projection.
"""

from __future__ import annotations

import torch

from pagedserve.worker.lora.slot_pool import LoRASlotPool, SlotViews
from pagedserve.worker.parallel_state import tensor_model_parallel_all_reduce

# One step's work: (the slot views of an adapter, its runs of rows [(start, end)]); None: no adapter.
StepGroups = list[tuple[SlotViews, list[tuple[int, int]]]]


class LoRAContext:
    """What every layer's hook reads, set by the manager per step: the step's groups (None:
    no adapter this step) and, on the Triton path, the same runs as the kernels' segments
    ([num_segments, 3] int32 on the device: start, num_rows, slot) and the longest one."""

    __slots__ = ("step", "pool", "segments", "max_rows")

    def __init__(self, pool: LoRASlotPool | None = None) -> None:
        self.step: StepGroups | None = None
        self.pool = pool
        self.segments: torch.Tensor | None = None  # None: the torch path
        self.max_rows = 0


class LayerLoRA:
    """The hook a decoder layer's attention and MLP call after each projection
    (worker/models/llama.py): ``apply("qkv", x, qkv)`` adds the deltas into ``out`` in place;
    ``row_parallel("o", o_proj, x)`` runs a row-parallel projection with its deltas."""

    __slots__ = ("ctx", "layer")

    def __init__(self, ctx: LoRAContext, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def apply(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        step = self.ctx.step
        if step is None:
            return
        if self.ctx.segments is not None:
            self._apply_triton(proj, x, out)
            return
        layer = self.layer
        for views, runs in step:
            v = views[layer][proj]
            if v is None:  # the adapter targets none of this projection's modules here
                continue
            a, subs = v
            for s, e in runs:
                xa = torch.mm(x[s:e], a.t())
                o = out[s:e]
                for c0, c1, b, o0, o1 in subs:
                    o[:, o0:o1].addmm_(xa[:, c0:c1], b.t())

    def _apply_triton(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        # Imported here: a CPU worker never pays for importing triton.
        from pagedserve.kernels.triton_lora_expand import lora_expand_triton
        from pagedserve.kernels.triton_lora_shrink import lora_shrink_triton

        ctx, layer = self.ctx, self.layer
        pool = ctx.pool
        xa = lora_shrink_triton(x, pool.A[layer][proj], ctx.segments, pool.widths[proj][layer], ctx.max_rows)
        for j, (_, o0, o1) in enumerate(pool.layout[proj][1]):
            lora_expand_triton(xa, pool.B[layer][proj][j], out[:, o0:o1], ctx.segments, pool.cols[proj][layer, j],
                               pool.ranks, ctx.max_rows)

    def row_parallel(self, proj: str, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` plus ``proj``'s deltas, for a row-parallel layer (o_proj, down_proj).
        At TP > 1, x holds this rank's input features and the slots this rank's columns of A
        (slot_pool.py): the delta is a partial sum like the layer's own, so it is added before
        the layer's all-reduce, which sums both (vLLM's RowParallelLinearWithLoRA): LoRA adds
        no collective. The tail is worker/layers/linear.py's RowParallelLinear.forward."""
        if linear.tp_size == 1 or self.ctx.step is None:
            out = linear(x)
            self.apply(proj, x, out)
            return out
        out = linear._gemm(x, None)
        self.apply(proj, x, out)
        out = tensor_model_parallel_all_reduce(out)
        return out if linear.bias is None else out.add_(linear.bias)
