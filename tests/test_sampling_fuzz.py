"""A fuzz of every numeric sampling field, offline, through the request model the HTTP
front uses (issue 27: a top_p of 2.2e-309 passed validation, float32 flushed it to 0 and
the sampler drew a token id past the vocabulary, which killed the engine a step later).

The story: hypothesis draws bodies of 1-4 completion requests over every numeric field of
the request model (top_p, top_k, min_p, temperature, the penalties, logit_bias values,
seed, n, best_of, logprobs, prompt_logprobs, max_tokens, min_tokens, stop ids,
truncate_prompt_tokens, priority), biased to denormals, extremes, infinities, NaN and
values just past each bound, alone and combined. Each request is refused as the server
would refuse it (a pydantic error: 400; a ValueError: 400) or runs to a normal result, in
one batch with the others; no engine step ever fails, every token is in the vocabulary,
and no block is held afterwards.

Bounded for the suite (FUZZ_EXAMPLES, default 120 bodies); the long mode of
deploy/README.md sets PAGEDSERVE_FUZZ_EXAMPLES=5000.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedserve.cluster.front.openai.schemas import CompletionRequest
from pagedserve.worker.loading.random_models import make_test_model

FUZZ_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "120"))
VOCAB = 512  # the test model's

_FLOATS = [0.0, -0.0, 5e-324, 2.225073858507203e-309, 2.2250738585072014e-308, 1e-300, 1e-45,
           1.401298464324817e-45, 1.1754943508222875e-38, 1e-38, 1e-20, 1e-6, 1e-5, 9.99e-6, 0.5,
           0.9999999, 1.0, 1.0000001, 1.9999999, 2.0, 2.0000001, 99.999, 100.0, 100.0001, 3.4e38,
           3.5e38, 1e300, 1.7976931348623157e308, math.inf, -math.inf, math.nan, -1e-300, -1.0,
           -2.0, -2.0000001, -100.0, -100.0001, -3.5e38]
_INTS = [-(2**63) - 1, -(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 7, 16, 20, 21, VOCAB - 1, VOCAB,
         VOCAB + 1, 1024, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64]

floats = st.one_of(st.sampled_from(_FLOATS), st.floats(), st.floats(min_value=-3, max_value=3))
ints = st.one_of(st.sampled_from(_INTS), st.integers(min_value=-5, max_value=600), st.integers())

FIELDS = {
    "temperature": floats, "top_p": floats, "min_p": floats, "presence_penalty": floats,
    "frequency_penalty": floats, "repetition_penalty": floats, "top_k": ints, "seed": ints,
    "n": ints, "best_of": ints, "logprobs": ints, "prompt_logprobs": ints, "max_tokens": ints,
    "min_tokens": ints, "truncate_prompt_tokens": ints, "priority": ints,
    "stop_token_ids": st.lists(ints, max_size=4),
    "logit_bias": st.dictionaries(st.one_of(st.sampled_from(["0", "5", "511", "512", "-1", "x"]),
                                            ints.map(str)), floats, max_size=4),
}
# What a body may cost to run: generation lengths and fan-out capped after drawing (the
# drawn value still goes through validation first, so its refusal is tested as drawn).
CAPS = {"max_tokens": 4, "min_tokens": 4, "n": 3, "best_of": 4}


def _in(lo: float, hi: float, exclude_min: bool = False):
    """Floats inside a field's range, its bounds, denormals and float32's edges among them."""
    edges = [v for v in _FLOATS if (lo < v if exclude_min else lo <= v) and v <= hi]
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, exclude_min=exclude_min))


# Values each field accepts: combinations of extremes that all pass validation and run.
VALID = {
    "temperature": _in(0.0, 1.7976931348623157e308), "top_p": _in(0.0, 1.0, exclude_min=True),
    "min_p": _in(0.0, 1.0), "presence_penalty": _in(-2.0, 2.0), "frequency_penalty": _in(-2.0, 2.0),
    "repetition_penalty": _in(0.0, 2.0, exclude_min=True), "top_k": st.integers(-1, VOCAB + 1),
    "seed": st.one_of(st.sampled_from([-(2**63), -1, 0, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1)),
    "n": st.integers(1, 3), "logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 20),
    "max_tokens": st.integers(1, 4), "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), _in(-100.0, 100.0), max_size=4),
}


def _with_prompt(b: dict) -> dict:
    return {"prompt": [1, 17, 33, 400], **b}


body = st.one_of(st.fixed_dictionaries({}, optional=FIELDS),
                 st.fixed_dictionaries({}, optional=VALID)).map(_with_prompt)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from pagedserve.cluster.llm import LLM

    path = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "fuzz-models")
    engine = LLM(model=path, dtype="float32", max_model_len=64, num_gpu_blocks_override=64,
                 max_num_seqs=8, max_logprobs=20)
    yield engine
    engine.shutdown()


def _params(llm, raw: dict):
    """The request as the front builds it, or None where the front answers 400."""
    try:
        req = CompletionRequest.model_validate(raw)
        params = req.to_sampling_params()
    except (ValidationError, ValueError):
        return None
    capped = {k: min(getattr(params, k), cap) for k, cap in CAPS.items()
              if isinstance(getattr(params, k), int) and getattr(params, k) > cap}
    if "best_of" in capped or "n" in capped:  # keep n <= best_of
        n = min(params.n, CAPS["n"])
        capped["n"], capped["best_of"] = n, None if params.best_of is None else max(n, min(params.best_of, 4))
    try:
        params = params.clone(**capped) if capped else params
        llm.engine.check_params(params)
        llm.engine.check_length(len(raw["prompt"]), params.max_tokens)
    except ValueError:
        return None
    return params


def test_every_numeric_field_ends_in_a_result_or_a_400(llm):
    seen = {"ran": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies=st.lists(body, min_size=1, max_size=4))
    def fuzz(bodies):
        runnable = [(b["prompt"], p) for b in bodies if (p := _params(llm, b)) is not None]
        seen["refused"] += len(bodies) - len(runnable)
        if not runnable:
            return
        try:
            outs = llm.generate([p for p, _ in runnable], [s for _, s in runnable], use_tqdm=False)
        except ValueError:  # a 400 the engine gives at admission (the front's same checks)
            seen["refused"] += len(runnable)
            return
        seen["ran"] += len(runnable)
        for out, (_, params) in zip(outs, runnable):
            assert out.error is None, (params, out.error)
            assert out.finished and len(out.outputs) == params.n
            for c in out.outputs:
                assert 1 <= len(c.token_ids) <= params.max_tokens
                assert all(0 <= t < VOCAB for t in c.token_ids)
                assert c.finish_reason in ("stop", "length")
        stats = llm.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_usage"] == 0.0

    fuzz()
    print(f"sampling fuzz: {seen}")
    # It exercised both sides: bodies that ran and bodies refused.
    assert seen["ran"] >= FUZZ_EXAMPLES // 4 and seen["refused"] >= FUZZ_EXAMPLES // 4


@pytest.mark.parametrize("field, value", [
    ("top_p", 2.225073858507203e-309), ("top_p", 1e-300), ("top_p", 1e-45), ("top_p", 5e-324),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 5e-324), ("temperature", 1e300),
    ("min_p", 1.0)])
def test_the_values_that_flush_or_overflow_in_float32_keep_a_token(llm, field, value):
    """The fuzzer's finds, pinned: each keeps at least the most likely token."""
    from pagedserve.scheduler.sampling_params import SamplingParams

    greedy = llm.generate([[891 % VOCAB]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    kw = {"temperature": 1.0, field: value} if field != "temperature" else {field: value}
    out = llm.generate([[891 % VOCAB]], SamplingParams(max_tokens=4, ignore_eos=True, seed=1, **kw),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
    if field == "top_p":  # only the most likely token is left: greedy
        assert out.outputs[0].token_ids == greedy
