"""The OpenAI API of a real Ray Serve app on 127.0.0.1, driven by the real ``openai``
client (happy paths) and httpx (every error status).

The story: the server's greedy tokens equal the offline engine's on the same weights;
streaming reassembles to exactly the non-streamed answer; ``n=2``, stop strings and
seeds do what the OpenAI docs say; user mistakes get 400/404, overload 429 + Retry-After.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from conftest import SERVE_ENGINE

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    [card] = client.models.list().data
    return card.id


@pytest.fixture(scope="module")
def offline_greedy(serve_model):
    """Greedy token ids of PROMPT from the offline engine (no Ray, no HTTP)."""
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=serve_model, max_model_len=1024, num_gpu_blocks_override=64, dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    llm.shutdown()
    return out.outputs[0].token_ids, out.outputs[0].text


def test_models_health_tokenize(openai_app, client, model_name, serve_model):
    assert model_name == str(serve_model)  # --model as given, as vLLM (test_api_surface.py)
    card = client.models.list().data[0]
    assert card.max_model_len == SERVE_ENGINE["max_model_len"]
    assert httpx.get(f"{openai_app}/health").status_code == 200
    tok = httpx.post(f"{openai_app}/tokenize", json={"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) > 3
    text = httpx.post(f"{openai_app}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert PROMPT in text  # BOS may decode to a prefix


def test_completion_matches_offline_engine(client, model_name, offline_greedy):
    ids, text = offline_greedy
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.token_ids == ids
    assert choice.text == text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_completion_equals_non_streamed(client, model_name, offline_greedy):
    chunks = list(client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_greedy[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_completion_stream_and_non_stream(client, model_name):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_returns_two_distinct_samples(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, n=2,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 32
    # Streaming n=2: deltas of both indices interleave and reassemble to the same texts.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, n=2,
                                           temperature=1.0, seed=7, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}


def test_stop_string_ends_the_text_before_it(client, model_name, offline_greedy):
    full = offline_greedy[1]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert len(stop) == 2 and stop in full
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == full[: full.index(stop)]
    assert getattr(c, "stop_reason", None) == stop  # vLLM's extension field


def test_seeded_sampling_is_reproducible(client, model_name):
    def sample(seed):
        return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c


def test_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0.0 and len(top) == 3
        assert max(top.values()) == pytest.approx(val, abs=1e-5)  # greedy: the top-1 token


# ---------------------------------------------------------------- errors (httpx)
def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    return err


def test_invalid_parameters_are_400(openai_app):
    url = f"{openai_app}/v1/completions"
    err = _error(httpx.post(url, json={"prompt": "x", "temperature": -1}), 400)
    assert "temperature" in err["message"]
    _error(httpx.post(url, json={"prompt": "x", "top_p": 0}), 400)
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": "lots"}), 400)  # pydantic
    _error(httpx.post(url, json={"max_tokens": 3}), 400)  # no prompt
    _error(httpx.post(f"{openai_app}/v1/chat/completions", json={"messages": []}), 400)


def test_prompt_longer_than_max_model_len_is_400(openai_app):
    long = [5] * (SERVE_ENGINE["max_model_len"] + 10)
    err = _error(httpx.post(f"{openai_app}/v1/completions", json={"prompt": long}), 400)
    assert "maximum context length" in err["message"]


def test_unknown_model_is_404(openai_app):
    err = _error(httpx.post(f"{openai_app}/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)
    assert "gpt-9" in err["message"]


def test_full_waiting_queue_is_429_with_retry_after(openai_app):
    """4 long streams fill the running batch, 2 more fill the waiting queue
    (max_waiting_requests=2); the next request is refused with 429 + Retry-After."""
    url = f"{openai_app}/v1/completions"
    long = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as ac:
            streams, readers = [], []
            try:
                for i in range(SERVE_ENGINE["max_num_seqs"] + SERVE_ENGINE["max_waiting_requests"]):
                    cm = ac.stream("POST", url, json=long)
                    resp = await cm.__aenter__()
                    streams.append(cm)
                    assert resp.status_code == 200
                    # Keep the line iterator alive: a collected one closes the response,
                    # which is a disconnect, which aborts the request.
                    readers.append(resp.aiter_lines())
                    if i < SERVE_ENGINE["max_num_seqs"]:  # running: wait for a first token
                        line = await anext(readers[-1])
                        assert line.startswith("data: ")
                refused = await ac.post(url, json={**long, "stream": False, "max_tokens": 4})
                return refused
            finally:
                for cm in streams:  # disconnect: the engine aborts them
                    await cm.__aexit__(None, None, None)

    refused = asyncio.run(scenario())
    err = _error(refused, 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert "overloaded" in err["message"]


def test_metrics_after_traffic(openai_app, client, model_name):
    """After the requests above, /metrics carries the vLLM-named counters and histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):  # the second one finds PROMPT's full blocks in the prefix cache
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    time.sleep(0.3)  # replica stats are pushed at most every 0.1 s
    text = httpx.get(f"{openai_app}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if "reason" not in s.labels}
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "time_per_output_token_seconds_count",
                 "front_time_to_first_token_seconds_count"):
        assert values[f"pagedserve:{name}"] >= 1, name
    # The front's TTFT holds the engine's (it starts earlier, at the HTTP front).
    assert (values["pagedserve:front_time_to_first_token_seconds_sum"]
            >= values["pagedserve:time_to_first_token_seconds_sum"] * 0.999)
    assert values["pagedserve:prompt_tokens_total"] > 0
    assert values["pagedserve:generation_tokens_total"] >= 3
    assert 0 < values["pagedserve:prefix_cache_hits_total"] <= values["pagedserve:prefix_cache_queries_total"]
    assert values["pagedserve:num_gpu_blocks"] == SERVE_ENGINE["num_gpu_blocks_override"]
