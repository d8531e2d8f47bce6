"""The scheduler's side of LoRA (scheduler/lora.py): the prefix cache keys include the
adapter, and a step never holds more distinct adapters than the worker has slots; a request
whose adapter has no slot waits at the head of the line, and the others behind it wait too
(FIFO: nobody overtakes it and keeps the slots busy)."""

from __future__ import annotations

import pytest

from _sched_helpers import step
from pagedserve.scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from pagedserve.scheduler.lora import LoRARequest, adapter_id, parse_lora_modules, LoRAModulePath

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
C = LoRARequest("c", 3, "/adapters/c")


def make(max_loras=None, num_blocks=32, max_seqs=8):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, max_model_len=64,
                                     max_loras=max_loras),
                     CacheConfig(num_blocks=num_blocks, block_size=4, watermark=0.0))


def add(sched, rid, prompt, lora=None, max_tokens=4):
    req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), lora_request=lora)
    sched.add_request(req)
    return req


def run_to_end(sched):
    while sched.has_unfinished_requests():
        step(sched)


def test_prefix_cache_never_hits_across_adapters_or_the_base():
    """The same 12-token prompt (3 full blocks) under a, b, the base model, then a again:
    only the last one hits (2 blocks: the last token is always computed), each adapter's
    blocks are its own."""
    sched = make()
    prompt = list(range(100, 112))
    hits = {}
    for rid, lora in (("a1", A), ("b1", B), ("base", None), ("a2", A)):
        add(sched, rid, prompt, lora)
        plan, _ = step(sched)
        hits[rid] = sched.requests[rid].num_cached_tokens if rid in sched.requests else None
        run_to_end(sched)
    assert hits == {"a1": 0, "b1": 0, "base": 0, "a2": 8}


def test_same_name_other_path_is_another_adapter():
    """Reloaded under the same name from another path: another id, no hit on the old K/V."""
    sched = make()
    prompt = list(range(100, 112))
    old, new = LoRARequest.named("sql", "/v1/sql"), LoRARequest.named("sql", "/v2/sql")
    assert old.lora_int_id != new.lora_int_id and old.lora_int_id == adapter_id("sql", "/v1/sql")
    add(sched, "old", prompt, old)
    run_to_end(sched)
    add(sched, "new", prompt, new)
    step(sched)
    assert sched.requests["new"].num_cached_tokens == 0


def test_a_step_holds_at_most_max_loras_adapters_and_waiters_keep_their_order():
    """Two slots; requests of a, b, c, the base, a arrive in that order. a and b run; c has no
    slot and waits at the head ("lora_slots"); the base request and the second a wait behind
    it though they would fit (FIFO), until b's request ends and c takes its slot."""
    sched = make(max_loras=2)
    add(sched, "a", [1] * 5, A, max_tokens=6)
    add(sched, "b", [2] * 5, B, max_tokens=2)
    add(sched, "c", [3] * 5, C)
    add(sched, "base", [4] * 5)
    add(sched, "a-again", [5] * 5, A)
    admitted = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        admitted += [r.req_id for r in plan.scheduled_new_reqs]
        running = {sched.requests[r].lora_request for r in plan.num_scheduled_tokens if r in sched.requests}
        assert len({lr.lora_int_id for lr in running if lr is not None}) <= 2
        if admitted == ["a", "b"]:
            assert sched.get_stats().waiting_by_reason["lora_slots"] == 3
            assert sched.waiting_info("c")["reason"] == "lora_slots"
    assert admitted == ["a", "b", "c", "base", "a-again"]


def test_preempted_request_waits_for_a_slot_too():
    """One slot, a pool too small for both requests of adapter a: one is preempted and comes
    back; b's request, queued meanwhile, waits until no request of a is left. No step ever
    holds two adapters."""
    sched = make(max_loras=1, num_blocks=6)
    add(sched, "a", [1] * 9, A, max_tokens=8)
    step(sched)
    add(sched, "a2", [6] * 9, A, max_tokens=8)
    add(sched, "b", [7] * 5, B, max_tokens=2)
    seen = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        seen.append({sched.requests[r].lora_request.lora_name for r in plan.num_scheduled_tokens
                     if r in sched.requests})
    assert all(len(s) <= 1 for s in seen)
    assert sched.num_preemptions > 0
    assert {"b"} in seen and seen.index({"b"}) > max(i for i, s in enumerate(seen) if s == {"a"})


def test_lora_modules_parse():
    mods = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
                               {"name": "x", "path": "/x"}])
    assert mods == [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/a/chat", "m"),
                    LoRAModulePath("x", "/x")]
    with pytest.raises(ValueError, match="names 'sql' twice"):
        parse_lora_modules(["sql=/a", "sql=/b"])
    with pytest.raises(ValueError, match="expected name=path or a JSON object"):
        parse_lora_modules(["just-a-path"])
    with pytest.raises(ValueError, match="unknown key"):
        parse_lora_modules([{"name": "a", "path": "/a", "rank": 8}])


def test_lora_requests_info_names_running_and_waiting_adapters_as_vllm():
    """vLLM's vllm:lora_requests_info gauge: the labels name the adapters of running and of
    waiting requests (comma-joined, here a union over two replicas) and max_lora; with LoRA
    off there is no such series."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.cluster.front.metrics import ServeMetrics, StatsAggregator
    from pagedserve.cluster.wire.stats import stats_snapshot

    sched = make(max_loras=2)
    for rid, lora in (("a", A), ("b", B), ("c", C), ("base", None)):
        add(sched, rid, [7] * 5, lora, max_tokens=6)
    step(sched)
    stats = sched.get_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_lora) == (["a", "b"], ["c"], 2)
    other = make(max_loras=2)
    add(other, "d", [8] * 5, LoRARequest("d", 4, "/adapters/d"))
    step(other)
    agg = StatsAggregator()
    agg.report("r0", stats_snapshot(stats))
    agg.report("r1", stats_snapshot(other.get_stats()))
    text = ServeMetrics("demo").render(agg.merged()).decode()
    [info] = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:lora_requests_info"]
    assert info.labels == {"max_lora": "2", "running_lora_adapters": "a,b,d", "waiting_lora_adapters": "c"}
    assert info.value > 1.7e9  # when they were seen, as vLLM's set_to_current_time()
    off = StatsAggregator()
    off.report("r0", stats_snapshot(make().get_stats()))
    assert "lora_requests_info" not in ServeMetrics("demo").render(off.merged()).decode()
