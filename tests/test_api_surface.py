"""The OpenAI API's finer points as vLLM users rely on them, against a real Serve app on
127.0.0.1 (the shared ``openai_app``), with the openai SDK where it can send the request
and httpx for the errors: the model id and root, /version, logprobs shapes and bounds,
token ids as token names, stream_options, stop_token_ids past the vocabulary, unknown
fields, int64 seeds, and vLLM's metric names after traffic.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pagedserve
from conftest import SERVE_ENGINE

PROMPT = "The quick brown fox jumps over the lazy dog"
VOCAB = 512  # the llama-gqa2-hd64 test model's
TOKEN_ID = re.compile(r"^token_id:\d+$")


@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["message"]
    return err


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


# ---------------------------------------------------------------- models, version
def test_model_id_and_root_are_the_model_argument_as_given(openai_app, client, serve_model):
    [card] = client.models.list().data
    # EngineConfig(model=<that path>): the path is what the user gave (vLLM shows it too).
    assert card.id == str(serve_model) and card.root == str(serve_model)
    r = client.completions.create(model=card.id, prompt="hi", max_tokens=2)
    assert r.model == card.id
    err = _error(_post(openai_app, "/v1/completions", {"model": "llama-gqa2-hd64", "prompt": "hi"}), 404)
    assert "llama-gqa2-hd64" in err["message"]  # the folder name is not an alias


def test_version_is_vllms_shape(openai_app):
    r = httpx.get(f"{openai_app}/version")
    assert r.status_code == 200 and r.json() == {"version": pagedserve.__version__}


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs_zero_gives_the_sampled_token(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=1.0,
                                  seed=3, logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: val} and val <= 0.0


def test_completion_top_logprobs_hold_the_sampled_token_and_the_top_n(client, model_id):
    r = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in c.token_ids]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert all(TOKEN_ID.match(k) for k in top)
        assert top[tok] == val  # the sampled token is always there, with its own logprob
        assert len(top) in (2, 3)  # + the 2 most likely (2 when it is one of them)
        others = sorted((v for k, v in top.items() if k != tok), reverse=True)
        assert all(v >= val for v in others) or len(top) == 2


def test_chat_return_tokens_as_token_ids_and_top_logprobs(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.choices[0]
    content = c.logprobs.content
    assert [x.token for x in content] == [f"token_id:{t}" for t in c.token_ids]
    for x in content:
        assert len(x.top_logprobs) == 3 and all(TOKEN_ID.match(t.token) for t in x.top_logprobs)
        assert x.top_logprobs[0].token == x.token  # greedy: the most likely one
        assert x.top_logprobs[0].logprob == pytest.approx(x.logprob)
    streamed = [lp.token for chunk in client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        if chunk.choices and chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.content]
    assert streamed == [x.token for x in content]


def test_logprobs_bounds_are_400_naming_the_field(openai_app, client, model_id):
    comp = {"prompt": "hi", "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    err = _error(_post(openai_app, "/v1/completions", {**comp, "logprobs": 21}))
    assert "logprobs" in err["message"] and "20" in err["message"] and "--max-logprobs" in err["message"]
    # -1 is the whole vocabulary: more than --max-logprobs 20.
    assert "logprobs" in _error(_post(openai_app, "/v1/completions", {**comp, "logprobs": -1}))["message"]
    _error(_post(openai_app, "/v1/completions", {**comp, "logprobs": -2}))
    assert _post(openai_app, "/v1/completions", {**comp, "logprobs": 20}).status_code == 200
    err = _error(_post(openai_app, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}))
    assert "top_logprobs" in err["message"] and "20" in err["message"]
    err = _error(_post(openai_app, "/v1/chat/completions", {**chat, "top_logprobs": 2}))
    assert "logprobs" in err["message"] and err["param"] == "top_logprobs"
    _error(_post(openai_app, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -2}))
    _error(_post(openai_app, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}))
    # As vLLM: top_logprobs 0 without logprobs asks for nothing, and gets nothing.
    r = client.chat.completions.create(model=model_id, top_logprobs=0, **chat)
    assert r.choices[0].logprobs is None


# ---------------------------------------------------------------- streaming
def test_stream_options_need_stream(openai_app):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = _error(_post(openai_app, path, {**body, "stream_options": {"include_usage": True}}))
        assert "stream=True" in err["message"] and err["param"] == "stream_options"


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_usage_on_every_chunk(client, model_id, chat):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, stream=True, stream_options=opts, extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            stream_options=opts, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    done = [c.usage.completion_tokens for c in chunks if c.choices]
    assert done == sorted(done) and done[-1] == 6 and (not chat or done[0] == 0)
    for c in chunks:
        assert c.usage.prompt_tokens == prompt
        assert c.usage.total_tokens == prompt + c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # Without continuous_usage_stats only the final chunk carries usage.
    plain = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


# ---------------------------------------------------------------- stop_token_ids, seed, fields
def test_stop_token_ids_outside_the_vocabulary_are_400(openai_app, client, model_id):
    for bad in (VOCAB, 10**9):
        err = _error(_post(openai_app, "/v1/completions", {"prompt": "hi", "stop_token_ids": [3, bad]}))
        assert str(bad) in err["message"] and "stop_token_ids" in err["message"]
    r = client.completions.create(model=model_id, prompt="hi", max_tokens=2,
                                  extra_body={"stop_token_ids": [VOCAB - 1]})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_offline_llm_checks_stop_token_ids_and_resolves_logprobs_minus_one(serve_model):
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=serve_model, max_model_len=256, num_gpu_blocks_override=16, dtype="float32",
              max_logprobs=-1)
    try:
        with pytest.raises(ValueError, match=f"stop_token_ids: token id {VOCAB} is outside"):
            llm.generate(PROMPT, SamplingParams(stop_token_ids=[VOCAB]), use_tqdm=False)
        out = llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=-1, temperature=0),
                           use_tqdm=False)[0].outputs[0]
        assert [len(lp.token_ids) for lp in out.logprobs] == [1 + VOCAB] * 2  # sampled + all
    finally:
        llm.shutdown()
    assert llm.engine.served_model_name == str(serve_model)


def test_unknown_fields_are_named_back_nested_typos_400_ignored_ones_pass(openai_app, client, model_id):
    """A field no OpenAI or vLLM schema has is accepted and named in a header (vLLM accepts
    it too); one inside an object of ours is a typo: a 400 naming it.
    tests/test_serve_vllm_parity.py has the rest (known but not implemented -> 400)."""
    r = _post(openai_app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-pagedserve-ignored-fields"] == "frobnicate"
    r = _post(openai_app, "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hi", "weight": 2}], "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-pagedserve-ignored-fields"] == "messages[0].weight"
    err = _error(_post(openai_app, "/v1/completions",
                       {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}}))
    assert "stream_options.x" in err["message"] and "unknown field" in err["message"]
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, user="u-42", store=False, metadata={"k": "v"})
    assert r.choices[0].message.content is not None
    _error(_post(openai_app, "/v1/completions", {"prompt": "hi", "user": 5}))  # still type-checked


def test_seed_outside_int64_is_400(openai_app, client, model_id):
    for seed in (2**63, -(2**63) - 1):
        err = _error(_post(openai_app, "/v1/completions", {"prompt": "hi", "seed": seed}))
        assert "seed" in err["message"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model_id, prompt="hi", max_tokens=1, seed=seed)
    r = client.completions.create(model=model_id, prompt="hi", max_tokens=2, seed=2**63 - 1, n=2)
    assert len(r.choices) == 2


# ---------------------------------------------------------------- metrics
# What a vLLM Grafana dashboard queries (vLLM's names, types and model_name label).
GRAFANA = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
}
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]


def _scrape(url: str):
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    values = {}
    for f in fams.values():
        for s in f.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())
                                   if k not in ("model_name",))
            values[key] = values.get(key, 0.0) + s.value
    return fams, values


def test_vllm_metric_names_resolve_after_traffic(openai_app, client, model_id):
    _, before = _scrape(openai_app)
    for _ in range(2):  # the second finds PROMPT's blocks in the prefix cache
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    time.sleep(0.5)  # replica stats are pushed at most every 0.1 s
    fams, after = _scrape(openai_app)
    for name, kind in GRAFANA.items():
        assert name in fams and fams[name].type == kind, name
        assert all(s.labels.get("model_name") == model_id for s in fams[name].samples), name
    grew = lambda k: after[k] - before.get(k, 0.0)  # noqa: E731
    assert grew("vllm:prompt_tokens_total") > 0
    assert grew("vllm:generation_tokens_total") >= 8
    assert grew("vllm:prefix_cache_queries_total") > 0 and grew("vllm:prefix_cache_hits_total") > 0
    assert after["vllm:prefix_cache_hits_total"] <= after["vllm:prefix_cache_queries_total"]
    assert grew("vllm:request_success_total|finished_reason=length") >= 2
    assert {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples
            if s.name.endswith("_total")} >= {"stop", "length", "abort", "error"}
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"vllm:{h}_count") >= 2, h
    assert grew("vllm:inter_token_latency_seconds_count") >= 2 * 3  # 3 gaps each
    assert after["vllm:num_preemptions_total"] >= 0 and 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0
    assert after["vllm:num_requests_running"] >= 0 and after["vllm:num_requests_waiting"] >= 0
    les = [float(s.labels["le"]) for s in fams["vllm:time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert les == VLLM_TTFT_BUCKETS
    # The pagedserve: series stay, with the same numbers.
    assert after["pagedserve:generation_tokens_total"] == after["vllm:generation_tokens_total"]
    assert after["pagedserve:num_gpu_blocks"] == SERVE_ENGINE["num_gpu_blocks_override"]
    # The KV sizing of the startup log (fp32 cache, "auto": no scales).
    assert after["pagedserve:kv_cache_bytes_per_token|kv_cache_dtype=auto"] > 0
    assert after["pagedserve:kv_cache_scale_bytes_per_token|kv_cache_dtype=auto"] == 0
