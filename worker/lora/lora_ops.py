"""The LoRA deltas of one projection over a step's rows: the CPU (torch) path.

For each adapter of the step and each run of its rows [s, e) (manager.py makes them):

    xa = x[s:e] @ A^T                      [n, k*r]   one shrink for all of the projection's
                                                      modules the adapter targets (A packed)
    out[s:e, o0:o1] += xa[:, c0:c1] @ B^T   [n, out]  one expand per module, into its columns

Rows of the base model get nothing. A step without any adapter returns at the first line:
the cost of LoRA being on is one attribute read per projection.
"""

from __future__ import annotations

import torch

from pagedserve.worker.lora.slot_pool import SlotViews

# One step's work: (the slot views of an adapter, its runs of rows [(start, end)]); None: no adapter.
StepGroups = list[tuple[SlotViews, list[tuple[int, int]]]]


class LoRAContext:
    """What every layer's hook reads: the step's groups, set by the manager per step."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: StepGroups | None = None


class LayerLoRA:
    """The hook a decoder layer's attention and MLP call after each projection
    (worker/models/llama.py): ``apply("qkv", x, qkv)`` adds the deltas into ``out`` in place."""

    __slots__ = ("ctx", "layer")

    def __init__(self, ctx: LoRAContext, layer: int) -> None:
        self.ctx = ctx
        self.layer = layer

    def apply(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        step = self.ctx.step
        if step is None:
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
