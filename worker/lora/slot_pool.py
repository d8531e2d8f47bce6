"""LoRASlotPool: the adapters a step may use, in ``max_loras`` fixed slots on the model's
device, allocated once (vLLM's LoRA pool; on CUDA the memory profile counts it as weights).

Per decoder layer and fused projection (the model's qkv_proj, o_proj, gate_up_proj,
down_proj), with S = max_loras slots and R = max_lora_rank:

    A[layer][proj]       [S, len(subs) * R, in]   the adapter's A of each module it targets,
                                                   packed: rows [k*r, (k+1)*r) for the k-th
    B[layer][proj][sub]  [S, out_sub, R]          scale * B, columns [0, r)

where r is the slot's adapter's rank (its largest; a module of a smaller rank is zero-padded)
and ``subs`` the projection's modules (qkv: q, k, v; gate_up: gate, up). An adapter placed
in a slot gets its views made once (``SlotViews``): a step only picks rows (the torch path).
The Triton kernels (kernels/lora_ref.py) read the same tensors for all slots at once, told
where each slot's modules sit by three small tables, rewritten when a slot is filled:

    ranks             [S] int32          the slot's r
    widths[proj]      [layers, S] int32  k*r: the rows of A[layer][proj][slot] in use
    cols[proj]        [layers, subs, S]  int32: sub's rows in A (k*r), -1: not targeted

Tensor parallelism shards A and B the way their base layer is sharded (vLLM's rule), so
each rank's delta lands in its own part of the output:

    qkv, gate_up (column-parallel)  B's rows of this rank's output features; A whole
    o, down      (row-parallel)     A's columns of this rank's input features; B whole:
                                    the delta is a partial sum, reduced with the layer's own
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedserve.worker.lora.peft_adapter import LoRAAdapter, module_shapes
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel_state import get_tp_rank, get_tp_size

# fused projection -> the checkpoint modules it stacks, in its output order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}
ROW_PARALLEL = ("o", "down")  # input features sharded across ranks; the others shard output features

# One layer's views of a slot: proj -> (A [k*r, in], [(col0, col1, B [out, r], out0, out1)])
# for the modules the adapter targets there, or None where it targets none of proj's.
LayerViews = dict[str, tuple[torch.Tensor, list[tuple[int, int, torch.Tensor, int, int]]] | None]
SlotViews = list[LayerViews]  # indexed by layer


class LoRASlotPool:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_lora_rank}.")
        self.num_slots = max_loras
        self.max_rank = max_lora_rank
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        shapes = module_shapes(model_config)
        tp = self.tp_size
        # proj -> (in, [(module, out0, out1)]): where each module's rows sit in this rank's
        # output (a column-parallel projection's out and a row-parallel one's in are 1/tp)
        self.layout: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}
        for proj, subs in PROJECTIONS.items():
            row = proj in ROW_PARALLEL
            at, parts = 0, []
            for m in subs:
                out = shapes[m][1] if row else shapes[m][1] // tp
                parts.append((m, at, at + out))
                at += out
            fan_in = shapes[subs[0]][0]
            self.layout[proj] = (fan_in // tp if row else fan_in, parts)
        S, R, L = max_loras, max_lora_rank, model_config.num_hidden_layers
        self.A = [{p: torch.zeros(S, len(parts) * R, fan_in, dtype=dtype, device=device)
                   for p, (fan_in, parts) in self.layout.items()} for _ in range(L)]
        self.B = [{p: [torch.zeros(S, o1 - o0, R, dtype=dtype, device=device) for _, o0, o1 in parts]
                   for p, (_, parts) in self.layout.items()} for _ in range(L)]
        # The kernels' tables (module docstring); an empty slot is width 0, every col -1.
        self.ranks = torch.zeros(S, dtype=torch.int32, device=device)
        self.widths = {p: torch.zeros(L, S, dtype=torch.int32, device=device) for p in self.layout}
        self.cols = {p: torch.full((L, len(parts), S), -1, dtype=torch.int32, device=device)
                     for p, (_, parts) in self.layout.items()}
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self._views: list[SlotViews | None] = [None] * S
        self.num_fills = 0  # adapters copied into a slot (tests: a resident one is not copied again)

    def views(self, slot: int) -> SlotViews:
        return self._views[slot]

    def slots_for(self, adapters: list[LoRAAdapter]) -> list[int]:
        """The slot of each of a step's distinct adapters, filling slots as needed: a free
        one, else the least recently used one whose adapter this step does not use."""
        if len(adapters) > self.num_slots:
            raise RuntimeError(f"a step with {len(adapters)} LoRA adapters, over max_loras {self.num_slots} "
                               "(the scheduler keeps them within it)")
        needed = {a.lora_request.lora_int_id for a in adapters}
        out = []
        for adapter in adapters:
            key = adapter.lora_request.lora_int_id
            slot = self._slot_of.get(key)
            if slot is None:
                slot = self._free_slot(needed)
                self._fill(slot, adapter)
                self._slot_of[key] = slot
            self._slot_of.move_to_end(key)
            out.append(slot)
        return out

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        for key, slot in self._slot_of.items():  # least recently used first
            if key not in needed:
                del self._slot_of[key]
                return slot
        raise RuntimeError("no LoRA slot free")  # unreachable: len(needed) <= num_slots

    def _shard(self, proj: str, a: torch.Tensor, b: torch.Tensor, fan_in: int, out: int):
        """This rank's part of a module's (A [r, in], B [out, r]) (module docstring)."""
        if self.tp_size == 1:
            return a, b
        if proj in ROW_PARALLEL:
            return a[:, self.tp_rank * fan_in:(self.tp_rank + 1) * fan_in], b
        return a, b[self.tp_rank * out:(self.tp_rank + 1) * out]

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` (this rank's shard of it) into ``slot``; make its views and its
        rows of the kernels' tables."""
        r = adapter.rank
        views: SlotViews = []
        widths = {p: [] for p in self.layout}
        cols = {p: [] for p in self.layout}
        for layer, (a_pool, b_pool) in enumerate(zip(self.A, self.B)):
            layer_views: LayerViews = {}
            for proj, (fan_in, parts) in self.layout.items():
                subs, k, layer_cols = [], 0, []
                a_slot = a_pool[proj][slot]
                for j, (module, o0, o1) in enumerate(parts):
                    ab = adapter.weights.get((layer, module))
                    if ab is None:
                        layer_cols.append(-1)
                        continue
                    a, b = self._shard(proj, *ab, fan_in, o1 - o0)
                    layer_cols.append(k * r)
                    rows = a_slot[k * r:(k + 1) * r]
                    rows.zero_()
                    rows[:a.shape[0]].copy_(a)
                    b_slot = b_pool[proj][j][slot, :, :r]
                    b_slot.zero_()
                    b_slot[:, :b.shape[1]].copy_(b)
                    subs.append((k * r, (k + 1) * r, b_slot, o0, o1))
                    k += 1
                layer_views[proj] = (a_slot[:k * r], subs) if subs else None
                widths[proj].append(k * r)
                cols[proj].append(layer_cols)
            views.append(layer_views)
        self._views[slot] = views
        self.ranks[slot] = r
        for proj in self.layout:
            self.widths[proj][:, slot] = torch.tensor(widths[proj], dtype=torch.int32)
            self.cols[proj][:, :, slot] = torch.tensor(cols[proj], dtype=torch.int32)
        self.num_fills += 1
