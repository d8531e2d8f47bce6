"""Real client libraries against a real Serve server on 127.0.0.1: langchain-openai's
ChatOpenAI and OpenAI (completions) and litellm, each with invoke/completion, stream and
batch. They send fields of their own choosing (stream_options, n, logit_bias {}, ...):
since a field OpenAI or vLLM has and this server does not implement is a 400, these tests
also pin down that what such clients send by default is understood. Greedy (temperature 0), so a streamed
answer must equal the whole one."""

from __future__ import annotations

import os

import pytest

langchain_openai = pytest.importorskip("langchain_openai")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
litellm = pytest.importorskip("litellm")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_id(openai_app):
    import httpx

    return httpx.get(f"{openai_app}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def chat(openai_app, model_id):
    return langchain_openai.ChatOpenAI(base_url=f"{openai_app}/v1", api_key="unused", model=model_id,
                                       temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=60)


def test_langchain_chat_invoke_stream_batch(chat):
    whole = chat.invoke("Say hello.")
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata.get("finish_reason") in ("length", "stop")
    streamed = "".join(chunk.content for chunk in chat.stream("Say hello."))
    assert streamed == whole.content
    answers = chat.batch(["Say hello.", "Count to three.", "Name a colour."])
    assert len(answers) == 3 and answers[0].content == whole.content
    assert all(isinstance(a.content, str) and a.content for a in answers)


def test_langchain_completions_invoke_stream_batch(openai_app, model_id):
    llm = langchain_openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", model=model_id,
                                  temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=60)
    whole = llm.invoke("Once upon a time")
    assert isinstance(whole, str) and whole
    assert "".join(llm.stream("Once upon a time")) == whole
    # langchain sends a batch as one request with a list of prompts.
    answers = llm.batch(["Once upon a time", "The capital of France is"])
    assert answers[0] == whole and len(answers) == 2


def test_litellm_completion_stream_batch(openai_app, model_id):
    kw = dict(model=f"openai/{model_id}", api_base=f"{openai_app}/v1", api_key="unused",
              temperature=0, max_tokens=MAX_TOKENS, num_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Say hello."}]
    whole = litellm.completion(messages=messages, **kw)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and text and whole.usage.completion_tokens == MAX_TOKENS
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=messages,
                                                                                   stream=True, **kw))
    assert streamed == text
    answers = litellm.batch_completion(messages=[messages, [{"role": "user", "content": "Count."}]], **kw)
    assert len(answers) == 2 and answers[0].choices[0].message.content == text


def test_vllm_extras_through_the_clients(openai_app, model_id):
    """What a vLLM user sends through these clients' extra_body: beam search (langchain
    invoke and batch, litellm), prompt logprobs (litellm); and vLLM's batched chat, which
    no client has a call for, over httpx."""
    import httpx

    beams = langchain_openai.ChatOpenAI(base_url=f"{openai_app}/v1", api_key="unused", model=model_id,
                                        temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=60, n=2,
                                        extra_body={"use_beam_search": True, "ignore_eos": True})
    from langchain_core.messages import HumanMessage

    result = beams.generate([[HumanMessage("Say hello.")]]).generations[0]
    assert len(result) == 2 and result[0].text != result[1].text
    assert beams.invoke("Say hello.").content == result[0].text  # invoke: the best beam
    assert [len(g) for g in beams.generate([[HumanMessage("Say hello.")],
                                            [HumanMessage("Count to three.")]]).generations] == [2, 2]
    kw = dict(model=f"openai/{model_id}", api_base=f"{openai_app}/v1", api_key="unused",
              max_tokens=MAX_TOKENS, num_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Say hello."}]
    beam = litellm.completion(messages=messages, n=2, extra_body={"use_beam_search": True, "ignore_eos": True}, **kw)
    assert [c.message.content for c in beam.choices] == [g.text for g in result]
    plp = litellm.completion(messages=messages, temperature=0, extra_body={"prompt_logprobs": 0}, **kw)
    plp = getattr(plp, "prompt_logprobs", None) or plp.model_extra.get("prompt_logprobs")
    assert plp[0] is None and len(plp) > 1
    batch = httpx.post(f"{openai_app}/v1/chat/completions/batch", timeout=60, json={
        "model": model_id, "temperature": 0, "max_tokens": MAX_TOKENS,
        "messages": [messages, [{"role": "user", "content": "Count to three."}]]}).json()
    alone = litellm.completion(messages=messages, temperature=0, **kw).choices[0].message.content
    assert [c["index"] for c in batch["choices"]] == [0, 1] and batch["choices"][0]["message"]["content"] == alone
