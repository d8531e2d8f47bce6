"""The default model (SmolLM2-135M-Instruct) behind Serve, through the openai SDK and
httpx: what the tiny random test model cannot show. Structured outputs at temperature 1
(20 of 20 samples validate against a JSON schema, streamed too), issue 13's API items,
and vLLM's API forms (tests/test_serve_vllm_parity.py checks each in depth on the demo
model): batched chat, beam search, prompt logprobs, /tokenize and /tokenizer_info.

The app runs with speculative decoding on (prompt lookup, vLLM's --speculative-config), so
every test here also shows that what users ask for keeps working with it: structured
outputs, n > 1, logprobs, beam search; the last tests drive the speculation itself, and
a dropped client and overload while requests draft."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
                         "likes_pizza": {"type": "boolean"}},
          "required": ["name", "age", "city", "likes_pizza"]}


COPY = [{"role": "user", "content": "Repeat this code exactly:\n\n"
          "def area(width, height):\n    return width * height\n\n"
          "def perimeter(width, height):\n    return 2 * (width + height)\n"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def real_app(serve_url):
    """The default model behind Serve at /real (20 concurrent sequences: one n=20 request),
    speculative decoding on; one request may wait, the next is refused (429)."""
    from ray import serve

    from conftest import delete_app
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=None, dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
                       max_num_seqs=20, max_waiting_requests=1, max_queue_delay_s=None, seed=0,
                       speculative_config=SPEC)
    serve.run(build_app(cfg, name_prefix="real-"), name="real-model", route_prefix="/real")
    yield f"{serve_url}/real"
    delete_app("real-model")


def test_real_model_json_schema_20_of_20_at_temperature_1(real_app):
    """The acceptance: SmolLM2-135M-Instruct through Serve and the openai SDK, n=20 (one
    grammar, 20 matchers) at temperature 1: every sample parses and validates."""
    client = openai.OpenAI(base_url=f"{real_app}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    ask = dict(model=model, temperature=1.0, seed=0, max_tokens=48, messages=[{
        "role": "user", "content": "Describe a fictional person as JSON with name, age, city and likes_pizza."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    r = client.chat.completions.create(n=20, **ask)
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in r.choices}) > 10  # sampled, not one answer 20 times
    chunks = list(client.chat.completions.create(stream=True, **ask))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # seeded: sample 0 of n=20 is the n=1 answer


def test_real_model_api_items_through_serve(real_app):
    """Issue 13's items on the real model, through Serve and the openai SDK (the demo
    model's tests cover each in depth): the id, a batch, echo with logprobs, prompt
    logprobs, logit_bias, a named tool call, /version."""
    import httpx

    client = openai.OpenAI(base_url=f"{real_app}/v1", api_key="unused", max_retries=0, timeout=300)
    [card] = client.models.list().data
    assert card.id == card.root == "SmolLM2-135M-Instruct"  # no --model: the default's name
    greedy = dict(model=card.id, temperature=0, max_tokens=6)
    prompts = ["The capital of France is", "One, two,", "Water is"]
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, p in enumerate(prompts):  # greedy: both samples of a prompt, and its single answer
        alone = client.completions.create(prompt=p, **greedy).choices[0].text
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone
    echo = client.completions.create(prompt=prompts[0], echo=True, logprobs=1, **greedy).choices[0]
    assert echo.text.startswith(prompts[0]) and echo.logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"prompt_logprobs": 1}, **greedy)
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens and all(plp[1:])
    forced = httpx.post(f"{real_app}/v1/completions", timeout=120, json={
        **greedy, "prompt": "Hello", "logit_bias": {"504": 100}, "return_token_ids": True}).json()
    assert forced["choices"][0]["token_ids"] == [504] * 6
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
    call = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the weather in Rome?"}], model=card.id,
        temperature=0, max_tokens=32, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather}}])
    [tc] = call.choices[0].message.tool_calls
    assert tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), weather)
    assert httpx.get(f"{real_app}/version").json()["version"]


def test_real_model_vllm_forms(real_app):
    """vLLM's forms on SmolLM2 (tests/test_serve_vllm_parity.py checks each in depth): the
    ChatML template in /tokenizer_info and /tokenize's token strings, batched chat equal to
    each conversation alone, beam search (width 1 is greedy), prompt logprobs on a
    completion choice and at the top of a chat."""
    info = httpx.get(f"{real_app}/tokenizer_info", timeout=60).json()
    assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    tok = httpx.post(f"{real_app}/tokenize", json={"messages": msgs, "return_token_strs": True}, timeout=60).json()
    assert "<|im_start|>" in tok["token_strs"] and len(tok["token_strs"]) == tok["count"]
    greedy = {"temperature": 0, "max_tokens": 8}
    convs = [msgs, [{"role": "user", "content": "Name a primary colour."}]]
    batch = httpx.post(f"{real_app}/v1/chat/completions/batch", json={"messages": convs, **greedy}, timeout=120).json()
    for conv, choice in zip(convs, batch["choices"]):
        alone = httpx.post(f"{real_app}/v1/chat/completions", json={"messages": conv, **greedy}, timeout=120).json()
        assert choice["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert "Paris" in batch["choices"][0]["message"]["content"]
    prompt = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(f"{real_app}/v1/completions", json={**prompt, "temperature": 0}, timeout=120).json()
    beams = {}
    for n in (1, 3):
        beams[n] = httpx.post(f"{real_app}/v1/completions", json={**prompt, "use_beam_search": True, "n": n},
                              timeout=120).json()["choices"]
    assert beams[1][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in beams[3]}) == 3
    plp = httpx.post(f"{real_app}/v1/completions", json={**prompt, "temperature": 0, "prompt_logprobs": 1},
                     timeout=120).json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(plain["choices"][0]["prompt_token_ids"])
    chat = httpx.post(f"{real_app}/v1/chat/completions", json={"messages": msgs, "prompt_logprobs": 0,
                                                               "return_token_ids": True, **greedy}, timeout=120).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])


def test_real_model_speculative_decoding_through_serve(real_app):
    """A request that copies its input: the drafts are accepted (vLLM's counters on
    /metrics, per position too), streamed and whole answers are the same text, and
    max_tokens holds exactly although a step yields several tokens."""
    def counters():
        text = httpx.get(f"{real_app}/metrics", timeout=60).text
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    client = openai.OpenAI(base_url=f"{real_app}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    ask = dict(model=model, temperature=0, max_tokens=40, messages=COPY)
    before = counters()
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert "perimeter" in text
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 40
    assert whole.choices[0].finish_reason == "length"
    after = counters()
    key = 'vllm:spec_decode_num_{}_total{{model_name="%s"}}' % model
    drafts = after[key.format("drafts")] - before.get(key.format("drafts"), 0)
    accepted = after[key.format("accepted_tokens")] - before.get(key.format("accepted_tokens"), 0)
    assert drafts > 0 and accepted > drafts  # more than one token per draft on a copy
    per_pos = {k for k in after if "accepted_tokens_per_pos" in k}
    assert len(per_pos) == SPEC["num_speculative_tokens"]


def test_dropped_client_and_overload_while_requests_draft(real_app):
    """A user's view of failure with speculation on. An n=20 stream copying code fills the
    batch (every sample drafts); one more request waits; the next is refused with 429,
    Retry-After and OpenAI's error JSON. The n=20 client then drops mid-stream: the waiting
    request runs and streams exactly what it answers alone, the n=20 request stopped early,
    and no KV block or request is left behind."""
    import asyncio
    import time

    from test_serve_cancel import wait_idle

    url = f"{real_app}/v1/chat/completions"
    ask = {"messages": COPY, "temperature": 0, "max_tokens": 40}
    alone = httpx.post(url, json=ask, timeout=300).json()["choices"][0]["message"]["content"]
    before = wait_idle(real_app)
    assert before["pagedserve:kv_cache_usage_perc"] == 0

    async def until(ac, test, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while True:
            text = (await ac.get(f"{real_app}/metrics")).text
            m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if not s.labels.get("reason")}
            if test(m):
                return m
            assert time.monotonic() < deadline, "the server never got there"
            await asyncio.sleep(0.05)

    async def read_stream(ac, body):
        text = []
        async with ac.stream("POST", url, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
        return "".join(text)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as ac:
            fill_cm = ac.stream("POST", url, json={**ask, "n": 20, "max_tokens": 200, "stream": True})
            fill = await fill_cm.__aenter__()
            try:
                assert fill.status_code == 200
                lines = fill.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                running = await until(ac, lambda m: m["pagedserve:num_requests_running"] >= 20)
                waiter = asyncio.create_task(read_stream(ac, ask))
                await until(ac, lambda m: m["pagedserve:num_requests_waiting"] >= 1)
                refused = await ac.post(url, json=ask)
                drafting = await until(ac, lambda m: m["vllm:spec_decode_num_drafts_total"]
                                       > before["vllm:spec_decode_num_drafts_total"])
                for _ in range(3):  # a few more chunks of the n=20 stream, then the client drops
                    await anext(lines)
            finally:
                await fill_cm.__aexit__(None, None, None)
            return running, refused, drafting, await waiter

    running, refused, drafting, waited = asyncio.run(scenario())
    assert running["pagedserve:num_requests_running"] == 20
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    err = refused.json()["error"]
    assert err["type"] and "max_waiting_requests=1" in err["message"]
    assert drafting["vllm:spec_decode_num_accepted_tokens_total"] > before["vllm:spec_decode_num_accepted_tokens_total"]
    assert waited == alone
    after = wait_idle(real_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == after["pagedserve:num_requests_waiting"] == 0
    generated = after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"]
    assert generated < 20 * 200 // 2  # the dropped request was aborted, not run to its end
