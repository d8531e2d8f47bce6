"""Typed configuration for the scheduler and the KV cache, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority", "static"]
KVAllocation = Literal["paged", "contiguous"]


@dataclass(slots=True)
class CacheConfig:
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # "paged": blocks on demand; "contiguous": reserve prompt + max_tokens at admission
    # (the pre-vLLM baseline, kept on the same code path for side-by-side benchmarks).
    kv_allocation: KVAllocation = "paged"
    # Fraction of blocks kept free at admission so a new request does not force an
    # immediate preemption of a running one on its next decode step.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}.")
        if self.kv_allocation not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocation must be 'paged' or 'contiguous', got {self.kv_allocation!r}.")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # "fcfs": continuous batching, first come first served; "priority": lower value
    # first, ties by arrival; "static": a batch forms when the engine is idle and runs
    # until its last member finishes (the pre-Orca baseline).
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Bound on the waiting queue (admission control answers 429 past it); None: unbounded.
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.scheduling_policy not in ("fcfs", "priority", "static"):
            raise ValueError("scheduling_policy must be 'fcfs', 'priority' or 'static', "
                             f"got {self.scheduling_policy!r}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits one step.")
