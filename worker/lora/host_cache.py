"""LoRAHostCache: adapters read from disk, kept in host memory (vLLM's --max-cpu-loras),
least recently used out first. A slot (slot_pool.py) is filled from here; an adapter evicted
here is read from its path again when it is next needed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.worker.lora.peft_adapter import LoRAAdapter


class LoRAHostCache:
    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoRAAdapter]) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}.")
        self.capacity = capacity
        self._load = load
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self.num_loads = 0  # reads from disk (tests: a hit reads nothing)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from disk if it is not here (LoRAError if it cannot be)."""
        key = lora_request.lora_int_id
        adapter = self._adapters.get(key)
        if adapter is not None:
            self._adapters.move_to_end(key)
            return adapter
        adapter = self._load(lora_request)  # raises before anything is evicted
        self.num_loads += 1
        self._adapters[key] = adapter
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter
