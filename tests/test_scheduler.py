"""Scheduler: the step plan a worker sees, chunked prefill mixed with decodes,
preemption by recompute and resume, abort in every state, stop conditions, rejection.

Unless said otherwise: block_size 4 (block k of a request holds tokens [4k, 4k+4)),
no watermark, fake sampled token 7."""

import pytest
from _sched_helpers import add, block_ids, free_ids, make_scheduler, step

from pagedserve.scheduler import ModelRunnerOutput, RequestStatus


def test_first_plan_carries_new_requests_in_full_then_only_diffs():
    s = make_scheduler()
    add(s, "a", range(10), arrival=0)
    add(s, "b", range(20, 25), arrival=1)
    plan, outs = step(s)
    assert [(d.req_id, d.block_ids, d.num_computed_tokens) for d in plan.scheduled_new_reqs] == [
        ("a", [0, 1, 2], 0), ("b", [3, 4], 0)]
    assert plan.scheduled_new_reqs[0].prompt_token_ids == list(range(10))
    assert plan.num_scheduled_tokens == {"a": 10, "b": 5} and plan.total_num_scheduled_tokens == 15
    assert outs["a"].new_token_ids == [7] and outs["a"].finish_reason is None
    plan, _ = step(s)  # decode: a's token 10 fits block 2, b's token 5 fits block 4
    assert plan.scheduled_new_reqs == []
    c = plan.scheduled_cached_reqs
    assert (c.req_ids, c.new_block_ids, c.num_computed_tokens) == (["a", "b"], [[], []], [10, 5])
    assert c.resumed_from_preemption == [False, False]
    step(s)
    plan, _ = step(s)  # a computes token 12: a new block
    assert plan.scheduled_cached_reqs.new_block_ids == [[5], []]
    assert block_ids(s, "a") == [0, 1, 2, 5]


def test_chunked_prefill_of_1000_tokens_while_decodes_continue():
    s = make_scheduler(num_blocks=100, block_size=16, budget=256, max_model_len=2048)
    add(s, "d1", range(20), arrival=0, max_tokens=100)
    add(s, "d2", range(100, 120), arrival=1, max_tokens=100)
    step(s)  # both prefills: d1 [0, 1], d2 [2, 3]
    add(s, "long", range(1000, 2000), arrival=2, max_tokens=10)
    chunks, new_blocks = [], []
    for k in range(4):
        plan, outs = step(s)
        assert plan.total_num_scheduled_tokens <= 256
        assert plan.num_scheduled_tokens["d1"] == 1 and plan.num_scheduled_tokens["d2"] == 1
        assert outs["d1"].new_token_ids == [7] and outs["d2"].new_token_ids == [7]
        chunks.append(plan.num_scheduled_tokens["long"])
        if k == 0:
            (new,) = plan.scheduled_new_reqs
            assert new.req_id == "long" and new.num_computed_tokens == 0
            new_blocks.append(new.block_ids)
        else:
            c = plan.scheduled_cached_reqs
            assert c.num_computed_tokens[c.req_ids.index("long")] == sum(chunks[:-1])
            new_blocks.append(c.new_block_ids[c.req_ids.index("long")])
        # Only the last chunk reaches the end of the prompt and samples a token.
        assert ("long" in outs) == (k == 3)
    assert chunks == [254, 254, 254, 238]
    # 254 tokens need cdiv(254, 16) = 16 blocks; later chunks top up to cdiv(508, 16) ...
    assert new_blocks == [list(range(4, 20)), list(range(20, 36)), list(range(36, 52)), list(range(52, 67))]
    assert s.requests["long"].num_computed_tokens == 1000 and s.requests["long"].output_token_ids == [7]
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 1}


def test_preemption_by_recompute_and_resume_with_the_whole_new_table():
    s = make_scheduler(num_blocks=6, max_model_len=64)
    a = add(s, "a", range(8), arrival=0, max_tokens=6)
    b = add(s, "b", range(100, 108), arrival=1, max_tokens=20)
    step(s)  # a [0, 1], b [2, 3]
    step(s)  # token 8 of each opens a block: a [.., 4], b [.., 5]
    for _ in range(3):
        plan, _ = step(s)
    assert (block_ids(s, "a"), block_ids(s, "b"), free_ids(s)) == ([0, 1, 4], [2, 3, 5], [])
    # a needs a block for token 12; none is free: the most recent arrival b is preempted.
    plan, outs = step(s)
    assert plan.preempted_req_ids == ["b"] and plan.num_scheduled_tokens == {"a": 1}
    assert plan.scheduled_cached_reqs.new_block_ids == [[5]]  # b's freed tail block
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and list(s.waiting) == [b]
    assert outs["a"].finish_reason == "length"  # a's 6th token; its blocks go back at once
    assert free_ids(s) == [3, 2, 5, 4, 1, 0]
    # b comes back: 8 prompt + 5 output tokens; its prompt blocks 2, 3 are still cached
    # (block 5 with tokens 8..11 was evicted when a took it), so 8 tokens are a hit.
    plan, outs = step(s)
    assert plan.scheduled_new_reqs == []
    c = plan.scheduled_cached_reqs
    assert (c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens) == (
        ["b"], [True], [[2, 3, 5, 4]], [8])
    assert plan.num_scheduled_tokens == {"b": 5} and plan.finished_req_ids == ["a"]
    assert outs["b"].new_token_ids == [7] and b.num_output_tokens == 6
    stats = s.get_stats()
    assert stats.num_preemptions == 1
    # The recomputed prefix hit is not counted as a prefix-cache hit.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16, 0)
    assert b.num_cached_tokens == 0 and outs["b"].num_cached_tokens == 0


def test_the_victim_is_the_cheapest_to_recompute_even_if_that_is_the_requester():
    s = make_scheduler(num_blocks=4)
    add(s, "a", range(6), arrival=0)
    add(s, "b", range(100, 108), arrival=1)
    step(s)  # a [0, 1], b [2, 3]
    # a's token 6 fits; b's token 8 needs a block. a holds 6 computed tokens, b 8: a is
    # the cheaper recompute, so a (already scheduled this step) is taken back and preempted.
    plan, _ = step(s)
    assert plan.num_scheduled_tokens == {"b": 1} and plan.preempted_req_ids == ["a"]
    assert [r.req_id for r in s.running] == ["b"] and block_ids(s, "b") == [2, 3, 1] and free_ids(s) == [0]
    assert s.get_stats().waiting_by_reason["no_blocks"] == 1
    assert s.requests["a"].num_preemptions == 1


def test_request_that_needs_a_block_and_is_cheapest_preempts_itself():
    s = make_scheduler(num_blocks=3)
    add(s, "a", range(6), arrival=0)
    add(s, "b", range(100, 104), arrival=1)
    step(s)  # a [0, 1], b [2]: the pool is full
    plan, _ = step(s)  # b's token 4 needs a block; b (4 computed) is cheaper than a (6)
    assert plan.num_scheduled_tokens == {"a": 1} and plan.preempted_req_ids == ["b"]
    assert [r.req_id for r in s.running] == ["a"] and free_ids(s) == [2]


def test_abort_in_every_state_frees_blocks_before_the_next_plan():
    s = make_scheduler(num_blocks=4)
    add(s, "waiting", range(50, 58), arrival=5)
    add(s, "running", range(6), arrival=0, max_tokens=1)
    s.abort_requests(["waiting"])
    assert list(s.waiting) and s.requests.keys() == {"running"}
    plan, outs = step(s)
    assert plan.finished_req_ids == ["waiting"]
    assert outs["running"].finish_reason == "length"
    s.abort_requests(["running"])  # already finished: a no-op
    s.abort_requests(["never-added"])
    add(s, "r1", range(6), arrival=0)
    add(s, "r2", range(100, 108), arrival=1)
    step(s)
    step(s)  # r1 is preempted for r2 (the cheaper recompute, see above)
    assert s.requests["r1"].status == RequestStatus.PREEMPTED
    s.abort_requests("r1")
    assert len(s.waiting) == 0
    used = block_ids(s, "r2")
    s.abort_requests(["r2"])  # running: its blocks are free right now
    assert block_ids(s, "r2") == [] and sorted(free_ids(s)) == [0, 1, 2, 3] and used
    plan, outs = step(s)
    assert plan.is_empty and outs == {}
    assert sorted(plan.finished_req_ids) == ["r1", "r2"] and not s.has_unfinished_requests()


def test_abort_between_schedule_and_update_is_ignored():
    s = make_scheduler()
    add(s, "a", range(5))
    add(s, "b", range(10, 15))
    plan = s.schedule()
    s.abort_requests(["a"])
    outs = s.update_from_output(plan, ModelRunnerOutput(["a", "b"], [[7], [7]]))
    assert [o.req_id for o in outs] == ["b"]
    assert s.schedule().finished_req_ids == ["a"]


@pytest.mark.parametrize("kw, tokens, expect_out, reason, stop_reason", [
    (dict(eos=2), [5, 2, 9], [5, 2], "stop", None),
    (dict(eos=2, ignore_eos=True, max_tokens=3), [5, 2, 2, 2], [5, 2, 2], "length", None),
    (dict(eos=2, stop_token_ids=[9]), [5, 9, 2], [5, 9], "stop", 9),
    (dict(eos=2, min_tokens=3), [2, 2, 2, 2], [2, 2, 2], "stop", None),
    (dict(eos=2, min_tokens=2, stop_token_ids=[9]), [9, 5, 9], [9, 5, 9], "stop", 9),
    (dict(max_tokens=4), [1, 2, 3, 4, 5], [1, 2, 3, 4], "length", None),
    (dict(max_tokens=None), [1] * 30, [1] * 6, "length", None),  # max_model_len 16
])
def test_stop_conditions(kw, tokens, expect_out, reason, stop_reason):
    s = make_scheduler(max_model_len=16)
    req = add(s, "r", range(10), **kw)
    got, outs = [], {}
    for tok in tokens:
        _, outs = step(s, token=tok)
        got += outs["r"].new_token_ids
        if outs["r"].finish_reason:
            break
    assert got == expect_out and req.output_token_ids == expect_out
    assert (outs["r"].finish_reason, outs["r"].stop_reason) == (reason, stop_reason)
    assert req.finish_reason == reason and not s.has_unfinished_requests()
    assert len(free_ids(s)) == 16


def test_several_sampled_tokens_are_cut_at_the_stop_token():
    s = make_scheduler()
    req = add(s, "r", range(10), eos=2)
    _, outs = step(s, tokens={"r": [5, 2, 6]})
    assert outs["r"].new_token_ids == [5, 2] and outs["r"].finish_reason == "stop"
    assert req.all_token_ids == list(range(10)) + [5, 2]


def test_finish_requests_with_a_stop_string():
    s = make_scheduler()
    req = add(s, "r", range(10))
    step(s)
    s.finish_requests(["r"], RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert (req.finish_reason, req.stop_reason) == ("stop", "\n\n")
    assert s.schedule().finished_req_ids == ["r"] and len(free_ids(s)) == 16
    with pytest.raises(ValueError):
        s.finish_requests(["x"], RequestStatus.RUNNING)


def test_rejections_at_add_request():
    s = make_scheduler(num_blocks=4, max_model_len=32)  # the pool holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len is 32"):
        add(s, "long", range(32))
    with pytest.raises(ValueError, match="whole pool holds 4 blocks"):
        add(s, "big", range(16))
    add(s, "ok", range(15), max_tokens=100)
    # max_tokens is capped so the sequence fits the pool (and max_model_len).
    assert s.requests["ok"].max_tokens == 1
    with pytest.raises(ValueError, match="already exists"):
        add(s, "ok", range(3))
    with pytest.raises(ValueError, match="at least one token"):
        add(s, "empty", [])


def test_prefix_hit_at_admission_is_counted_and_reported():
    s = make_scheduler()
    add(s, "a", range(12), max_tokens=1)
    step(s)  # a computes its prompt (blocks 0..2 cached), samples, finishes
    add(s, "b", list(range(12)) + [50, 51, 52])
    plan, outs = step(s)
    (new,) = plan.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 2, 3], 12)
    assert plan.num_scheduled_tokens == {"b": 3}
    assert outs["b"].num_cached_tokens == 12
    st = s.get_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (12 + 15, 12)
    assert st.num_prompt_tokens == 27 and st.num_generation_tokens == 2
