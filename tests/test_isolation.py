"""Failure isolation inside the engine step, offline (no Ray, no HTTP).

The story: a request that fails on its own (a real one: a seed torch cannot take; a
planted one at each place a request can fail inside a step, the step itself included)
fails alone. Its neighbours in the same batch get exactly the tokens they get without it,
its blocks come back and nothing stays running. Only a worker that cannot compute at all
(every part of the batch and the probe fail) is the engine's failure: it reaches the
caller, and the engine is left with nothing unfinished.
"""

from __future__ import annotations

import os

import pytest

from fault_plugin import PLUGINS_ENV, PLUGIN_PATH, SITES, marker
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

PROMPTS = [[5, 9, 13, 17, 21, 25], [7, 11, 3, 40, 41, 42, 43, 44, 45]]


ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "iso-models")


def _build(model, inject: bool, **kw):
    """The hooks are installed when the engine is built, or never (off the hot path)."""
    from pagedserve.cluster.llm import LLM

    saved = os.environ.pop(PLUGINS_ENV, None)
    if inject:
        os.environ[PLUGINS_ENV] = PLUGIN_PATH
    try:
        return LLM(model=model, **{**ENGINE, **kw})
    finally:
        os.environ.pop(PLUGINS_ENV, None)
        if saved is not None:
            os.environ[PLUGINS_ENV] = saved


@pytest.fixture(scope="module")
def llm(model):
    engine = _build(model, inject=True)
    yield engine
    engine.shutdown()


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _seeded(seed: int, n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True)


def _idle(llm) -> None:
    stats = llm.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_seed_outside_int64_is_refused_up_front():
    for seed in (2**63, 2**64, 2**64 - 1, -(2**63) - 1, True):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))


def test_n2_at_the_top_of_the_seed_range_wraps_instead_of_overflowing(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, seed=2**63 - 1, temperature=1.0,
                                                    max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [8, 8]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    _idle(llm)


@pytest.mark.parametrize("site", ["setup", "sample", "detokenize", "step"])
def test_planted_failure_fails_that_request_alone(llm, site):
    """Greedy and seeded neighbours, before and after the poison in the batch, keep
    their exact tokens; the poison (n=2: both samples) ends with an error."""
    neighbours = [(PROMPTS[0], _greedy()), (PROMPTS[1], _seeded(11)), (PROMPTS[1], _greedy())]
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [p for p, _ in neighbours], [s for _, s in neighbours], use_tqdm=False)]
    poison = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                            stop=[marker(site)])
    prompts = [neighbours[0][0], PROMPTS[0], neighbours[1][0], neighbours[2][0]]
    params = [neighbours[0][1], poison, neighbours[1][1], neighbours[2][1]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.error is not None and "InjectedFault" in bad.error
    if site != "step":  # a step's failure names the request, not where in the step it was
        assert site in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    assert all(outs[i].error is None for i in (0, 2, 3))
    _idle(llm)


def test_a_failing_step_is_re_run_in_parts_and_only_the_request_at_fault_fails(llm):
    """Eight requests share the steps with two that make every step they are in raise:
    the step is re-run in halves down to single requests, the two fail alone (their
    error names the step), the eight get their exact tokens and nothing leaks."""
    from pagedserve.cluster.engine import step_containment

    prompts = [[3 + i, 9, 27 + i, 81 % (i + 7)] for i in range(8)]
    params = [_greedy(10) if i % 2 else _seeded(100 + i, 10) for i in range(8)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    poison = SamplingParams(temperature=0.0, max_tokens=6, stop=[marker("step")])
    reruns = []
    real = step_containment.subplan

    def counting(plan, keep, epoch, drop_req_ids=()):
        reruns.append(len(keep))
        return real(plan, keep, epoch, drop_req_ids)

    step_containment.subplan = counting
    try:
        outs = llm.generate(prompts[:3] + [PROMPTS[0]] + prompts[3:6] + [PROMPTS[1]] + prompts[6:],
                            params[:3] + [poison] + params[3:6] + [poison] + params[6:], use_tqdm=False)
    finally:
        step_containment.subplan = real
    bad = [outs[3], outs[7]]
    good = outs[:3] + outs[4:7] + outs[8:]
    assert all(o.error is not None and "engine step failed" in o.error for o in bad)
    assert all({c.finish_reason for c in o.outputs} == {"error"} for o in bad)
    assert [o.outputs[0].token_ids for o in good] == alone
    assert all(o.error is None for o in good)
    # Bounded: the first step's 10 requests need one bisection, not 10 single re-runs.
    assert 0 < len(reruns) <= step_containment.max_reruns(10) and 1 in reruns
    _idle(llm)


def test_a_broken_worker_is_the_engines_failure_and_leaves_nothing_running(model):
    from pagedserve.cluster.engine.step_containment import StepFailedError

    broken = _build(model, inject=True)
    try:
        poison = SamplingParams(max_tokens=4, stop=[marker("broken")])
        with pytest.raises(StepFailedError, match="probe"):
            broken.generate([PROMPTS[0], PROMPTS[1]], [_greedy(), poison], use_tqdm=False)
        _idle(broken)
    finally:
        broken.shutdown()


def test_faults_are_inert_when_the_engine_is_built_without_the_variable(model, monkeypatch):
    clean = _build(model, inject=False)
    monkeypatch.setenv(PLUGINS_ENV, PLUGIN_PATH)  # too late: nothing was installed
    try:
        for site in SITES:
            out = clean.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                              stop=[marker(site)]), use_tqdm=False)[0]
            assert out.error is None and len(out.outputs[0].token_ids) == 4
        assert "_prepare_inputs" not in vars(clean.engine.executor.worker.runner)
    finally:
        clean.shutdown()
