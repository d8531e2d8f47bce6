"""LoRAHostCache: adapters read from disk, kept in host memory (vLLM's --max-cpu-loras),
least recently used out first. A slot (slot_pool.py) is filled from here; an adapter evicted
here is read from its path again when it is next needed.

Each step's result reports what changed here (``report``): the adapters on the host and how
long each read from disk took. The engine publishes both to the fronts' KV routers, which
charge a replica without a request's adapter its read (cluster/front/router/kv_routing.py).
"""

from __future__ import annotations

import time
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
        self._changed = False  # the adapters here changed since the last report
        self._load_s: list[float] = []  # seconds each read from disk took, since the last report

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
        t0 = time.perf_counter()
        adapter = self._load(lora_request)  # raises before anything is evicted
        self._load_s.append(time.perf_counter() - t0)
        self.num_loads += 1
        self._adapters[key] = adapter
        self._changed = True
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter

    def report(self) -> tuple[tuple[int, ...] | None, tuple[float, ...]]:
        """(the lora_int_ids here now, None if that did not change since the last report;
        the seconds each read from disk took since then), and a new report starts."""
        resident = tuple(self._adapters) if self._changed else None
        load_s = tuple(self._load_s)
        self._changed = False
        self._load_s.clear()
        return resident, load_s
