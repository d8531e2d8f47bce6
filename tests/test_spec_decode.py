"""Speculative decoding with prompt lookup (n-gram) drafts, from the proposer up.

- the proposer: first occurrence of the longest suffix n-gram, bounded drafts;
- the scheduler: lookahead slots, roll back on rejection, no cached block with an
  unverified token, no preemption for a draft, caps, adaptive pauses;
- the sampler: rejection sampling keeps the target distribution (chi-square);
- the engine: greedy output equals Hugging Face ``generate()`` token for token with
  speculation on (plain, chunked prefill, forced preemption, prefix-cache hits), and
  equals speculation off for logprobs, stop strings, n > 1 and max_tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.scheduler import (CacheConfig, ModelRunnerOutput, Request, SamplingParams, Scheduler,
                                  SchedulerConfig)
from pagedserve.scheduler.config import SpeculativeConfig
from pagedserve.scheduler.ngram_proposer import (MAX_EMPTY_PROPOSALS, AcceptanceModel, DraftingGate,
                                                 NgramProposer, StepCost)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# ---------------------------------------------------------------- config
def test_config_parses_vllm_json_and_names_what_it_refuses():
    c = SpeculativeConfig.parse(json.dumps(SPEC))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    # vLLM's defaults: neither bound -> 5 and 5; one bound -> both.
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    for bad, words in (({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
                        "draft_tensor_parallel_size"),
                       ({"method": "ngram"}, "num_speculative_tokens is required"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({**SPEC, "prompt_lookup_min": 5}, "prompt_lookup_min=5 must be <= prompt_lookup_max=4"),
                       ("{not json", "not valid JSON")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            SpeculativeConfig.parse(bad)


def test_cli_flag_is_vllms():
    import argparse

    from pagedserve.cluster.cli.args import add_engine_args, engine_config_from_args

    parser = add_engine_args(argparse.ArgumentParser())
    cfg = engine_config_from_args(parser.parse_args(["--speculative-config", json.dumps(SPEC)]))
    assert cfg.speculative_config == SpeculativeConfig(**SPEC)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'])


# ---------------------------------------------------------------- proposer
def test_proposer_drafts_from_the_longest_suffix_and_the_passage_being_copied():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 1, 2, 3, 9, 8, 4, 2, 3, 7, 6, 2, 3]
    # Suffix [2, 3] ends at 3 and at 8 (the 3-gram [6, 2, 3] never occurred). Neither is
    # preceded by the suffix's own 6, both have 3 tokens after them: the latest -> [7, 6, 2].
    assert p.propose("a", tokens, 3, 0) == [7, 6, 2]
    tokens += [9, 8]  # suffix [3, 9, 8] ended at 5 -> 4, 2, 3 (the longest n wins)
    assert p.propose("a", tokens, 3, 1) == [4, 2, 3]
    assert p.propose("a", tokens, 1, 2) == [4]  # max_k caps it
    # A suffix only matches an earlier occurrence, never itself; a 1-gram is below min.
    assert p.propose("b", [4, 4], 3, 0) == []
    assert p.propose("c", [4, 4, 4], 3, 0) == [4]  # [4, 4] ended at 1 -> continuation [4]
    assert p.num_proposals == 5
    q = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2))
    # The occurrence whose tokens before it match the suffix's wins over the first and the
    # latest: [1, 2] ends at 1, at 5 (after 7, as the suffix) and at 9 (after 8).
    #                      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    assert q.propose("d", [1, 2, 5, 7, 1, 2, 6, 8, 1, 2, 4, 7, 1, 2], 3, 0) == [6, 8, 1]
    # On equal contexts, the longer continuation: [1, 2] ends at 1 (3 tokens follow) and
    # at 6, right before the suffix (2 follow).
    #                      0  1  2  3  4  5  6  7  8
    assert q.propose("e", [1, 2, 9, 3, 5, 1, 2, 1, 2], 3, 0) == [9, 3, 5]


# ---------------------------------------------------------------- scheduler
def _sched(num_blocks=32, budget=64, spec=None, max_seqs=8, **kw) -> Scheduler:
    spec = SpeculativeConfig(**(spec or {"num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 2}))
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=128,
                                     speculative_config=spec),
                     CacheConfig(num_blocks=num_blocks, block_size=4, watermark=0.0, **kw))


def _add(s: Scheduler, rid: str, prompt, eos=None, **sp) -> Request:
    sp.setdefault("max_tokens", 32)
    req = Request(rid, list(prompt), SamplingParams(**sp), eos_token_id=eos)
    s.add_request(req)
    return req


def _run(s: Scheduler, plan, tokens: dict[str, list[int]]):
    result = ModelRunnerOutput(req_ids=list(plan.num_scheduled_tokens),
                               sampled_token_ids=[tokens.get(r, []) for r in plan.num_scheduled_tokens],
                               step_id=plan.step_id)
    return {o.req_id: o for o in s.update_from_output(plan, result)}


PROMPT = [10, 11, 12, 13, 14, 15, 10, 11]  # suffix [10, 11] first ends at 1 -> drafts 12, 13, 14


def test_drafts_take_lookahead_slots_and_roll_back_to_the_verified_count():
    s = _sched()
    req = _add(s, "r", PROMPT)
    plan = s.schedule()  # prefill: no drafts (a prefill samples one token)
    assert plan.num_scheduled_tokens == {"r": 8} and not plan.scheduled_spec_decode_tokens
    _run(s, plan, {"r": [12]})  # tokens ... 10 11 12: suffix [11, 12] -> 13 14 15
    plan = s.schedule()
    assert plan.scheduled_spec_decode_tokens == {"r": [13, 14, 15]}
    assert plan.num_scheduled_tokens == {"r": 4}  # the last token + 3 drafts
    assert req.num_computed_tokens == 12
    assert s.kv_cache_manager.get_block_ids("r") == [0, 1, 2]  # slots 8..11 in a third block
    # The worker accepted 13 and 14, rejected 15 and sampled 99 in its place.
    outs = _run(s, plan, {"r": [13, 14, 99]})
    assert outs["r"].new_token_ids == [13, 14, 99]
    assert req.num_computed_tokens == 11  # 12 - the 1 rejected draft
    assert req.all_token_ids == PROMPT + [12, 13, 14, 99]
    assert s.kv_cache_manager.get_block_ids("r") == [0, 1, 2]  # the block stays for the next tokens
    stats = s.get_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 2)
    assert stats.spec_num_accepted_tokens_per_pos == [1, 1, 0]


def test_a_block_with_an_unverified_token_is_never_cached():
    """Random verdicts on every draft; after each step the computed count covers only
    verified tokens, and every cached block holds the request's own tokens."""
    import random

    rng = random.Random(0)
    s = _sched(num_blocks=64, enable_prefix_caching=True)
    req = _add(s, "r", PROMPT * 3, max_tokens=200)
    _run(s, s.schedule(), {"r": [12]})
    kv, num_drafts = s.kv_cache_manager, 0
    while "r" in s.requests:
        plan = s.schedule()
        draft = plan.scheduled_spec_decode_tokens.get("r", [])
        num_drafts += bool(draft)
        accepted = draft[:rng.randrange(len(draft) + 1)]
        _run(s, plan, {"r": accepted + [rng.choice([10, 11, 12, 99])]})
        if "r" not in s.requests:
            break
        assert req.num_computed_tokens == req.num_tokens - 1  # the last token's K/V comes next step
        node_ids = kv.req_to_node_ids["r"]
        assert len(node_ids) * 4 <= req.num_computed_tokens
        blocks = kv.req_to_blocks["r"]
        for i, (block, node) in enumerate(zip(blocks, node_ids)):
            assert block.node_id == node
            key = next(k for k, b in kv.block_pool.cached_block_hash_to_block.items() if b is block)
            assert list(key[1]) == req.all_token_ids[4 * i:4 * i + 4]
    assert num_drafts > 10 and s.get_stats().spec_num_accepted_tokens > 10


def test_no_preemption_for_drafts_and_caps_on_their_number():
    s = _sched(num_blocks=4)
    _add(s, "a", PROMPT[:7])  # 2 blocks; its next token's slot (7) is in the second
    _add(s, "b", [7] * 5)  # the last two blocks
    _run(s, s.schedule(), {"a": [11], "b": [8]})  # a: 10..15 10 11: drafts 12 13 14 need a third block
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1} and not plan.scheduled_spec_decode_tokens
    assert not s.get_stats().num_preemptions
    # max_tokens: a step yields drafts + 1 tokens, never more than the request has left.
    capped = _sched()
    _add(capped, "m", PROMPT, max_tokens=3)  # (a pool of 12 slots would cap it the same way)
    _run(capped, capped.schedule(), {"m": [12]})
    plan = capped.schedule()
    assert plan.scheduled_spec_decode_tokens == {"m": [13]}  # 1 output so far: 2 left, 1 draft


def test_a_prefill_chunk_cut_to_one_token_does_not_draft():
    """Drafts follow the last token, so a chunk the budget cut to one token must not draft:
    the drafts come out of the same budget, which has no room left for them."""
    s = _sched(budget=8)
    req = _add(s, "r", PROMPT + [12, 13])  # its suffix [12, 13] occurred: a match if it drafted
    _run(s, s.schedule(), {})  # 8 of its 10 prompt tokens
    s.max_num_batched_tokens = 1  # the next step has room for one token of its 2
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"r": 1} and not plan.scheduled_spec_decode_tokens
    _run(s, plan, {})
    s.max_num_batched_tokens = 8
    _run(s, s.schedule(), {"r": [14]})  # the last prompt token samples 14
    assert s.schedule().scheduled_spec_decode_tokens == {"r": [15, 10, 11]}  # now it decodes
    assert req.num_computed_tokens == 14


def test_with_ignore_eos_the_eos_is_drafted_like_any_token():
    s = _sched()
    _add(s, "r", PROMPT, eos=14, ignore_eos=True, max_tokens=4)
    _run(s, s.schedule(), {"r": [12]})
    plan = s.schedule()
    assert plan.scheduled_spec_decode_tokens == {"r": [13, 14]}  # max_tokens: 3 left, 2 drafts
    outs = _run(s, plan, {"r": [13, 14, 15]})  # accepted through the EOS, then max_tokens
    assert outs["r"].new_token_ids == [13, 14, 15] and outs["r"].finish_reason == "length"
    assert not s.requests and s.kv_cache_manager.num_free_blocks == 32


def test_a_draft_ends_before_a_token_that_would_stop_the_request():
    """No row past a stopping token is ever used: the draft stops short of it, and the
    step's last row samples it if the model agrees (then the request ends there)."""
    s = _sched()
    _add(s, "r", PROMPT, eos=14)
    _run(s, s.schedule(), {"r": [12]})
    plan = s.schedule()
    assert plan.scheduled_spec_decode_tokens == {"r": [13]}  # not 13 14 15
    outs = _run(s, plan, {"r": [13, 14]})  # 13 accepted, the EOS sampled by the last row
    assert outs["r"].new_token_ids == [13, 14] and outs["r"].finish_reason == "stop"
    assert not s.requests and s.kv_cache_manager.num_free_blocks == 32
    s = _sched()
    _add(s, "r", PROMPT, stop_token_ids=[13])  # a stop token at the draft's head: no draft
    _run(s, s.schedule(), {"r": [12]})
    assert s.schedule().scheduled_spec_decode_tokens == {}


def test_rejected_drafts_pause_drafting_and_the_engine_may_plan_ahead():
    s = _sched()
    _add(s, "r", PROMPT, max_tokens=100)
    _run(s, s.schedule(), {"r": [12]})
    num_drafted, paused = 0, []
    for _ in range(40):
        plan = s.schedule()
        draft = plan.scheduled_spec_decode_tokens.get("r")
        num_drafted += bool(draft)
        # Always reject: the worker samples a token that repeats what the draft followed.
        _run(s, plan, {"r": [12]})
        paused.append(not s.drafting())
    # Full rejections take the acceptance estimate below the floor in a few steps, and each
    # pause is longer than the last: far fewer drafts than steps.
    assert 2 <= num_drafted <= 10
    assert sum(paused) >= 25  # paused most of the time: the engine plans ahead meanwhile


def test_no_match_for_a_while_pauses_drafting_when_the_engine_may_plan_ahead():
    for pause_when_idle in (True, False):
        s = _sched()
        s.proposer.pause_when_idle = pause_when_idle  # the engine's async_scheduling
        _add(s, "r", [1, 2, 3], max_tokens=100)
        for t in range(4, 4 + MAX_EMPTY_PROPOSALS + 1):
            _run(s, s.schedule(), {"r": [t]})  # always new tokens: never a match
        # Planning ahead needs no request drafting; stepping in turn, looking costs nothing.
        assert s.get_stats().spec_num_proposals == MAX_EMPTY_PROPOSALS
        assert s.drafting() is not pause_when_idle
        _run(s, s.schedule(), {"r": [99]})
        assert s.get_stats().spec_num_proposals == MAX_EMPTY_PROPOSALS + (not pause_when_idle)


def _fitted_cost():
    """A StepCost fed synthetic step times of an exact line: t0 = 20 ms, c = 2 ms a token."""
    cost = StepCost()
    for n, ms in [(1, 22.0), (5, 30.0), (8, 36.0), (40, 100.0)] * 5:
        cost.record(n, ms / 1e3)
    return cost


def test_step_cost_sets_how_many_drafts_pay():
    assert StepCost().fit() is None
    cost = _fitted_cost()
    assert cost.fit() == pytest.approx((0.020, 0.002), rel=1e-6)
    # With that fitted model (t0 = 20, c = 2): alone at acceptance 0.7 all 3 drafts pay,
    # 0.7^3 = 0.34 > c x 2.19 expected tokens / 26 time units. In a batch of 8 only each first
    # draft does: after them 0.49 < c x 13.6 / 52.
    def geometric(alpha, length):
        return [alpha ** (i + 1) for i in range(length)]

    assert cost.select({"r": geometric(0.7, 3)}, 1) == {"r": 3}
    batch = {f"r{i}": geometric(0.7, 3) for i in range(8)}
    assert cost.select(batch, 8) == dict.fromkeys(batch, 1)
    # A likelier request gets more of its draft; an unlikely one none.
    mixed = {"hi": geometric(0.95, 3), "lo": geometric(0.3, 3), **{f"r{i}": [] for i in range(6)}}
    assert cost.select(mixed, 8) == {"hi": 3, "lo": 0, **{f"r{i}": 0 for i in range(6)}}
    # Through the scheduler: the same cut.
    s = _sched()
    s.proposer.cost = cost
    reqs = [_add(s, f"r{i}", PROMPT) for i in range(8)]
    _run(s, s.schedule(), {r.req_id: [12] for r in reqs})
    assert s.schedule().scheduled_spec_decode_tokens == {r.req_id: [13] for r in reqs}
    alone = _sched()
    alone.proposer.cost = cost
    _add(alone, "r", PROMPT)
    _run(alone, alone.schedule(), {"r": [12]})
    assert alone.schedule().scheduled_spec_decode_tokens == {"r": [13, 14, 15]}


def test_a_draft_cut_to_nothing_pauses_only_in_a_step_where_no_draft_pays():
    """Beside a draft that pays the step goes in turn anyway, so the request whose draft was
    cut drafts again at the next step; where nothing of any draft pays, the requests pause
    (the step could be planned ahead)."""
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2))
    p.cost = _fitted_cost()
    tokens = [1, 2, 3, 4, 1, 2]  # [1, 2] ended at 1: drafts [3, 4, 1]
    for step, likely in ((1, True), (2, False)):
        drafts = {}
        for r in ("hi", "lo"):
            drafts[r] = p.propose(r, tokens, 3, step)
            # the request's own record: its first draft tokens always / never accepted
            p._index[r].own = {(2, False): [20.0, 20.0] if r == "hi" and likely else [0.0, 20.0]}
        p.select(drafts, 8, step)
        assert (len(drafts["hi"]) > 0, drafts["lo"]) == (likely, [])
        assert (p.active("hi", step + 1), p.active("lo", step + 1)) == (likely, likely)


def test_step_cost_follows_the_measured_staircase_where_the_line_would_not():
    """On a CPU a second row rides free on the weights' stream and the next few cost one
    step up: the sizes seen often enough are priced at their own measured time, others on
    the fitted line. The staircase verifies a long-shot single draft token (free) and
    stops an unlikely draft after its first token (the next one climbs the step); on the
    line alone (the same ends, no sizes between) the first is not worth a row and the
    second's next token looks worth one."""
    staircase, line = StepCost(), StepCost()
    for n, ms in [(1, 20.0), (2, 20.0), (3, 24.0), (4, 24.0), (5, 24.0), (9, 30.0), (40, 80.0)] * 5:
        staircase.record(n, ms / 1e3)
    for n, ms in [(1, 20.0), (40, 80.0)] * 5:
        line.record(n, ms / 1e3)
    assert staircase.step_time()(2) == pytest.approx(0.020) and staircase.step_time()(5) == pytest.approx(0.024)
    long_shot, unlikely, likely = [0.03], [0.4, 0.1, 0.05, 0.02], [0.5, 0.4, 0.35, 0.3]
    assert [staircase.select({"r": d}, 1) for d in (long_shot, unlikely, likely)] == [{"r": 1}, {"r": 1}, {"r": 4}]
    assert [line.select({"r": d}, 1) for d in (long_shot, unlikely, likely)] == [{"r": 0}, {"r": 2}, {"r": 4}]


def test_acceptance_model_tells_long_matches_from_short_ones():
    """Drafts from 4-token matches that are accepted and from 2-token matches that are not
    (a copied passage beside common pairs of tokens): the model learns the difference, per
    match length and per request, and a batch of 8 verifies the likely drafts whole and the
    unlikely ones not at all."""
    model = AcceptanceModel(range(4, 1, -1), 4)
    copying, chatting = {}, {}
    long_kind, short_kind = (4, True), (2, False)
    for _ in range(30):
        model.record(copying, long_kind, 4, 4)  # all 4 accepted
        model.record(chatting, short_kind, 4, 0)  # the first rejected
    long, short = model.probs(copying, long_kind, 4), model.probs(chatting, short_kind, 4)
    assert long == sorted(long, reverse=True) and long[-1] > 0.9
    assert short[0] < 0.1
    # Another request's first 2-token match: the shared rate, drawn toward no history of its own.
    assert model.probs({}, short_kind, 1)[0] < 0.5 and model.probs({}, long_kind, 1)[0] > 0.9
    cost = _fitted_cost()
    probs = {f"c{i}": model.probs(copying, long_kind, 4) for i in range(4)}
    probs.update({f"s{i}": model.probs(chatting, short_kind, 4) for i in range(4)})
    assert cost.select(probs, 8) == {**{f"c{i}": 4 for i in range(4)}, **{f"s{i}": 0 for i in range(4)}}


def test_a_draft_after_one_accepted_whole_is_its_own_kind():
    """A request copying a passage has its drafts accepted whole, one after another; a 4-token
    match after a rejection is often a passage that diverged. The proposer keys the rates by
    both (match length, last draft accepted whole): after a whole draft the next one is priced
    at the copying rate and verified whole in a batch of 8; after a rejection, with the same
    match length, at the diverging one, and not verified at all."""
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=4))
    p.cost = _fitted_cost()
    text = list(range(100, 140))
    for step in range(40):
        # "copy": its drafts are all accepted; "diverge": its first token never is.
        for r in ("copy", "diverge"):
            assert p.propose(r, text + text[:8], 4, step) == text[8:12]
            p.record(r, 4, 4 if r == "copy" else 0, step)
    assert p._index["copy"].whole and not p._index["diverge"].whole
    drafts = {f"{r}{i}": [] for r in ("copy", "diverge") for i in range(4)}
    for r in drafts:
        drafts[r] = p.propose(r, text + text[:8], 4, 40)
        p._index[r].draft_kind = (4, r.startswith("copy"))  # a new request, as if after such a draft
    p.select(drafts, 8, 40)
    assert {r: len(d) for r, d in drafts.items()} == {
        **{f"copy{i}": 4 for i in range(4)}, **{f"diverge{i}": 0 for i in range(4)}}


def test_drafting_gate_plans_ahead_when_stepping_in_turn_does_not_pay():
    """Where the engine could plan ahead, a step taken in turn to draft costs the time the
    worker sits idle between steps: drafts that save less than that close the gate (no
    request drafts, the engine plans ahead) for a while, longer each time; drafts that save
    more keep it open. Through the scheduler, a closed gate is a plan without drafts."""
    cost = _fitted_cost()
    gate = DraftingGate(cost)
    gate.record_host_time(0.004)
    # In the synthetic fit's units: 8 decoding requests; a pipelined step's time per token
    # 20 / 8 + 2 = 4.5 ms. Each step verifies 8 draft rows (16 ms) and 5 of them are
    # accepted (22.5 ms): 2.5 ms gained.
    for step in range(20):
        assert gate.open(step)
        gate.note_step(step, 8, 8)
        gate.note_accepted(5)
    # Then 2 accepted of 8 (9 ms for 16 ms of rows and 4 of host): it loses, and closes;
    # it opens again to try, loses again, and closes for twice as long.
    closed_runs, run, first_closed = [], 0, None
    for step in range(20, 120):
        if not gate.open(step):
            first_closed = step if first_closed is None else first_closed
            run += 1
            continue
        if run:
            closed_runs.append(run)
            run = 0
        gate.note_step(step, 8, 8)
        gate.note_accepted(2)
    assert first_closed < 32  # 8 steps to see it, a few more to outweigh the good past
    assert closed_runs[:2] == [8, 16]

    s = _sched()
    s.proposer.pause_when_idle = True  # the engine plans ahead
    _add(s, "r", PROMPT, max_tokens=100)
    _run(s, s.schedule(), {"r": [12]})
    assert s.drafting()
    s.proposer.gate.backoff.until = s.step_id + 5
    assert not s.drafting() and not s.schedule().scheduled_spec_decode_tokens
    s.proposer.pause_when_idle = False  # stepping in turn anyway: drafting costs no idle worker
    assert s.drafting()


def test_no_drafts_for_constrained_requests_or_past_the_batch_size_limit():
    s = _sched()
    _add(s, "j", PROMPT, structured_outputs={"json": {"type": "object"}})
    _run(s, s.schedule(), {"j": [12]})
    assert not s.schedule().scheduled_spec_decode_tokens
    s = _sched(spec={"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 2,
                     "disable_by_batch_size": 2})
    _add(s, "a", PROMPT)
    _add(s, "b", PROMPT)
    _run(s, s.schedule(), {"a": [12], "b": [12]})
    assert not s.drafting() and not s.schedule().scheduled_spec_decode_tokens


# ---------------------------------------------------------------- sampler
def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, float]:
    """Pearson's chi-square against ``probs`` below the 0.999 quantile (Wilson-Hilferty)."""
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    exp = probs[keep] * n
    stat = (((counts[keep] - exp) ** 2) / exp).sum().item()
    df = int(keep.sum()) - 1
    z = 3.09  # the 0.999 normal quantile
    crit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return stat < crit, stat


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.0, min_p=0.1), dict(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    from pagedserve.worker.sampler import Sampler, SamplingMetadata

    v, n = 8, 40_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = base.expand(n, v).clone()
    sp = SamplingParams(**params)
    md = SamplingMetadata.build([sp] * n, [None] * n, [[]] * n, [[]] * n, [set()] * n, v, "cpu")
    # The target: what the sampler draws without drafts.
    plain = Sampler(torch.Generator().manual_seed(1))(logits, md).sampled_token_ids
    target = torch.bincount(plain, minlength=v).double() / n
    for draft in (0, 3, 7):  # the likeliest token, a middling one, one that filters may drop
        drafts = torch.full((n,), draft, dtype=torch.int64)
        out = Sampler(torch.Generator().manual_seed(2))(logits, md, drafts).sampled_token_ids
        counts = torch.bincount(out, minlength=v).double()
        ok, stat = _chi2_ok(counts, target)
        assert ok, f"draft {draft}: chi-square {stat:.1f} against the target {target.tolist()}"
    # Rows without a draft (-1) sample as before.
    none = Sampler(torch.Generator().manual_seed(3))(logits, md, torch.full((n,), -1)).sampled_token_ids
    assert _chi2_ok(torch.bincount(none, minlength=v).double(), target)[0]


def test_greedy_rows_ignore_the_draft():
    from pagedserve.worker.sampler import Sampler, SamplingMetadata

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    md = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [None] * 2, [[]] * 2, [[]] * 2,
                                [set()] * 2, 3, "cpu")
    assert Sampler()(logits, md, torch.tensor([1, 2])).sampled_token_ids.tolist() == [1, 0]


# ---------------------------------------------------------------- engine, greedy exactness
sys.path.insert(0, str(Path(__file__).parent))
import test_engine_oracle as oracle  # noqa: E402  (its HF references and drivers)


@pytest.fixture(scope="module", params=oracle.SHAPES)
def shape_case(request, tmp_path_factory):
    from pagedserve.worker.loading.random_models import make_test_model

    return oracle.oracle_case(make_test_model(request.param, tmp_path_factory.getbasetemp() / "spec-models"))


@pytest.mark.parametrize("mode", ["plain", "chunked_32", "preempt", "prefix", "async"])
def test_greedy_equals_hf_with_speculation(shape_case, mode):
    path, prompts, refs = shape_case
    kw = {"plain": {}, "chunked_32": dict(max_num_batched_tokens=32),
          "preempt": dict(num_gpu_blocks_override=24, max_num_batched_tokens=128),
          "prefix": dict(enable_prefix_caching=True), "async": dict(async_scheduling=True)}[mode]
    kw.setdefault("enable_prefix_caching", False)
    engine = oracle._engine(path, speculative_config=SPEC, **kw)
    params = oracle._params()
    if mode == "prefix":  # the same prompts twice: the second round is served from cache
        oracle._assert_same(oracle._run(engine, prompts, params), refs)
    oracle._assert_same(oracle._run(engine, prompts, params), refs)
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 50, "speculation never paid: the test would prove nothing"
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # and some drafts were wrong
    assert stats.num_free_blocks == engine.num_gpu_blocks  # nothing leaked
    if mode == "preempt":
        assert stats.num_preemptions > 0
    if mode == "prefix":  # the second round hit every full block before each last token
        assert stats.prefix_cache_hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    if mode == "async":  # the engine measured the worker's idle time between the steps it took in turn
        assert engine.scheduler.proposer.gate.host_s > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_stop_strings_n_and_max_tokens_match_speculation_off(tmp_path_factory, async_scheduling):
    """Also where the engine may plan ahead: there a step with drafts is sent before the last
    step's outputs are detokenized, so a stop string is found while the next step runs."""
    from pagedserve.cluster.llm import LLM
    from pagedserve.worker.loading.random_models import make_test_model

    path = make_test_model("llama-mha", tmp_path_factory.getbasetemp() / "spec-models")
    prompts = oracle._prompts(256)[4:12]
    runs = {}
    for name, cfg in (("off", None), ("on", SPEC)):
        llm = LLM(model=path, max_model_len=512, num_gpu_blocks_override=256, speculative_config=cfg,
                  async_scheduling=async_scheduling)
        greedy = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, n=2, detokenize=False)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        runs[name] = [[(c.token_ids, c.finish_reason, [(lp.token_ids, lp.logprobs) for lp in c.logprobs])
                       for c in o.outputs] for o in outs]
        texts = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
        stops = [o.outputs[0].text[5:8] for o in texts]  # a stop string inside each output
        runs[name + "_stop"] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(
            prompts, [SamplingParams(temperature=0.0, max_tokens=40, stop=[s]) for s in stops], use_tqdm=False)]
        runs[name + "_stats"] = llm.engine.get_stats()
        if cfg and async_scheduling:  # steps were taken in turn, each sent before the last one's outputs
            assert llm.engine.scheduler.proposer.gate.host_s > 0
    # Planning ahead, the engine drafts only in the host time a step leaves it (the proposer's
    # gate), which the machine's load and the worker's speed decide: some drafts, not a count.
    assert runs["on_stats"].spec_num_accepted_tokens > (0 if async_scheduling else 20)
    for got, want in zip(runs["on"], runs["off"]):
        for (ids, reason, lps), (ids0, reason0, lps0) in zip(got, want):
            assert (ids, reason) == (ids0, reason0) and len(ids) == 40
            for (t, lp), (t0, lp0) in zip(lps, lps0):
                assert t[0] == t0[0] and lp == pytest.approx(lp0, abs=1e-4)
    assert runs["on_stop"] == runs["off_stop"]
    assert all(reason == "stop" for _, reason in runs["on_stop"])
