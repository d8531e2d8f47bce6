"""The Responses API (/v1/responses) with the openai SDK's ``client.responses``, on the
session's shared Serve app (the random test model, tests/conftest.py).

The story: a text input is answered by one message whose text, usage and status the SDK
reads, stored and retrievable until deleted; items and instructions render through the
chat template; a continuation by previous_response_id sends the model exactly the first
turn plus the new input (its input_tokens equal /tokenize's count of that conversation,
and equal those of the same conversation sent back as items). A stream carries the typed
events in order, numbered, and its deltas add up to the final text. A named function tool
is a function_call item whose arguments validate (the grammar holds the random model to
the schema), streamed as argument deltas too; its output sent back answers as a message.
text.format json_schema gives JSON that validates. Mistakes are 400s naming the field,
what is not implemented is refused (never ignored), an unknown model or id a 404, a full
server the chat route's 429, and dropped streams leave no request and no KV block behind.
"""

from __future__ import annotations

import asyncio
import json
import typing

import httpx
import jsonschema
import openai
import pytest

from _tools_data import ASK, SCHEMAS, WEATHER
from conftest import SERVE_ENGINE
from test_serve_cancel import aborted, wait_aborted, wait_idle

# The chat tool in the Responses API's flat shape.
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
NAMED = {"type": "function", "name": "get_weather"}
SHORT = dict(max_output_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _count(base: str, messages: list[dict]) -> int:
    r = httpx.post(f"{base}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_text_input_is_one_message_stored_until_deleted(client, model):
    r = client.responses.create(model=model, input="Say hello.", **SHORT)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status in ("completed", "incomplete")
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 8 and u.total_tokens == u.input_tokens + u.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 8
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=model, input="Say hello.", store=False, **SHORT)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_items_instructions_and_previous_response_id(openai_app, client, model):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi there."}]}]
    first = client.responses.create(model=model, input=items, instructions="Be terse.", **SHORT)
    assert first.instructions == "Be terse."
    convo = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi there."}]
    assert first.usage.input_tokens == _count(openai_app, [{"role": "system", "content": "Be terse."}] + convo)
    # The continuation's prompt is the first turn (not its instructions: OpenAI's rule) and the new input.
    second = client.responses.create(model=model, previous_response_id=first.id, input="And then?", **SHORT)
    assert second.previous_response_id == first.id
    convo += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == _count(openai_app, convo) > first.usage.input_tokens
    # The same conversation sent back as items (the first turn's output as given) is the same prompt.
    again = client.responses.create(model=model, input=items + list(first.output)
                                    + [{"role": "user", "content": "And then?"}], **SHORT)
    assert again.usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, previous_response_id="resp_nope", input="x", **SHORT)
    assert e.value.body["param"] == "previous_response_id"


EVENTS_OF_A_MESSAGE = ["response.created", "response.in_progress", "response.output_item.added",
                       "response.content_part.added", "response.output_text.delta",
                       "response.output_text.done", "response.content_part.done",
                       "response.output_item.done", "response.completed"]


def _kinds(events) -> list[str]:
    kinds = [e.type for e in events]
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one


def test_stream_events(client, model):
    with client.responses.stream(model=model, input="Tell a story.", max_output_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _kinds(events) == EVENTS_OF_A_MESSAGE
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Deltas add up to the text; how many there are is the reader's pace: a client that reads
    # slower than the steps gets merged deltas (flow control), on a busy machine even one.
    assert "".join(deltas) == final.output_text and len(deltas) >= 1
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # create(stream=True): the raw events, the same kinds.
    raw = list(client.responses.create(model=model, input="Tell a story.", stream=True, **SHORT))
    assert _kinds(raw) == EVENTS_OF_A_MESSAGE and raw[-1].response.output_text == raw[-3].part.text


def test_function_call_round_trip(openai_app, client, model):
    r = client.responses.create(model=model, input=ASK, tools=[WEATHER_TOOL], tool_choice=NAMED,
                                max_output_tokens=64, temperature=1.0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    # The result sent back: as items, or after previous_response_id; the same prompt either way.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    kw = dict(model=model, tools=[WEATHER_TOOL], tool_choice="none", **SHORT)
    answer = client.responses.create(input=ASK + [call, result], **kw)
    assert [o.type for o in answer.output] == ["message"]
    chained = client.responses.create(previous_response_id=r.id, input=[result], **kw)
    assert chained.usage.input_tokens == answer.usage.input_tokens
    as_chat = ASK + [{"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    assert answer.usage.input_tokens == _count(openai_app, as_chat)
    # Streamed: the call's arguments come as deltas that add up to the final call's.
    with client.responses.stream(model=model, input=ASK, tools=[WEATHER_TOOL], tool_choice=NAMED,
                                 max_output_tokens=64, temperature=1.0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.function_call_arguments.delta", "response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
    [call] = final.output
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])


def test_text_format_json_schema(client, model):
    schema = SCHEMAS["get_weather"]
    r = client.responses.create(model=model, input="The weather, as JSON.", max_output_tokens=64, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "weather", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("change, status, param, words", [
    (dict(background=True), 400, "background", "not implemented"),
    (dict(reasoning={"effort": "high", "summary": "auto"}), 400, "reasoning.summary", "no reasoning summaries"),
    (dict(truncation="auto"), 400, "truncation", "not implemented"),
    (dict(tools=[{"type": "web_search"}]), 400, "tools[0].type", "'web_search' is not implemented"),
    (dict(tools=[{"type": "function", "parameters": {}}]), 400, "tools[0].name", "Field required"),
    (dict(tool_choice={"type": "file_search"}), 400, "tool_choice", "not implemented"),
    (dict(tools=[WEATHER_TOOL]), 400, None, "does not render tools"),  # tool_choice "auto" on this model
    (dict(input=[{"type": "reasoning", "summary": [], "encrypted_content": "x"}]), 400, "input[0].encrypted_content",
     "encrypted reasoning is not implemented"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]), 400,
     "input[0].content[0].type", "'input_image' is not implemented"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), 400, "input[0].call_id", "Field required"),
    (dict(input=[]), 400, "input", "must not be empty"),
    (dict(input=None), 400, "input", "Field required"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format.schema", "needs its schema"),
    (dict(max_output_tokens=0), 400, "max_output_tokens", "at least 1"),
    (dict(temperature="hot"), 400, "temperature", "float"),
    (dict(model="gpt-9"), 404, None, "gpt-9"),
])
def test_mistakes_and_what_is_not_implemented(openai_app, change, status, param, words):
    body = {k: v for k, v in {"input": "x", "max_output_tokens": 4, **change}.items() if v is not None}
    r = httpx.post(f"{openai_app}/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err


def test_retrieve_and_cancel_answer_what_they_can(openai_app, client, model):
    r = client.responses.create(model=model, input="x", **SHORT)
    assert httpx.get(f"{openai_app}/v1/responses/{r.id}", params={"stream": "true"}).json()["error"]["param"] == "stream"
    refused = httpx.post(f"{openai_app}/v1/responses/{r.id}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    assert httpx.post(f"{openai_app}/v1/responses/resp_nope/cancel").status_code == 404
    # A field no schema has is accepted and named back, as on the other routes.
    named = httpx.post(f"{openai_app}/v1/responses", json={"input": "x", "max_output_tokens": 2, "x_trace": 1})
    assert named.status_code == 200 and named.headers["x-pagedserve-ignored-fields"] == "x_trace"


def test_full_server_is_429_and_dropped_streams_free_everything(openai_app, model):
    """The running batch and the waiting queue filled with Responses streams, the next is
    the door's 429; then every stream is dropped, and nothing runs or holds KV."""
    url = f"{openai_app}/v1/responses"
    long = {"model": model, "input": "Once upon a time", "max_output_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    wait_idle(openai_app)
    aborts0 = aborted(openai_app)
    full = SERVE_ENGINE["max_num_seqs"] + SERVE_ENGINE["max_waiting_requests"]

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as ac:
            streams, readers = [], []
            try:
                for i in range(full):
                    cm = ac.stream("POST", url, json=long)
                    resp = await cm.__aenter__()
                    streams.append(cm)
                    assert resp.status_code == 200
                    readers.append(resp.aiter_lines())  # kept alive: a collected one disconnects
                    if i < SERVE_ENGINE["max_num_seqs"]:  # running: its first event has come
                        assert (await anext(readers[-1])) == "event: response.created"
                return await ac.post(url, json={**long, "stream": False, "max_output_tokens": 4})
            finally:
                for cm in streams:  # dropped: the engine aborts them
                    await cm.__aexit__(None, None, None)

    refused = asyncio.run(scenario())
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
    after = wait_idle(openai_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0 and after["pagedserve:num_requests_running"] == 0
    assert wait_aborted(openai_app, aborts0 + full) == aborts0 + full
    assert httpx.get(f"{openai_app}/load").json()["server_load"] == 0


def test_every_sdk_request_parameter_is_implemented_ignored_or_refused():
    """The openai SDK's own Responses parameters: none falls through as "unknown" (that
    would accept and ignore a field a client relies on)."""
    from openai.types.responses import response_create_params

    from pagedserve.cluster.front.responses.protocol import NOT_IMPLEMENTED, ResponsesRequest

    sdk = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert sdk - set(ResponsesRequest.model_fields) - set(NOT_IMPLEMENTED) == set()
    assert not set(NOT_IMPLEMENTED) & set(ResponsesRequest.model_fields)


# ------------------------------------------------------------------ units
def _sdk_read(plan, deltas: list[str], finish: str = "stop"):
    """The events a ResponsesStream writes for these engine deltas, read by the openai SDK's
    own stream accumulator: (event kinds, the SDK's final response, the stored one)."""
    from openai._models import construct_type_unchecked
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from pagedserve.cluster.front.responses.events import ResponsesStream
    from pagedserve.cluster.front.responses.protocol import ResponsesRequest
    from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput

    stored = []
    state = ResponsesStream(ResponsesRequest.model_validate({"input": "x"}).shell("resp_1", "m", 1), plan,
                            stored.append)
    lines, text = [], ""
    for i, d in enumerate(deltas):
        text, last = text + d, i == len(deltas) - 1
        c = CompletionOutput(0, text, list(range(i + 1)), finish if last else None, delta_text=d, delta_token_ids=[i])
        lines += state.chunks(RequestOutput("resp_1", None, [1, 2, 3], [c], finished=last), {})
    sdk, kinds = ResponseStreamState(input_tools=omit, text_format=omit), []
    for block in lines:
        event, data = block.strip().split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert event == f"event: {obj['type']}"
        kinds += [e.type for e in sdk.handle_event(construct_type_unchecked(value=obj, type_=ResponseStreamEvent))]
    return kinds, sdk._completed_response, stored[0]


def test_text_then_an_auto_call_stream_as_two_items():
    """tool_choice "auto" (a template that renders tools; the shared app's does not): the
    text before a Hermes block is a message item, the block a function_call item after it."""
    from pagedserve.cluster.front.openai.tool_choice import ToolPlan

    kinds, final, stored = _sdk_read(ToolPlan("auto", []), [
        "Sure.<tool_", 'call>{"name": "set_alarm", "arguments": {"on": true}}</tool_call>', ""])
    assert _kinds([type("E", (), {"type": k}) for k in kinds]) == EVENTS_OF_A_MESSAGE[:-1] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    msg, call = final.output
    assert msg.content[0].text == "Sure." and (call.name, json.loads(call.arguments)) == ("set_alarm", {"on": True})
    assert [(o.id, o.status) for o in stored.output] == [(o.id, o.status) for o in final.output]  # what is kept
    kinds, final, _ = _sdk_read(None, ["a", "b"], finish="length")
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"


def test_store_is_bounded_and_per_tenant():
    from pagedserve.cluster.front.responses.protocol import ResponseObject
    from pagedserve.cluster.front.responses.store import ResponseStore, StoredResponse

    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(StoredResponse(ResponseObject(id=f"r{i}", created_at=0, status="completed", model="m"), [], "a"))
        if i == 1:
            assert store.get("r0", "a") is not None  # used: r1 is now the least recently used
    assert len(store) == 2 and store.get("r1", "a") is None and store.get("r0", "a") is not None
    assert store.get("r2", "b") is None and not store.delete("r2", "b")  # another tenant's: unknown
    assert store.delete("r2", "a") and store.get("r2", "a") is None
