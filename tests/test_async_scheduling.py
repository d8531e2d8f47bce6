"""Async scheduling (``async_scheduling=True``, ``--async-scheduling``): the engine plans
step N+1 while step N runs, then processes N's outputs while N+1 runs.

- the scheduler plans the decode of a token still in flight (a placeholder), exactly;
- a request the next plan preempts keeps the token its last step sampled;
- greedy output equals Hugging Face ``generate()`` token for token in the oracle's modes
  (all at once, chunked prefill, preemption in a small pool, prefix caching), and seeded
  random sampling equals the synchronous engine's;
- failures, stops, aborts and structured outputs while a step is in flight leak nothing.
"""

from __future__ import annotations

import pytest

from _sched_helpers import add, make_scheduler
from fault_plugin import PLUGINS_ENV, PLUGIN_PATH, marker
from pagedserve.cluster.llm import LLM
from pagedserve.scheduler import ModelRunnerOutput, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from test_engine_oracle import MAX_TOKENS, _assert_same, _engine, _params, _run, oracle_case


def _req(s, rid: str, n: int, **kw):
    return add(s, rid, range(1, n + 1), **kw)


def _sampled(plan, token: int = 7) -> ModelRunnerOutput:
    """A token for each request whose scheduled tokens reach its end (the worker's rule)."""
    return ModelRunnerOutput(req_ids=list(plan.num_scheduled_tokens),
                             sampled_token_ids=[[token] for _ in plan.num_scheduled_tokens],
                             step_id=plan.step_id)


# ---------------------------------------------------------------- the scheduler, exact plans
def test_the_next_plan_decodes_the_token_in_flight():
    s = make_scheduler(num_blocks=16)
    _req(s, "a", 20)
    p1 = s.schedule()
    assert p1.num_scheduled_tokens == {"a": 20}
    p2 = s.schedule()  # before p1's result: the token p1 samples is decoded in p2
    assert p2.num_scheduled_tokens == {"a": 1}
    assert p2.scheduled_cached_reqs.num_computed_tokens == [20]
    r = s.requests["a"]
    assert r.num_computed_tokens == 21 and r.num_output_placeholders == 2
    s.update_from_output(p1, _sampled(p1, 5))
    assert r.output_token_ids == [5] and r.num_output_placeholders == 1
    s.update_from_output(p2, _sampled(p2, 6))
    assert r.output_token_ids == [5, 6] and r.num_output_placeholders == 0
    # Synchronous stepping is the same rule with the result in between: no placeholder left.
    p3 = s.schedule()
    s.update_from_output(p3, _sampled(p3, 8))
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == 22 and r.output_token_ids == [5, 6, 8]


def test_no_plan_past_max_tokens_and_a_finished_request_is_freed_once():
    s = make_scheduler(num_blocks=16)
    _req(s, "a", 8, max_tokens=2)
    p1 = s.schedule()
    p2 = s.schedule()
    assert p2.num_scheduled_tokens == {"a": 1}
    p3 = s.schedule()  # two tokens in flight are all max_tokens allows: nothing more
    assert p3.num_scheduled_tokens == {}
    s.update_from_output(p1, _sampled(p1))
    outs = s.update_from_output(p2, _sampled(p2))
    assert outs[0].finish_reason == "length" and "a" not in s.requests
    assert s.kv_cache_manager.num_free_blocks == 16


def test_a_request_preempted_by_the_next_plan_keeps_its_token():
    # 4 blocks of 4 tokens: a (8 tokens) and b (7) fill 4 blocks; a's next token needs a 5th.
    s = make_scheduler(num_blocks=4)
    _req(s, "a", 8)
    _req(s, "b", 7)
    p1 = s.schedule()
    assert p1.num_scheduled_tokens == {"a": 8, "b": 7}
    p2 = s.schedule()  # a's decode needs a block: the newest request, b, is preempted
    assert p2.preempted_req_ids == ["b"] and p2.num_scheduled_tokens == {"a": 1}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    outs = {o.req_id: o for o in s.update_from_output(p1, _sampled(p1, 9))}
    # b's token from p1 is kept (the worker appended it too) and streamed.
    assert b.output_token_ids == [9] and b.all_token_ids[-1] == 9 and outs["b"].new_token_ids == [9]
    assert outs["b"].finish_reason is None
    s.update_from_output(p2, _sampled(p2, 3))
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    p3 = s.schedule()  # b resumes: its recompute covers the 7 prompt tokens and its token
    assert p3.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert s.requests["b"].num_computed_tokens == 8  # (4 of them a prefix-cache hit on a's block)


def test_a_late_token_that_ends_the_request_takes_it_out_of_the_queue():
    s = make_scheduler(num_blocks=4)
    _req(s, "a", 8)
    _req(s, "b", 7, max_tokens=1)
    p1 = s.schedule()
    p2 = s.schedule()
    assert p2.preempted_req_ids == ["b"]
    outs = {o.req_id: o for o in s.update_from_output(p1, _sampled(p1))}
    assert outs["b"].finish_reason == "length"
    assert "b" not in s.requests and len(s.waiting) == 0
    assert "b" in s.schedule().finished_req_ids


# ---------------------------------------------------------------- the engine against the oracle
@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from pagedserve.worker.loading.random_models import make_test_model

    return oracle_case(make_test_model("llama-gqa4-hd128", tmp_path_factory.getbasetemp() / "async-models"))


def _count_plans_ahead(engine) -> list[int]:
    """Counts plans made while a sampled token had not come back (a placeholder)."""
    sched, count = engine.scheduler, [0]
    schedule = sched.schedule

    def counting():
        count[0] += any(r.num_output_placeholders for r in sched.running)
        return schedule()

    sched.schedule = counting
    return count


@pytest.mark.parametrize("mode", ["all_at_once", "chunked_32", "preempt", "prefix"])
def test_greedy_equals_transformers(case, mode):
    path, prompts, refs = case
    kw = {"all_at_once": {}, "chunked_32": dict(max_num_batched_tokens=32),
          "preempt": dict(num_gpu_blocks_override=24, max_num_batched_tokens=128),
          "prefix": dict(enable_prefix_caching=True)}[mode]
    engine = _engine(path, async_scheduling=True, **{"enable_prefix_caching": False, **kw})
    ahead = _count_plans_ahead(engine)
    _assert_same(_run(engine, prompts, _params()), refs)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and not engine.has_unfinished_requests()
    assert ahead[0] > 0.8 * stats.step_id  # most plans were made while a step was in flight
    if mode == "preempt":
        assert stats.num_preemptions > 0
    if mode == "prefix":
        assert stats.prefix_cache_hits > 0


def test_seeded_sampling_equals_the_synchronous_engine(case):
    path, prompts, _ = case
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=m, detokenize=False)
              for i, m in enumerate(MAX_TOKENS)]
    got = {}
    for flag in (False, True):
        engine = _engine(path, num_gpu_blocks_override=24, max_num_batched_tokens=128,
                         enable_prefix_caching=False, async_scheduling=flag)
        ahead = _count_plans_ahead(engine)
        got[flag] = _run(engine, prompts, params)
        assert (ahead[0] > 0) == flag
        assert engine.get_stats().num_preemptions > 0
    assert got[True] == got[False]


def test_stop_strings_aborts_and_a_failing_request_leave_nothing_behind(case, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, PLUGIN_PATH)
    path, prompts, refs = case
    llm = LLM(model=path, max_model_len=512, num_gpu_blocks_override=64, max_num_seqs=8, async_scheduling=True)
    engine = llm.engine
    ok = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    engine.add_request("ok", prompts[6], ok)
    engine.add_request("bad", prompts[7], SamplingParams(temperature=0.0, max_tokens=24, stop=[marker("setup")]))
    engine.add_request("gone", prompts[8], ok)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request("gone")  # while a step holding it is in flight
        if steps == 5:  # a step that raises while the next plan is already queued behind it
            engine.add_request("step", prompts[5], SamplingParams(temperature=0.0, max_tokens=24,
                                                                   stop=[marker("step")]))
    assert done["bad"].error is not None and "gone" not in done
    assert done["step"].error is not None and "engine step failed" in done["step"].error
    assert done["ok"].outputs[0].token_ids == llm.generate([prompts[6]], ok, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.scheduler.kv_cache_manager.usage == 0.0 and not engine.scheduler.requests


def test_structured_outputs_step_in_turn(case):
    path, prompts, _ = case
    llm = LLM(model=path, max_model_len=512, num_gpu_blocks_override=64, async_scheduling=True)
    from pagedserve.scheduler.sampling_params import StructuredOutputsParams

    p = SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False)
    outs = llm.generate([prompts[3], prompts[5]], [p, free], use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no", "maybe")
    sync = LLM(model=path, max_model_len=512, num_gpu_blocks_override=64)
    assert outs[1].outputs[0].token_ids == sync.generate([prompts[5]], free, use_tqdm=False)[0].outputs[0].token_ids


def test_the_serving_engine_streams_the_same_tokens(case):
    """The scheduler actor's loop (AsyncEngine, as Serve runs it) with --async-scheduling:
    six concurrent streams get exactly the synchronous engine's tokens, and their deltas add up
    to them with no empty item (a reader that fell behind a step gets two steps as one item:
    the output channel merges what its reader missed)."""
    import asyncio

    from _replica_client import generate
    from pagedserve.cluster.replica.engine_replica import AsyncEngine
    from pagedserve.config import EngineConfig

    path, prompts, _ = case
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def stream(core, rid, prompt):
        gen = generate(core, rid, prompt, params)
        assert (await gen.__anext__()).accepted
        deltas, tokens = [], []
        async for out, _ in gen:
            deltas.append(list(out.outputs[0].delta_token_ids))
            tokens = list(out.outputs[0].token_ids)
        return tokens, deltas

    got = {}
    for flag in (False, True):
        core = AsyncEngine(EngineConfig(model=path, dtype="float32", max_model_len=512,
                                        num_gpu_blocks_override=128, max_num_seqs=4, async_scheduling=flag))
        try:
            async def all_streams():
                return await asyncio.wait_for(asyncio.gather(
                    *(stream(core, f"r{i}", prompts[i + 4]) for i in range(6))), 60)

            got[flag] = asyncio.run(all_streams())
        finally:
            core.shutdown()
    assert [t for t, _ in got[True]] == [t for t, _ in got[False]]
    for flag in (False, True):
        for tokens, deltas in got[flag]:
            assert len(tokens) == 20 and all(deltas) and [t for d in deltas for t in d] == tokens
