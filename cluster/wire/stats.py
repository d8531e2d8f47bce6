"""The stats snapshot an engine replica pushes to the /metrics aggregator (after steps,
at least once a second when idle): a plain dict from the scheduler's SchedulerStats,
cheap to send between actors."""

from __future__ import annotations

import dataclasses
from typing import Any

GAUGE_KEYS = ("running", "waiting", "num_free_blocks", "num_blocks", "num_used_blocks")
TENANT_KEYS = ("running", "waiting", "tokens")  # tokens: cumulative scheduled (a counter)
COUNTER_KEYS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                "num_prompt_tokens", "num_generation_tokens",
                "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
# Speculative decoding's accepted tokens per draft position: a list, summed by position
# (empty: speculation off on that replica).
PER_POS_KEY = "spec_num_accepted_tokens_per_pos"
# LoRA adapter names (vLLM's lora_requests_info labels): a union over replicas.
LORA_NAME_KEYS = ("running_lora_adapters", "waiting_lora_adapters")


def stats_snapshot(stats: Any) -> dict[str, Any]:
    """A plain dict from the engine's SchedulerStats (a dataclass or any object with the
    contract's attribute names); cheap to send between actors."""
    # Shallow (asdict deep-copies, on every step): the nested dicts and lists are copied below.
    raw = ({f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)} if dataclasses.is_dataclass(stats)
           else dict(vars(stats)))
    snap = {k: raw.get(k, 0) or 0 for k in GAUGE_KEYS + COUNTER_KEYS if k != "num_used_blocks"}
    snap["kv_cache_usage"] = float(raw.get("kv_cache_usage", 0.0) or 0.0)
    # Blocks held by requests (cached-but-free prefix blocks are not "used").
    snap["num_used_blocks"] = round(snap["kv_cache_usage"] * int(snap["num_blocks"]))
    snap["waiting_by_reason"] = dict(raw.get("waiting_by_reason") or {})
    snap[PER_POS_KEY] = list(raw.get(PER_POS_KEY) or [])
    snap["queue_kv_demand_blocks"] = int(raw.get("queue_kv_demand_blocks", 0) or 0)
    # {tenant: {"running", "waiting", "tokens"}}; the VTC counter stays inside the scheduler.
    snap["tenants"] = {t: {k: v.get(k, 0) for k in TENANT_KEYS}
                       for t, v in (raw.get("tenants") or {}).items()}
    # LoRA: adapter names of running and waiting requests, and max_loras (0: LoRA off).
    for k in LORA_NAME_KEYS:
        snap[k] = list(raw.get(k) or [])
    snap["max_lora"] = int(raw.get("max_lora", 0) or 0)
    return snap
