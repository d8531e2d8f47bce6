"""Scheduler switches and limits: the static and contiguous baselines, the priority
policy, the watermark, chunked prefill off, max_num_seqs, and why requests wait.

Block size 4, no watermark unless said otherwise."""

import pytest
from _sched_helpers import add, block_ids, free_ids, make_scheduler, step

from pagedserve.scheduler import CacheConfig, QueueFullError, RequestStatus, Scheduler, SchedulerConfig


def test_static_batch_runs_until_its_last_member_finishes_and_nobody_joins():
    s = make_scheduler(policy="static")
    add(s, "a", range(5), arrival=0, max_tokens=2)
    add(s, "b", range(10, 15), arrival=1, max_tokens=4)
    plan, _ = step(s)
    assert [d.req_id for d in plan.scheduled_new_reqs] == ["a", "b"]
    add(s, "c", range(20, 25), arrival=2, max_tokens=1)
    plan, outs = step(s)
    assert outs["a"].finish_reason == "length" and "c" not in plan.num_scheduled_tokens
    assert s.get_stats().waiting_by_reason["static_batch"] == 1
    for _ in range(2):  # b alone, c still not admitted although a's blocks are free
        plan, outs = step(s)
        assert plan.num_scheduled_tokens == {"b": 1}
    assert outs["b"].finish_reason == "length"
    plan, outs = step(s)  # the engine is idle: the next batch forms
    assert [d.req_id for d in plan.scheduled_new_reqs] == ["c"]


def test_fcfs_lets_new_requests_join_the_running_batch():
    s = make_scheduler()
    add(s, "a", range(5), arrival=0, max_tokens=4)
    step(s)
    add(s, "c", range(20, 25), arrival=2)
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"a": 1, "c": 5}


def test_contiguous_reserves_at_admission_and_never_allocates_again():
    s = make_scheduler(num_blocks=8, kv_allocation="contiguous")
    add(s, "a", range(5), arrival=0, max_tokens=10)  # cdiv(5 + 10, 4) = 4 blocks
    add(s, "b", range(5), arrival=1, max_tokens=10)  # same prompt: no sharing
    add(s, "c", range(5), arrival=2, max_tokens=10)
    plan, _ = step(s)
    assert [(d.req_id, d.block_ids, d.num_computed_tokens) for d in plan.scheduled_new_reqs] == [
        ("a", [0, 1, 2, 3], 0), ("b", [4, 5, 6, 7], 0)]
    assert s.get_stats().waiting_by_reason["no_blocks"] == 1
    for _ in range(9):
        plan, outs = step(s)
        assert plan.scheduled_cached_reqs.new_block_ids == [[], []]
    assert outs["a"].finish_reason == "length" and outs["b"].finish_reason == "length"
    plan, _ = step(s)
    (new,) = plan.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("c", [3, 2, 1, 0], 0)  # a finished first: its blocks head the queue
    assert s.get_stats().prefix_cache_hits == 0


def test_priority_policy_admits_lower_values_first_ties_by_arrival():
    s = make_scheduler(policy="priority", max_seqs=1)
    add(s, "late-urgent", range(5), arrival=3, priority=0, max_tokens=1)
    add(s, "background", range(5), arrival=0, priority=5, max_tokens=1)
    add(s, "early-urgent", range(5), arrival=1, priority=0, max_tokens=1)
    order = []
    while s.has_unfinished_requests():
        plan, _ = step(s)
        order += [d.req_id for d in plan.scheduled_new_reqs]
    assert order == ["early-urgent", "late-urgent", "background"]


def test_priority_victim_may_be_already_scheduled_this_step():
    s = make_scheduler(policy="priority", num_blocks=4)
    low = add(s, "low", range(6), arrival=0, priority=1)
    step(s)  # low [0, 1]
    add(s, "high", range(100, 108), arrival=1, priority=0)
    step(s)  # low decodes token 6; high prefills into [2, 3]
    # low's token 7 fits its block 1 and is scheduled first; then high needs a block for
    # token 8, and the victim is low (larger priority value): its step is taken back.
    plan, outs = step(s)
    assert plan.num_scheduled_tokens == {"high": 1} and plan.preempted_req_ids == ["low"]
    assert plan.scheduled_cached_reqs.req_ids == ["high"]
    assert plan.scheduled_cached_reqs.new_block_ids == [[1]]  # low's tail, freed first
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert list(outs) == ["high"] and low.num_output_tokens == 2
    assert plan.total_num_scheduled_tokens == 1


def test_watermark_holds_back_admission_but_not_running_requests():
    s = make_scheduler(num_blocks=10, watermark=0.2)  # 2 blocks held back at admission
    add(s, "a", range(16), arrival=0, max_tokens=20)
    add(s, "b", range(100, 120), arrival=1)
    plan, _ = step(s)  # a takes 4 blocks; b's 5 would leave 1 < 2 free
    assert list(plan.num_scheduled_tokens) == ["a"]
    for _ in range(17):  # a grows into the watermark: 33 computed tokens, 9 blocks
        plan, _ = step(s)
        assert list(plan.num_scheduled_tokens) == ["a"]
    assert block_ids(s, "a") == list(range(9)) and free_ids(s) == [9]
    st = s.get_stats()
    assert st.num_preemptions == 0 and st.waiting_by_reason["no_blocks"] == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s = make_scheduler(budget=32, max_model_len=32, chunked=False)
    add(s, "a", range(20), arrival=0, max_tokens=2)
    add(s, "b", range(100, 120), arrival=1, max_tokens=2)
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"a": 20}  # b does not fit the remaining 12
    assert s.get_stats().waiting_by_reason["no_budget"] == 1
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 20}


def test_max_num_seqs_and_the_waiting_reasons():
    s = make_scheduler(max_seqs=2, budget=12)
    for i in range(4):
        add(s, f"r{i}", range(10 * i, 10 * i + 5), arrival=i)
    plan, _ = step(s)
    # r0 (5) + r1 (5) fit; r2 would fit 2 tokens of budget but max_num_seqs is reached.
    assert plan.num_scheduled_tokens == {"r0": 5, "r1": 5}
    st = s.get_stats()
    assert (st.running, st.waiting) == (2, 2)
    assert st.waiting_by_reason == {"no_blocks": 0, "no_budget": 0, "max_seqs": 2, "static_batch": 0, "reserved": 0,
                                    "lora_slots": 0}
    assert st.kv_cache_usage == 4 / 16 and st.num_free_blocks == 12 and st.num_blocks == 16


def test_budget_splits_a_prompt_and_the_rest_waits_for_budget():
    s = make_scheduler(budget=8)
    add(s, "a", range(6), arrival=0)
    add(s, "b", range(100, 110), arrival=1)
    add(s, "c", range(200, 203), arrival=2)
    plan, outs = step(s)
    assert plan.num_scheduled_tokens == {"a": 6, "b": 2} and "b" not in outs
    assert s.get_stats().waiting_by_reason["no_budget"] == 1
    plan, outs = step(s)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 7}
    assert plan.scheduled_cached_reqs.num_computed_tokens == [6, 2]


def test_waiting_queue_bound_raises_queue_full():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                                  max_waiting_requests=1), CacheConfig(num_blocks=16, block_size=4))
    add(s, "a", range(5))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        add(s, "b", range(5))
    step(s)  # a is running now: the queue has room again
    add(s, "b", range(5))
