"""/v1/completions as vLLM users call it, over a real Serve app and the openai SDK:
batches of prompts, echo, prompt_logprobs, max_tokens 0, best_of, suffix, prompt
truncation; and chat's echo with continue_final_message.

The story: a batch of 3 prompts with n=2 is 6 choices, prompt i's at i*2 and i*2+1,
each (greedy) equal to that prompt sent alone, streamed or not; echo puts the prompt in
front, its logprobs (first None) equal to the prompt_logprobs the engine computes (which
tests/test_prompt_logprobs.py checks against Hugging Face); a client that leaves a
streamed batch frees every prompt's blocks.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from conftest import SERVE_ENGINE

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground there lived"]
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def singles(client):
    return [client.completions.create(model=None, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]


def _post(base, path, body):
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def _err(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]["message"]


def _metrics(base):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels.get("reason")}


def _wait_idle(base, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(base)
        if (m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_running"] == 0
                and m["pagedserve:num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_batch_of_three_with_n2_is_six_choices_in_order(openai_app, client, singles):
    r = client.completions.create(model=None, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in singles for _ in range(2)]
    assert r.usage.completion_tokens == 6 * 6
    # Token-id prompts batch the same way.
    tok = [_post(openai_app, "/tokenize", {"prompt": p}).json()["tokens"] for p in PROMPTS]
    r2 = client.completions.create(model=None, prompt=tok, **GREEDY)
    assert [c.text for c in r2.choices] == singles
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens == sum(len(t) for t in tok)


def test_streamed_batch_has_right_indices_one_done_and_summed_usage(openai_app, singles):
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{openai_app}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: "):] for line in resp.iter_lines() if line]
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in range(6)] == [t for t in singles for _ in range(2)]
    assert finish == {i: "length" for i in range(6)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 36


def test_empty_batches_and_unsupported_fields_are_400(openai_app):
    assert "empty" in _err(_post(openai_app, "/v1/completions", {"prompt": []}), 400)
    assert "empty" in _err(_post(openai_app, "/v1/completions", {"prompt": [[1, 2], []]}), 400)
    msg = _err(_post(openai_app, "/v1/completions", {"prompt": "x", "suffix": "y"}), 400)
    assert "suffix is not supported by this model" in msg
    assert "best_of" in _err(_post(openai_app, "/v1/completions",
                                   {"prompt": "x", "best_of": 2, "stream": True}), 400)
    assert "best_of" in _err(_post(openai_app, "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}), 400)
    assert "max_tokens" in _err(_post(openai_app, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400)
    assert "prompt_logprobs" in _err(_post(openai_app, "/v1/completions",
                                           {"prompt": "x", "prompt_logprobs": 1, "stream": True}), 400)


def test_echo_text_and_logprobs(openai_app, client, singles, serve_model):
    r = client.completions.create(model=None, prompt=PROMPTS[:2], echo=True, logprobs=2, **GREEDY)
    for c, p, s in zip(r.choices, PROMPTS, singles):
        assert c.text == p + s
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None for v in lp.token_logprobs[1:])
        # The prompt's tokens first (BOS included), then one per generated token.
        num_prompt = len(c.model_extra["prompt_logprobs"])
        assert "".join(lp.tokens[:num_prompt]).endswith(p)
        assert len(lp.tokens) == num_prompt + 6
    # The echoed prompt logprobs equal the offline engine's (HF-checked) numbers.
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=serve_model, max_model_len=256, num_gpu_blocks_override=32, dtype="float32")
    off = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    llm.shutdown()
    c = r.choices[0]
    plp = c.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(off.prompt_token_ids)
    for p, (lp, mine) in enumerate(zip(off.prompt_logprobs[1:], plp[1:]), 1):
        tok = str(off.prompt_token_ids[p])
        assert abs(mine[tok]["logprob"] - lp.logprobs[0]) < 1e-4
        assert mine[tok]["rank"] == lp.sampled_rank
        assert abs(c.logprobs.token_logprobs[p] - lp.logprobs[0]) < 1e-4
        assert {int(t) for t in mine} == set(lp.token_ids[:3])
        assert all(e["decoded_token"] is not None for e in mine.values())
    # Token-id prompts echo their decoded text; a stream echoes in each choice's first chunk.
    ids = _post(openai_app, "/tokenize", {"prompt": PROMPTS[1]}).json()["tokens"]
    text = _post(openai_app, "/detokenize", {"tokens": ids}).json()["prompt"]
    r = client.completions.create(model=None, prompt=ids, echo=True, **GREEDY)
    assert r.choices[0].text == text + singles[1]
    chunks = list(client.completions.create(model=None, prompt=PROMPTS, echo=True, stream=True, n=2,
                                            logprobs=1, **GREEDY))
    firsts = {}
    for ch in chunks:
        for c in ch.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == list(range(6))
    for i, c in firsts.items():  # echo + the first delta, the prompt's logprobs first
        assert c.text.startswith(PROMPTS[i // 2])
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) > 3


def test_max_tokens_0_with_echo_returns_the_prompt_only(client):
    r = client.completions.create(model=None, prompt=PROMPTS[0], echo=True, max_tokens=0, logprobs=0)
    c = r.choices[0]
    assert c.text == PROMPTS[0] and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == r.usage.prompt_tokens


def test_best_of_returns_n_of_best_of(client):
    r = client.completions.create(model=None, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=5,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    # The same four samples (seeds 3..6), scored: the returned two are the best two.
    four = client.completions.create(model=None, prompt=PROMPTS[0], n=4, max_tokens=5, logprobs=0,
                                     temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]


def test_truncate_prompt_tokens(openai_app):
    long = [(7 * i) % 200 + 3 for i in range(SERVE_ENGINE["max_model_len"] + 76)]
    body = {"prompt": long, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert "maximum context length" in _err(_post(openai_app, "/v1/completions", body), 400)
    got = _post(openai_app, "/v1/completions", {**body, "truncate_prompt_tokens": 40}).json()
    ref = _post(openai_app, "/v1/completions", {**body, "prompt": long[-40:]}).json()
    assert got["usage"]["prompt_tokens"] == 40
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert got["choices"][0]["prompt_token_ids"] == long[-40:]


def test_chat_echo_continue_final_message_and_prompt_logprobs(openai_app, client, serve_model):
    from transformers import AutoTokenizer

    from pagedserve.cluster.text.tokenizer_pool import render_chat

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False, "echo": True,
            "prompt_logprobs": 1}
    r = _post(openai_app, "/v1/chat/completions", body).json()
    content = r["choices"][0]["message"]["content"]
    assert content.startswith("Once upon")
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    # Continuing means the prompt ends inside the assistant's message (no end-of-turn):
    # that rendering, sent as a plain completion, gives the same tokens.
    tok = AutoTokenizer.from_pretrained(serve_model)
    rendered = render_chat(tok, msgs, "continue")
    assert rendered.endswith("assistant\nOnce upon")
    # As the server encodes a chat prompt: the template holds the special tokens itself.
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == len(ids)
    plain = client.completions.create(model=None, prompt=ids, **{**GREEDY, "max_tokens": 5})
    assert content == "Once upon" + plain.choices[0].text
    # Streamed: the role chunk, then the echo as a content chunk of its own (vLLM).
    extra = {k: body[k] for k in ("ignore_eos", "continue_final_message", "add_generation_prompt", "echo")}
    chunks = list(client.chat.completions.create(model=None, stream=True, messages=msgs, max_tokens=5,
                                                 temperature=0, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "Once upon"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    both = {**body, "add_generation_prompt": True}
    assert "continue_final_message" in _err(_post(openai_app, "/v1/chat/completions", both), 400)


def test_disconnect_from_a_streamed_batch_frees_every_prompt(openai_app):
    before = _wait_idle(openai_app)
    body = {"prompt": PROMPTS, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}

    async def leave_early():
        async with httpx.AsyncClient(timeout=60) as ac:
            async with ac.stream("POST", f"{openai_app}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                seen = set()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                    if len(seen) == 3:
                        break

    asyncio.run(leave_early())
    after = _wait_idle(openai_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
    # They stopped early: far fewer than 3 x 900 tokens were generated.
    assert after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"] < 900


def test_one_refused_prompt_refuses_the_batch_and_frees_the_others(openai_app):
    """Each prompt is admitted on its own; the one that is refused (too long: 400) is the
    answer, and the prompts admitted beside it are cancelled, their blocks freed."""
    long = [5] * (SERVE_ENGINE["max_model_len"] + 10)
    body = {"prompt": [[5, 6, 7] * 20, long, [8, 9] * 30], "max_tokens": 500, "ignore_eos": True}
    assert "maximum context length" in _err(_post(openai_app, "/v1/completions", body), 400)
    after = _wait_idle(openai_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
