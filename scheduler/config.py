"""Typed configuration for the scheduler and the KV cache, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from pagedserve.scheduler.kv.kv_groups import KVCacheGroups

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
    # A model with sliding-window and full layers: a block table per group of layers, the
    # sliding ones freeing what their window no longer reaches (kv/kv_groups.py, kv/hybrid.py).
    # None: one table per request, every layer's K/V in each block.
    kv_groups: KVCacheGroups | None = None

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
class Reservation:
    """Capacity held back for one class: a tenant name, or ``"priority:N"`` for the
    requests of priority N. Others may not take it; the class may preempt others for it."""

    blocks: int = 0  # KV blocks
    seqs: int = 0  # batch slots (running requests)

    def __post_init__(self) -> None:
        if self.blocks < 0 or self.seqs < 0:
            raise ValueError(f"a reservation holds >= 0 blocks and seqs, got {self}.")


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
    # Tenants (scheduler/fair_queue.py): weight of each tenant's fair share (default 1),
    # capacity reserved per tenant or "priority:N", and whether each tenant gets its own
    # prefix cache (a tenant's requests share among themselves; a cross-tenant hit would
    # be a timing side channel between tenants).
    tenant_weights: dict[str, float] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    isolate_tenant_prefix_cache: bool = True
    # A request resumed after a preemption is not chosen as a victim again for this many
    # steps while any other candidate exists (no thrash: its recompute just got paid).
    preemption_protect_steps: int = 32
    # Speculative decoding (prompt lookup drafts); None: off.
    speculative_config: SpeculativeConfig | None = None
    # LoRA (vLLM's --max-loras): the most distinct adapters running at once, so that every
    # step's adapters fit the worker's slots; None: LoRA off.
    max_loras: int | None = None

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
        if self.preemption_protect_steps < 0:
            raise ValueError(f"preemption_protect_steps must be >= 0, got {self.preemption_protect_steps}.")
        self.reservations = {k: v if isinstance(v, Reservation) else Reservation(**v)
                             for k, v in self.reservations.items()}
        if self.reservations and sum(r.seqs for r in self.reservations.values()) >= self.max_num_seqs:
            raise ValueError(f"reserved batch slots ({sum(r.seqs for r in self.reservations.values())}) "
                             f"must leave at least one of max_num_seqs ({self.max_num_seqs}) unreserved.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits one step.")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` for prompt lookup: each decoding request proposes
    the tokens that followed the first earlier occurrence of its last n tokens
    (prompt_lookup_max >= n >= prompt_lookup_min, longest first), and one forward pass
    verifies up to ``num_speculative_tokens`` of them (scheduler/ngram_proposer.py).

    ``disable_by_batch_size``: no drafts while this many requests or more are running
    (vLLM's name; None: always draft)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; "
                             "the one method is 'ngram' (prompt lookup, no draft model).")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}.")
        # vLLM's defaults: one bound given sets the other; neither: both 5.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}.")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 1, "
                             f"got {self.disable_by_batch_size}.")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From the JSON text of the flag, a dict (``LLM(speculative_config=...)``) or an
        instance; None stays None. Unknown keys are an error that names them, vLLM's
        other methods' keys included: this server drafts with n-grams only."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        value = dict(value)
        if value.get("model") == "[ngram]" and "method" not in value:  # vLLM's older spelling
            value.pop("model")
            value["method"] = "ngram"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))}).")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required.")
        return cls(**value)
