"""Tool calling on /v1/chat/completions (``tools`` + ``tool_choice``), as vLLM users call it.

The story: a named function and "required" are guaranteed by the grammar, whatever the
model, so even the random test model answers with calls whose arguments validate
against the function's schema, streamed or not (the streamed argument fragments
concatenate to the same JSON). "auto" needs a template that renders tools: the test
model's ChatML template does not, so it is a 400 saying so; a copy of the model with a
template that does shows the tools in the prompt and turns a Hermes block into a call.
Every user mistake is a 400 naming it, and a tool result sent back renders through the
template. Last, the real default model makes a named call through ``pagedserve.LLM``.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedserve.cluster.front.openai.schemas import ChatCompletionRequest
from pagedserve.cluster.text.chat_template import renders_tools
from pagedserve.cluster.front.openai.tool_choice import tool_plan
from pagedserve.cluster.front.openai.tool_parsers import parse
from pagedserve.cluster.text.tokenizer_pool import render_chat

# Bounded schemas (enums, booleans): a random model under the grammar ends them quickly.
from _tools_data import ALARM, ASK, NAMED, SCHEMAS, TOOLS, WEATHER  # noqa: F401  (shared with test_tool_parsers)


@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _check_calls(calls, names=tuple(SCHEMAS)):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream_calls(chunks):
    """{index: (id, name, concatenated arguments)} and the last finish_reason."""
    calls, finish = {}, None
    for ch in chunks:
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                cid, name, args = calls.get(d.index, (None, None, ""))
                if d.id is not None:
                    assert cid is None, "id/name come in a call's first delta only"
                    cid, name = d.id, d.function.name
                calls[d.index] = (cid, name, args + (d.function.arguments or ""))
    return calls, finish


# ------------------------------------------------------------------ over HTTP
def test_named_tool_call(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS,
                                       tool_choice=NAMED, max_tokens=64, temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check_calls(choice.message.tool_calls)


def test_named_tool_call_streamed(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=64,
        temperature=1.0, seed=4, stream=True))
    calls, finish = _stream_calls(chunks)
    assert finish == "stop" and list(calls) == [0]
    cid, name, args = calls[0]
    assert cid.startswith("call_") and name == "get_weather"
    jsonschema.validate(json.loads(args), SCHEMAS["get_weather"])
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.tool_calls) > 1  # fragments
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)


def test_required_tool_calls(client, model_name):
    # parallel_tool_calls=False (maxItems 1) ends the array after one call: a random model
    # given the choice keeps appending calls until max_tokens (real models stop).
    kw = dict(model=model_name, messages=ASK, max_tokens=96, temperature=0.7,
              tool_choice="required", parallel_tool_calls=False)
    r = client.chat.completions.create(tools=TOOLS, seed=5, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _check_calls([call])
    # Only one tool offered: the call names it.
    [call] = client.chat.completions.create(tools=[ALARM], seed=6, **kw).choices[0].message.tool_calls
    _check_calls([call], names=("set_alarm",))


def test_required_tool_calls_streamed(client, model_name):
    kw = dict(model=model_name, messages=ASK, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_tokens=96, temperature=0.7, seed=7)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = _stream_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and sorted(calls) == list(range(len(whole))) == [0]
    # Same seed, same sample: the stream carries the same call as the whole answer.
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    # More than one call in one stream: test_required_stream_scanner_any_split.


def test_auto_and_none(openai_app, client, model_name):
    # The test model's template (ChatML, role + content only) does not render tools.
    r = httpx.post(f"{openai_app}/v1/chat/completions",
                   json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 400, r.text  # tool_choice defaults to "auto" when tools are given
    assert "does not render tools" in r.json()["error"]["message"]
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS,
                                       tool_choice="none", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("change, words", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope', which is not in tools"),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools.0.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "('f') does not compile as a JSON schema (xgrammar): Unsupported type \"nope\""),
    (dict(tools=None, tool_choice="required"), "needs tools"),
    (dict(tool_choice="sometimes"), 'tool_choice must be'),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "unique"),
    (dict(messages=ASK + [{"role": "tool", "content": "sunny"}]), "tool_call_id"),
    (dict(response_format={"type": "json_object"}), "do not combine it with response_format"),
])
def test_mistakes_are_400(openai_app, change, words):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{openai_app}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_tool_result_round_trip(openai_app, client, model_name):
    first = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED, max_tokens=64, seed=8)
    call = first.choices[0].message.tool_calls[0]
    convo = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    # The template renders the call (as a Hermes block: it has no tool_calls of its own)
    # and the tool's answer.
    tok = httpx.post(f"{openai_app}/tokenize", json={"messages": convo}).json()
    text = httpx.post(f"{openai_app}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text
    r = client.chat.completions.create(model=model_name, messages=convo, tools=TOOLS,
                                       tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None
    # /tokenize takes tools too (rendered where the template renders them; this one does not).
    with_tools = httpx.post(f"{openai_app}/tokenize", json={"messages": convo, "tools": TOOLS})
    assert with_tools.status_code == 200 and with_tools.json()["tokens"] == tok["tokens"]


# A ChatML template that renders tools and calls (Hermes style), for the test model's copy.
HERMES_CHATML = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FORCED = 'Sure.<tool_call>{"name": "set_alarm", "arguments": {"on": true}}</tool_call>'


@pytest.fixture(scope="module")
def hermes_url(serve_url, serve_model, tmp_path_factory):
    """The test model again, its template swapped for one that renders tools."""
    import shutil

    from ray import serve

    from conftest import SERVE_ENGINE, delete_app
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    model = tmp_path_factory.mktemp("hermes") / "hermes-test"
    shutil.copytree(serve_model, model)
    cfg_file = model / "tokenizer_config.json"
    cfg_file.write_text(json.dumps(dict(json.loads(cfg_file.read_text()), chat_template=HERMES_CHATML)))
    cfg = EngineConfig(model=str(model), **dict(SERVE_ENGINE, num_gpu_blocks_override=64))
    serve.run(build_app(cfg, name_prefix="hermes-"), name="hermes-test", route_prefix="/hermes")
    yield f"{serve_url}/hermes"
    delete_app("hermes-test")


def test_auto_with_a_template_that_renders_tools(hermes_url):
    """"auto" end to end: the template shows the tools, and the Hermes block the model
    writes (forced here with a regex: a random model would not) becomes a call."""
    client = openai.OpenAI(base_url=f"{hermes_url}/v1", api_key="unused", max_retries=0, timeout=60)
    tok = httpx.post(f"{hermes_url}/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    text = httpx.post(f"{hermes_url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert '<tools>{"name": "get_weather"' in text
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in FORCED)
    kw = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=64,
              extra_body={"structured_outputs": {"regex": regex}})  # tool_choice: "auto"
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("set_alarm", {"on": True})
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls, finish = _stream_calls(chunks)
    assert finish == "tool_calls" and [(n, json.loads(a)) for _, n, a in calls.values()] == \
        [("set_alarm", {"on": True})]
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == "Sure."


# ------------------------------------------------------------------ units
@pytest.mark.slow
def test_real_model_named_tool_call():
    """SmolLM2-135M-Instruct (the default model; its ChatML template renders no tools)
    through ``pagedserve.LLM``, planned and parsed by the same code as the server: the
    arguments validate, and greedy decoding fills in the city the question names."""
    from pagedserve import LLM
    from pagedserve.cluster.front.openai.tool_choice import constrain_to_schema
    from pagedserve.worker.loading.model_source import default_model_file

    try:
        default_model_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(max_model_len=512, num_gpu_blocks_override=32)
    try:
        tok = llm.get_tokenizer()
        body = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                     max_tokens=48, temperature=0)
        plan = tool_plan(body, renders_tools(tok))
        params = body.to_sampling_params()
        constrain_to_schema(params, plan.schema)
        prompt = render_chat(tok, [m.template_dict() for m in body.messages], True, plan.tools)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    content, [call], finish = parse(plan, out.text, out.finish_reason)
    assert content is None and finish == "stop" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS["get_weather"])
    assert args["city"] == "Paris"
