"""LoRAManager: the worker's adapters, from a request's setup to each step's groups.

    request setup (ModelRunner._new_state)  add(lora_request): read and checked into the
                                            host cache (a bad adapter fails that request alone)
    each step (ModelRunner._prepare_inputs) begin_step(rows): the step's adapters into slots,
                                            their runs of rows for the layers' hooks
    after the step                          end_step(): no adapter until the next one

The model's layers get their hooks once, at ``attach``; the fast path of a step with no
adapter is ``ctx.step = None``. The deltas run in Triton on CUDA (when triton imports) and in
torch elsewhere (lora_ops.py), chosen once here from the device.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import triton_available
from pagedserve.scheduler.lora import LoRARequest
from pagedserve.worker.lora.host_cache import LoRAHostCache
from pagedserve.worker.lora.lora_ops import LayerLoRA, LoRAContext
from pagedserve.worker.lora.peft_adapter import load_peft_adapter
from pagedserve.worker.lora.slot_pool import LoRASlotPool
from pagedserve.worker.model_config import ModelConfig


class LoRAManager:
    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, device: torch.device, backend: str = "auto") -> None:
        """``backend``: "auto" (Triton on CUDA when triton imports, else torch), "torch" or
        "triton" (tests run it on a CPU under TRITON_INTERPRET=1)."""
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and triton_available() else "torch"
        if backend not in ("torch", "triton"):
            raise ValueError(f"LoRA backend must be 'auto', 'torch' or 'triton', got {backend!r}.")
        self.backend = backend
        self.pool = LoRASlotPool(model_config, max_loras, max_lora_rank, device, model_config.dtype)
        # At least the slots' worth: a step's adapters must all be on the host at once.
        self.host = LoRAHostCache(max(max_cpu_loras or max_loras, max_loras), self._read)
        self.ctx = LoRAContext(self.pool)

    def _read(self, lora_request: LoRARequest):
        return load_peft_adapter(lora_request, self.model_config, self.max_lora_rank)

    def attach(self, model: torch.nn.Module) -> None:
        """Give each decoder layer's attention and MLP their hook (``lora`` attribute)."""
        for i, layer in enumerate(model.model.layers):
            hook = LayerLoRA(self.ctx, i)
            layer.self_attn.lora = hook
            if i not in self.model_config.moe_layers:  # experts are not adapted (peft_adapter refuses them)
                layer.mlp.lora = hook

    def add(self, lora_request: LoRARequest) -> None:
        """Read the adapter now, if it is not on the host (LoRAError if it cannot be)."""
        self.host.get(lora_request)

    def begin_step(self, rows: list[tuple[LoRARequest | None, int]]) -> None:
        """``rows``: each row's adapter (None: the base model) and token count, in the
        step's order. Consecutive rows of one adapter make one run."""
        runs: dict[int, list[tuple[int, int]]] = {}
        requests: dict[int, LoRARequest] = {}
        at = 0
        prev = None
        for lora, n in rows:
            if lora is not None:
                key = lora.lora_int_id
                spans = runs.setdefault(key, [])
                if prev == key:
                    spans[-1] = (spans[-1][0], at + n)
                else:
                    spans.append((at, at + n))
                requests[key] = lora
            prev = None if lora is None else lora.lora_int_id
            at += n
        if not runs:
            self.ctx.step = None
            return
        adapters = [self.host.get(requests[key]) for key in runs]
        slots = self.pool.slots_for(adapters)
        self.ctx.step = [(self.pool.views(slot), runs[key]) for slot, key in zip(slots, runs)]
        if self.backend == "triton":
            segments = [(s, e - s, slot) for slot, key in zip(slots, runs) for s, e in runs[key]]
            self.ctx.segments = torch.tensor(segments, dtype=torch.int32, device=self.device)
            self.ctx.max_rows = max(n for _, n, _ in segments)

    def end_step(self) -> None:
        self.ctx.step = None
        self.ctx.segments = None
