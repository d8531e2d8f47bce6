"""vLLM's API forms that vLLM clients send, over a real Serve app (the demo model) with httpx
and the openai SDK: batched chat, /tokenizer_info, /load, /invocations and /ping,
/tokenize's request forms, prompt logprobs and prompt token ids in responses, beam search,
truncation_side, vLLM's validation messages, and unknown fields (accepted, logged, named
in a header) against known ones this server does not implement (a 400 naming them).

The story: a batch of conversations answers each as the same conversation sent alone;
SageMaker's /invocations answers as the route its body's shape names; beam search of width
1 is greedy decoding, and wider beams come back best first by the model's own logprobs
(rescored here through echo); an unknown field changes nothing but the header.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
CONVS = [[{"role": "user", "content": "Hello there"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}],
         [{"role": "user", "content": "Name a colour"}]]


def _post(base, path, body, **kw):
    return httpx.post(f"{base}{path}", json=body, timeout=120, **kw)


def _err(resp, status=400):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.fixture(scope="module")
def base(openai_app):
    return openai_app


def test_batch_chat_answers_each_conversation_as_alone(base):
    r = _post(base, "/v1/chat/completions/batch", {"messages": CONVS, "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for conv, choice in zip(CONVS, body["choices"]):
        alone = _post(base, "/v1/chat/completions", {"messages": conv, "return_token_ids": True, **GREEDY}).json()
        assert choice["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 3 * GREEDY["max_tokens"]
    # structured outputs apply to each conversation
    r = _post(base, "/v1/chat/completions/batch", {"messages": CONVS, "temperature": 0, "max_tokens": 8,
                                                  "structured_outputs": {"choice": ["yes", "no"]}})
    assert [c["message"]["content"] in ("yes", "no") for c in r.json()["choices"]] == [True] * 3
    for extra, name in (({"stream": True}, "stream"), ({"n": 2}, "n"), ({"use_beam_search": True}, "use_beam_search"),
                        ({"prompt_logprobs": 1}, "prompt_logprobs")):
        assert name in _err(_post(base, "/v1/chat/completions/batch", {"messages": CONVS, **extra}))["message"]
    assert _post(base, "/v1/chat/completions/batch", {"messages": [[]]}).status_code == 400


def test_tokenizer_info_load_ping_and_invocations(base):
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and "vocab_file" not in info and "tokenizer_file" not in info
    assert httpx.get(f"{base}/ping", timeout=30).status_code == 200
    assert httpx.post(f"{base}/ping", timeout=30).status_code == 200
    assert httpx.get(f"{base}/load", timeout=30).json() == {"server_load": 0}

    async def load_while_streaming():
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{base}/v1/completions", json={
                    "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}) as s:
                async for _ in s.aiter_lines():
                    return (await http.get(f"{base}/load")).json()["server_load"]

    assert asyncio.run(load_while_streaming()) >= 1
    chat = {"messages": CONVS[0], **GREEDY}
    via = _post(base, "/invocations", chat).json()
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == _post(base, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    completion = {"prompt": "The quick brown fox", **GREEDY}
    via = _post(base, "/invocations", completion).json()
    assert via["object"] == "text_completion"
    assert via["choices"][0]["text"] == _post(base, "/v1/completions", completion).json()["choices"][0]["text"]
    assert "Cannot find suitable handler" in _err(_post(base, "/invocations", {"input": "x"}))["message"]
    err = _err(_post(base, "/invocations", {"prompt": "x", "max_tokens": "five"}))
    assert err["param"] == "max_tokens"
    assert _err(httpx.post(f"{base}/invocations", content=b"{not json", timeout=30))["type"] == "BadRequestError"


def test_tokenize_takes_vllms_forms(base):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = _post(base, "/tokenize", {"messages": msgs, "tools": tools, "return_token_strs": True}).json()
    assert chat["count"] == len(chat["tokens"]) == len(chat["token_strs"]) and chat["max_model_len"] > 0
    assert all(isinstance(s, str) for s in chat["token_strs"])
    no_prompt = _post(base, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < chat["count"]
    cont = _post(base, "/tokenize", {"messages": msgs + [{"role": "assistant", "content": "It is"}],
                                     "continue_final_message": True, "add_generation_prompt": False}).json()
    assert cont["count"] > no_prompt["count"]
    text = _post(base, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert len(text["token_strs"]) == text["count"]
    plain = _post(base, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == text["tokens"][text["count"] - plain["count"]:]
    assert _post(base, "/tokenize", {"prompt": "x"}).json()["token_strs"] is None  # vLLM's shape
    # the generation path tokenizes the same way: what /tokenize counts is what usage counts
    used = _post(base, "/v1/chat/completions", {"messages": msgs, **GREEDY}).json()["usage"]["prompt_tokens"]
    assert used == _post(base, "/tokenize", {"messages": msgs}).json()["count"]
    with_bos = _post(base, "/v1/chat/completions", {"messages": msgs, "add_special_tokens": True, **GREEDY}).json()
    assert with_bos["usage"]["prompt_tokens"] == _post(base, "/tokenize", {
        "messages": msgs, "add_special_tokens": True}).json()["count"]


def test_prompt_logprobs_and_prompt_token_ids_where_vllm_puts_them(base):
    r = _post(base, "/v1/completions", {"prompt": ["The quick brown fox", "Once upon"], "prompt_logprobs": 2,
                                        "return_token_ids": True, **GREEDY}).json()
    for choice in r["choices"]:
        plp, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
        assert plp[0] is None and len(plp) == len(ids)
        for tok, entry in zip(ids[1:], plp[1:]):
            assert str(tok) in entry and len(entry) <= 3  # its own token and the top 2
            for lp in entry.values():
                assert lp["logprob"] <= 0 and lp["rank"] >= 1 and isinstance(lp["decoded_token"], str)
    chat = _post(base, "/v1/chat/completions", {"messages": CONVS[1], "prompt_logprobs": 0,
                                                "return_token_ids": True, **GREEDY}).json()
    assert chat["prompt_token_ids"] and len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert _post(base, "/v1/chat/completions", {"messages": CONVS[1], **GREEDY}).json()["prompt_token_ids"] is None


def _cum_logprob(base, prompt_ids: list[int], out_ids: list[int]) -> float:
    """The model's logprob of ``out_ids`` after ``prompt_ids``, read back through echo."""
    r = _post(base, "/v1/completions", {"prompt": prompt_ids + out_ids, "echo": True, "max_tokens": 0,
                                        "logprobs": 0}).json()
    return sum(r["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids):])


def test_beam_search_width_1_is_greedy_and_wider_beams_come_best_first(base):
    prompt = _post(base, "/tokenize", {"prompt": "In a hole in the ground"}).json()["tokens"]
    greedy = _post(base, "/v1/completions", {"prompt": prompt, "return_token_ids": True, **GREEDY}).json()
    beam = {"prompt": prompt, "use_beam_search": True, "return_token_ids": True, "max_tokens": 5, "ignore_eos": True}
    one = _post(base, "/v1/completions", {**beam, "n": 1}).json()
    assert one["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    three = _post(base, "/v1/completions", {**beam, "n": 3, "length_penalty": 0.0}).json()
    outs = [c["token_ids"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and len({tuple(o) for o in outs}) == 3
    scores = [_cum_logprob(base, prompt, o) for o in outs]
    assert scores == sorted(scores, reverse=True), scores
    assert scores[0] >= _cum_logprob(base, prompt, greedy["choices"][0]["token_ids"]) - 1e-4
    assert three["usage"]["completion_tokens"] == 15
    assert all(c["finish_reason"] == "length" for c in three["choices"])
    # a chat, through the openai SDK (extra_body, as a vLLM client sends it)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=None, messages=CONVS[0], n=2, max_tokens=4, temperature=0.7,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].message.content != r.choices[1].message.content
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=None, messages=CONVS[0], n=2, max_tokens=4, stream=True,
                                                extra_body={"use_beam_search": True, "ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]
    # streamed as vLLM streams it: each beam whole in one chunk, then usage and [DONE]
    streamed = _post(base, "/v1/completions", {**beam, "n": 3, "length_penalty": 0.0, "stream": True,
                                               "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert [e["choices"][0]["token_ids"] for e in events if e["choices"]] == outs
    assert events[-1]["usage"]["completion_tokens"] == 15
    for extra, name in (({"top_p": 0.5}, "top_p"), ({"logprobs": 1}, "logprobs"), ({"stop": ["x"]}, "stop")):
        assert name in _err(_post(base, "/v1/completions", {**beam, **extra}))["message"]
    assert "length_penalty" in _err(_post(base, "/v1/completions", {"prompt": "x", "length_penalty": 2.0}))["message"]
    assert "max-logprobs" in _err(_post(base, "/v1/completions", {**beam, "n": 16}))["message"]


def test_truncation_side_keeps_the_start_or_the_end(base):
    ids = _post(base, "/tokenize", {"prompt": "one two three four five six seven"}).json()["tokens"]
    for side, kept in (("left", ids[-3:]), ("right", ids[:3]), (None, ids[-3:])):
        body = {"prompt": "one two three four five six seven", "truncate_prompt_tokens": 3,
                "return_token_ids": True, **GREEDY}
        if side:
            body["truncation_side"] = side
        assert _post(base, "/v1/completions", body).json()["choices"][0]["prompt_token_ids"] == kept
    assert _err(_post(base, "/v1/completions", {"prompt": "x", "truncation_side": "middle"}))["param"] == \
        "truncation_side"


def test_validation_messages_name_every_bad_key_and_pydantics_type(base):
    msg = _err(_post(base, "/v1/completions", {"prompt": "x", "logit_bias": {"a": 1, "b": 2, "5": 1}}))["message"]
    assert "'a'" in msg and "'b'" in msg
    for seed, kind in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        err = _err(_post(base, "/v1/completions", {"prompt": "x", "seed": seed}))
        assert kind in err["message"] and err["param"] == "seed"


def test_unknown_fields_are_accepted_named_and_change_nothing(base):
    plain = _post(base, "/v1/chat/completions", {"messages": CONVS[0], **GREEDY})
    assert "x-pagedserve-ignored-fields" not in plain.headers
    r = _post(base, "/v1/chat/completions", {"messages": [{**CONVS[0][0], "x_trace": "t"}], "my_router_hint": 3,
                                             **GREEDY})
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedserve-ignored-fields"] == "my_router_hint, messages[0].x_trace"
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    streamed = _post(base, "/v1/completions", {"prompt": "Hi", "stream": True, "vendor_flag": True, **GREEDY})
    assert streamed.headers["x-pagedserve-ignored-fields"] == "vendor_flag" and "[DONE]" in streamed.text
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(model=None, prompt="Hi", max_tokens=2,
                                                      extra_body={"other_server_option": 1})
    assert raw.headers["x-pagedserve-ignored-fields"] == "other_server_option" and raw.parse().choices
    tok = _post(base, "/tokenize", {"prompt": "Hi", "foo": 1})
    assert tok.status_code == 200 and tok.headers["x-pagedserve-ignored-fields"] == "foo"
    # known to OpenAI or vLLM, not implemented here: refused, named
    for field, value in (("service_tier", "auto"), ("bad_words", ["x"]), ("allowed_token_ids", [1])):
        err = _err(_post(base, "/v1/chat/completions", {"messages": CONVS[0], field: value}))
        assert err["param"] == field and "not implemented" in err["message"]
    err = _err(_post(base, "/v1/chat/completions", {"messages": [{**CONVS[0][0], "audio": {"id": "a"}}]}))
    assert err["param"] == "messages.0.audio"
    # a nested object of ours still refuses a typo
    assert _err(_post(base, "/v1/completions", {"prompt": "x", "stream": True,
                                                "stream_options": {"include_usage": True, "chunk": 1}}))


def test_a_client_that_leaves_a_beam_search_or_a_batch_leaves_nothing_running(base):
    """Beam search and batched chat hold several engine requests for one client: when it
    goes, every one of them is aborted (far fewer tokens are generated than asked) and its
    blocks freed, and the front holds nothing."""
    from test_serve_batch_echo import _wait_idle

    long = {"max_tokens": 960, "ignore_eos": True}
    for path, body, asked in (
            ("/v1/completions", {"prompt": "Once upon a time", "use_beam_search": True, "n": 4, **long}, 4 * 960),
            ("/v1/chat/completions/batch", {"messages": CONVS, **long}, 3 * 960)):
        before = _wait_idle(base)
        try:
            r = httpx.post(f"{base}{path}", json=body, timeout=1.0)
            raise AssertionError(f"{path} answered within the wait: {r.status_code} {r.text[:300]}")
        except httpx.TimeoutException:
            pass
        after = _wait_idle(base)
        assert after["pagedserve:num_requests_running"] == 0 and after["pagedserve:kv_cache_usage_perc"] == 0, path
        generated = after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"]
        assert generated < asked * 2 / 3, (path, generated)
        assert httpx.get(f"{base}/load", timeout=30).json() == {"server_load": 0}
    assert _post(base, "/v1/completions", {"prompt": "Hi", **GREEDY}).status_code == 200
