"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on the session's shared
Serve app, driven by the real ``anthropic`` SDK (httpx where the SDK cannot send the mistake).

The story: a message answers in Anthropic's shape, and its stream (Anthropic's event names,
in Anthropic's order) reassembles to the same greedy text; the system prompt and a tool
round trip reach the chat template, and count_tokens counts exactly the prompt the message
was charged for; a stop sequence stops with ``stop_sequence``; a named or "any" tool
answers with ``tool_use`` blocks whose input validates against the tool's schema, streamed
as ``input_json_delta`` fragments. Mistakes are 400s (404 for another model) in Anthropic's
error shape, naming the field; overload is the chat path's 429 + Retry-After in that shape;
dropped streams free the engine.

The SDK no longer takes ``temperature`` (Anthropic's API still does): it rides in extra_body.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from conftest import SERVE_ENGINE
from test_serve_cancel import wait_idle

GREEDY = {"temperature": 0.0}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "unit": {"type": "string", "enum": ["C", "F"]}}}}
ALARM = {"name": "set_alarm", "input_schema": {"type": "object", "additionalProperties": False, "required": ["on"],
                                               "properties": {"on": {"type": "boolean"}}}}


@pytest.fixture(scope="module")
def client(openai_app):
    return anthropic.Anthropic(base_url=openai_app, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(openai_app):
    return httpx.get(f"{openai_app}/v1/models").json()["data"][0]["id"]


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def _charged(msg) -> int:
    return msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def _anthropic_error(e: anthropic.APIStatusError, status: int) -> str:
    assert e.status_code == status
    assert e.body["type"] == "error" and set(e.body["error"]) == {"type", "message"}, e.body
    return e.body["error"]["message"]


def test_message_and_its_stream(client, model_name):
    msg = client.messages.create(model=model_name, max_tokens=8, system="Be brief.", messages=ASK,
                                 metadata={"user_id": "u-1"}, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == model_name and [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=model_name, system="Be brief.", messages=ASK).input_tokens
    assert _charged(msg) == counted
    assert client.messages.count_tokens(model=model_name, messages=ASK).input_tokens < counted  # the system prompt

    events = list(client.messages.create(model=model_name, max_tokens=8, system="Be brief.", messages=ASK,
                                         stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + ["content_block_stop"]
    assert events[0].message.usage.input_tokens == counted  # before the cache is known: the prompt
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(msg)
    assert events[-2].delta.stop_reason == msg.stop_reason and events[-2].usage.output_tokens == msg.usage.output_tokens

    with client.messages.stream(model=model_name, max_tokens=8, system="Be brief.", messages=ASK,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert _text(final) == _text(msg) and _charged(final) == counted and final.id.startswith("msg_")


def test_stop_sequence_and_prefill(client, model_name):
    text = _text(client.messages.create(model=model_name, max_tokens=12, messages=ASK, extra_body=GREEDY))
    # Two characters from inside the text, at their first occurrence.
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    msg = client.messages.create(model=model_name, max_tokens=12, messages=ASK, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert _text(msg) == text[:text.find(stop)]
    # A last assistant message is a prefill: the answer continues it (the greedy text's rest).
    cont = client.messages.create(model=model_name, max_tokens=4, extra_body=GREEDY,
                                  messages=ASK + [{"role": "assistant", "content": text[:text.find(stop)]}])
    assert all(b.type == "text" for b in cont.content) and 0 < cont.usage.output_tokens <= 4


def test_tool_use_round_trip(client, model_name):
    msg = client.messages.create(model=model_name, max_tokens=64, messages=ASK, tools=[WEATHER, ALARM],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    convo = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"},
                       {"type": "text", "text": "And tomorrow?"}]}]
    answer = client.messages.create(model=model_name, max_tokens=4, messages=convo, tools=[WEATHER, ALARM],
                                    tool_choice={"type": "none"})
    assert all(b.type == "text" for b in answer.content) and answer.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model=model_name, messages=convo, tools=[WEATHER, ALARM],
                                           tool_choice={"type": "none"}).input_tokens
    assert _charged(answer) == counted > client.messages.count_tokens(model=model_name, messages=ASK).input_tokens

    # "any", streamed: each call a tool_use block whose input_json_delta fragments are its input.
    events = list(client.messages.create(model=model_name, max_tokens=96, messages=ASK, tools=[WEATHER, ALARM],
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                         stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts and all(s.content_block.type == "tool_use" for s in starts)
    assert events[-2].delta.stop_reason == "tool_use"
    for s in starts:
        parts = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == s.index]
        schema = {"get_weather": WEATHER, "set_alarm": ALARM}[s.content_block.name]["input_schema"]
        jsonschema.validate(json.loads("".join(parts)), schema)


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": None}, 400, "max_tokens: Field required"),
    ({"top_n": 3}, 400, "top_n: Extra inputs are not permitted"),
    ({"service_tier": "auto"}, 400, "service_tier: not implemented by this server"),
    ({"thinking": {"type": "enabled"}}, 400, 'thinking: `budget_tokens` goes with type "enabled"'),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                   "image/png", "data": "iVBORw0KGgo="}}]}]}, 400, "content block 0 has type 'image': images are not"),
    ({"tools": [WEATHER]}, 400, 'tool_choice {"type": "auto"} (the default with tools) needs a chat template'),
    ({"tools": [{**WEATHER, "strict": True}]}, 400, "tools.0.strict: not implemented"),
    ({"model": "claude-9"}, 404, "claude-9"),
    (b'{"model": ', 400, "the body is not valid JSON"),
])
def test_mistakes_in_anthropic_error_shape(openai_app, model_name, body, status, words):
    if isinstance(body, dict):
        body = {"model": model_name, "max_tokens": 4, "messages": ASK, **body}
        body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{openai_app}/v1/messages", **({"json": body} if isinstance(body, dict) else {"content": body}))
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == ("not_found_error" if status == 404
                                                               else "invalid_request_error")
    assert words in err["error"]["message"], err


def test_sdk_exception_types(client, model_name):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model_name, max_tokens=4, messages=ASK, extra_body={"top_n": 3})
    assert "top_n" in _anthropic_error(e.value, 400)
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=model_name, messages=[{"role": "user", "content": [image]}])
    assert "images are not supported" in _anthropic_error(e.value, 400)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", max_tokens=4, messages=ASK)
    assert "claude-9" in _anthropic_error(e.value, 404)


def test_overload_is_429_and_dropped_streams_free_everything(openai_app, model_name):
    """4 long streams fill the running batch, 2 more the waiting queue; the next message is
    the chat path's 429 with Retry-After, in Anthropic's shape. Then every client leaves, and
    the engine goes idle (the requests were aborted, their blocks freed). The fillers are
    chat streams with ``ignore_eos`` (the Messages API has no such field): a filler of the
    tiny random model that drew its end token would free its place, and the message would
    be admitted instead."""
    body = {"model": model_name, "messages": ASK, "max_tokens": 900, "stream": True, "ignore_eos": True}

    async def scenario():
        sdk = anthropic.AsyncAnthropic(base_url=openai_app, api_key="unused", max_retries=0, timeout=60)
        async with httpx.AsyncClient(base_url=openai_app, timeout=60) as client:
            fillers, readers = [], []
            try:
                for i in range(SERVE_ENGINE["max_num_seqs"] + SERVE_ENGINE["max_waiting_requests"]):
                    req = client.build_request("POST", "/v1/chat/completions", json=body)
                    resp = await client.send(req, stream=True)
                    assert resp.status_code == 200  # admitted
                    fillers.append(resp)
                    # Kept alive: a line iterator collected closes its response (a disconnect).
                    readers.append(resp.aiter_lines())
                    if i < SERVE_ENGINE["max_num_seqs"]:  # running: its first output came
                        await anext(readers[-1])
                with pytest.raises(anthropic.RateLimitError) as refused:
                    await sdk.messages.create(model=model_name, max_tokens=4, messages=ASK)
                return refused.value
            finally:
                for r in fillers:  # the clients leave
                    await r.aclose()

    refused = asyncio.run(scenario())
    assert int(refused.response.headers["Retry-After"]) >= 1
    assert refused.body["error"]["type"] == "rate_limit_error" and "overloaded" in _anthropic_error(refused, 429)
    idle = wait_idle(openai_app)
    assert idle["pagedserve:kv_cache_usage_perc"] == 0 and idle["pagedserve:num_requests_running"] == 0
    assert httpx.get(f"{openai_app}/load").json()["server_load"] == 0


def test_a_dropped_message_stream_frees_everything(openai_app, model_name):
    """A client that leaves a Messages stream after its first event: the request is aborted."""
    async def scenario():
        sdk = anthropic.AsyncAnthropic(base_url=openai_app, api_key="unused", max_retries=0, timeout=60)
        stream = await sdk.messages.create(model=model_name, messages=ASK, max_tokens=900, stream=True)
        assert (await stream.__anext__()).type == "message_start"
        await stream.close()

    asyncio.run(scenario())
    idle = wait_idle(openai_app)
    assert idle["pagedserve:kv_cache_usage_perc"] == 0 and idle["pagedserve:num_requests_running"] == 0


def test_x_api_key_is_the_key_on_messages():
    """The anthropic SDK sends its key as ``x-api-key``: on /v1/messages the edge takes it as
    ``Authorization: Bearer`` (elsewhere only Authorization counts)."""
    from pagedserve.cluster.front import edge

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def status(path: str, headers: dict) -> int:
        sent = []

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "query_string": b"",
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
        await edge.EdgeMiddleware(app)(scope, receive, send)
        return sent[0]["status"]

    before = edge._guard
    edge.activate(edge.EdgeGuard(edge.IngressConfig(api_key="sk-1"), None))
    try:
        got = [asyncio.run(status(p, h)) for p, h in [
            ("/v1/messages", {"x-api-key": "sk-1"}), ("/v1/messages/count_tokens", {"x-api-key": "sk-1"}),
            ("/v1/messages", {"x-api-key": "sk-2"}), ("/v1/chat/completions", {"x-api-key": "sk-1"}),
            ("/v1/messages", {"authorization": "Bearer sk-1"})]]
    finally:
        edge.activate(before)
    assert got == [200, 200, 401, 401, 200]
