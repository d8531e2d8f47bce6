"""A snapshot of the scheduler for metrics (Prometheus gauges and counters later)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why the head of the waiting queue was not admitted in the last schedule():
# no_blocks  - the KV pool (minus the watermark) could not hold its next chunk, or a
#              running request was preempted this step (nobody is admitted then);
# no_budget  - the step's token budget was used up (or, without chunked prefill, too
#              small for its whole prompt);
# max_seqs   - max_num_seqs requests were already running;
# static_batch - scheduling_policy="static" and a batch is still running;
# reserved   - it would fit only into capacity reserved for another tenant or class;
# lora_slots - its LoRA adapter is not running, and max_loras other adapters are.
# (Per request, Scheduler.waiting_info adds tenant_share and queue_order: tenancy.py.)
WAITING_REASONS = ("no_blocks", "no_budget", "max_seqs", "static_batch", "reserved", "lora_slots")


@dataclass(slots=True)
class SchedulerStats:
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests waiting (new or preempted)
    # Requests waiting, by the reason admission stopped in the last step (FCFS admission
    # is head-of-line, so every request behind the head shares the head's reason).
    waiting_by_reason: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests, 0..1
    num_free_blocks: int = 0
    num_blocks: int = 0
    # Cumulative, in tokens, counted once per request at its first admission.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative, counted when a request samples its first token
    num_generation_tokens: int = 0  # cumulative sampled tokens kept
    step_id: int = 0
    # Per tenant: {"running", "waiting", "tokens" (cumulative scheduled), "counter" (VTC)}.
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)
    # KV blocks the waiting queue's prompts would take (prefix hits not subtracted).
    queue_kv_demand_blocks: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters): drafts verified,
    # their tokens, the tokens accepted, and per draft position how often it was accepted
    # (empty list: speculation off). Drafting cost: proposals made and their time.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_num_proposals: int = 0
    spec_propose_time_s: float = 0.0
    # LoRA (vLLM's lora_requests_info): the adapters of running and of waiting requests,
    # by name, and the most that may run at once (0: LoRA off).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
