"""Failure isolation inside the engine step, offline (no Ray, no HTTP).

The story: a request that fails on its own (a real one: a seed torch cannot take; a
planted one at each place a request can fail inside a step) fails alone. Its neighbours
in the same batch get exactly the tokens they get without it, its blocks come back and
nothing stays running. A failure of the step as a whole is not isolated: it reaches the
caller, and the engine is left with nothing unfinished.
"""

from __future__ import annotations

import pytest

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker import faults
from pagedserve.worker.testing import make_test_model

PROMPTS = [[5, 9, 13, 17, 21, 25], [7, 11, 3, 40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from pagedserve.cluster.engine.llm import LLM

    path = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "iso-models")
    engine = LLM(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                 max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.fixture
def inject(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")


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


@pytest.mark.parametrize("site", ["setup", "sample", "detokenize"])
def test_planted_failure_fails_that_request_alone(llm, inject, site):
    """Greedy and seeded neighbours, before and after the poison in the batch, keep
    their exact tokens; the poison (n=2: both samples) ends with an error."""
    neighbours = [(PROMPTS[0], _greedy()), (PROMPTS[1], _seeded(11)), (PROMPTS[1], _greedy())]
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [p for p, _ in neighbours], [s for _, s in neighbours], use_tqdm=False)]
    poison = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                            stop=[faults.marker(site)])
    prompts = [neighbours[0][0], PROMPTS[0], neighbours[1][0], neighbours[2][0]]
    params = [neighbours[0][1], poison, neighbours[1][1], neighbours[2][1]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.error is not None and "InjectedFault" in bad.error and site in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    assert all(outs[i].error is None for i in (0, 2, 3))
    _idle(llm)


def test_step_failure_reaches_the_caller_and_leaves_nothing_running(llm, inject):
    poison = SamplingParams(max_tokens=4, stop=[faults.marker("step")])
    with pytest.raises(faults.InjectedFault):
        llm.generate([PROMPTS[0], PROMPTS[1]], [_greedy(), poison], use_tqdm=False)
    _idle(llm)
    # The engine itself is fine (offline, the caller decides what a failed step means).
    out = llm.generate([PROMPTS[0]], _greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_faults_are_inert_without_the_environment_variable(llm, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                    stop=[faults.marker("setup")]), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
