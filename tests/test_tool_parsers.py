"""Tool calling without a server: the "required" schema, the Hermes parser on whole texts
and on any split of a stream, templates that do and do not render tools, and the SSE
chunks of an "auto" answer (tests/test_serve_tools.py drives the same code over HTTP)."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest
from _tools_data import ASK, NAMED, SCHEMAS, TOOLS
from pagedserve.cluster.front.openai.schemas import ChatCompletionRequest
from pagedserve.cluster.text.tokenizer_pool import render_chat
from pagedserve.cluster.front.openai.tool_choice import ToolPlan, tool_plan
from pagedserve.cluster.text.chat_template import adapt_messages, renders_tools
from pagedserve.cluster.front.openai.tool_parsers import ToolStream, parse, parse_hermes


def _plan(**body):
    return tool_plan(ChatCompletionRequest(messages=ASK, **body), template_has_tools=False)


def test_required_schema_is_an_array_of_the_tools():
    plan = _plan(tools=TOOLS, tool_choice="required")
    good = [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}},
            {"name": "set_alarm", "parameters": {"on": True}}]
    jsonschema.validate(good, plan.schema)
    for bad in ([], [{"name": "set_alarm", "parameters": {"city": "Rome", "unit": "C"}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plan.schema)
    assert _plan(tools=TOOLS, tool_choice=NAMED).schema == SCHEMAS["get_weather"]
    assert _plan(tools=TOOLS, tool_choice="none") is None
    with pytest.raises(ValueError, match="does not render tools"):
        _plan(tools=TOOLS)


def _feed(stream: ToolStream, text: str, seed: int):
    rnd, i, content, deltas = random.Random(seed), 0, "", []
    while i < len(text):
        k = rnd.randint(1, 6)
        c, d = stream.feed(text[i:i + k])
        content, deltas, i = content + (c or ""), deltas + d, i + k
    c, d, finish = stream.finish("stop")
    return content + (c or ""), deltas + d, finish


def test_hermes_parser_whole_and_streamed():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "C"}}\n</tool_call>\n<tool_call>{"name": "set_alarm", "arguments": {"on": false}}'
            '</tool_call> Done <tool')
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n Done <tool"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo", "unit": "C"}), ("set_alarm", {"on": False})]
    plan = ToolPlan("auto", [])
    assert parse(plan, text, "stop")[2] == "tool_calls"
    assert parse(plan, "no calls here", "stop") == ("no calls here", None, "stop")
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes('a<tool_call>{"name": "f", "arguments": {}}')[1][0].function.name == "f"
    for seed in range(20):  # any split of the text into deltas streams the same
        content, deltas, finish = _feed(ToolStream(plan), text, seed)
        assert content == "Let me check.\n Done <tool" and finish == "tool_calls"
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
            [(0, "get_weather", {"city": "Oslo", "unit": "C"}), (1, "set_alarm", {"on": False})]


def test_required_stream_scanner_any_split():
    text = (' [ {"parameters": {"city": "Pa\\"ris}", "n": [1, {"x": null}]}, "name": "get_\\u0077eather"},'
            '{"name":"set_alarm","parameters":true} ]')
    want = [("get_weather", {"city": 'Pa"ris}', "n": [1, {"x": None}]}), ("set_alarm", True)]
    plan = ToolPlan("required", [])
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in parse(plan, text, "stop")[1]] == want
    for seed in range(30):
        _, deltas, finish = _feed(ToolStream(plan), text, seed)
        calls = {}
        for d in deltas:
            name, args = calls.get(d.index, (None, ""))
            calls[d.index] = (d.function.name if d.id else name, args + (d.function.arguments or ""))
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls.values()] == want
    assert parse(plan, '[{"name": "get_weather", "param', "length") == \
        ('[{"name": "get_weather", "param', None, "length")  # cut off: content, not a 500


class _Tok:
    """Just what render_chat needs from a tokenizer with a tools-aware template."""

    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        from jinja2 import Template

        return Template(self.chat_template).render(messages=messages, tools=tools,
                                                   add_generation_prompt=add_generation_prompt)


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments.city }}"
    "</call>{% endfor %}{% endfor %}")


def test_templates_get_tools_and_calls_they_render():
    convo = [m.template_dict() for m in ChatCompletionRequest(messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]).messages]
    plain = copy.deepcopy(convo)
    aware = _Tok(HERMES_TEMPLATE)
    assert renders_tools(aware) and not renders_tools(_Tok("{{ messages }}"))
    assert render_chat(aware, convo, tools=TOOLS) == (
        "<tools>get_weather;set_alarm;</tools>[user]What is the weather in Paris?"
        "[assistant]<call>get_weather Rome</call>[tool]20 C")
    assert convo == plain  # the caller's messages are not changed
    # A template without tool_calls gets the call written into the content instead.
    [_, asst, tool] = adapt_messages(convo, _Tok("{{ m.content }}"))
    assert asst == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                    '"arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'}
    assert tool["content"] == "20 C" and tool["tool_call_id"] == "call_1"


# ------------------------------------------------------------------ the real model
def test_auto_sse_chunks_and_whole_response():
    """openai_format with an "auto" plan, as the ingress drives it for a template that
    renders tools (no served test model has one): the SSE chunks carry content, then
    the call; the whole response has both; finish_reason becomes "tool_calls"."""
    from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
    from pagedserve.cluster.front.openai import openai_format as fmt

    pieces = ["Checking", ". <tool", '_call>{"name": "set_alarm", ', '"arguments": {"on": true}}',
              "</tool_call>"]
    plan, state, text = ToolPlan("auto", TOOLS), None, ""
    state = fmt.StreamState("chatcmpl-x", 0, "m", chat=True, return_token_ids=False, tools=plan)
    chunks = []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        c = CompletionOutput(index=0, text=text, token_ids=[1] * (i + 1), delta_text=piece,
                             delta_token_ids=[1], finish_reason="stop" if last else None)
        out = RequestOutput("chatcmpl-x", None, [1], [c], finished=last)
        chunks += [json.loads(line[len("data: "):]) for line in state.chunks(out, {})]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    [call] = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "set_alarm", "arguments": '{"on": true}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(d for d in deltas)  # no empty deltas while a tag was held back
    resp = fmt.chat_response("chatcmpl-x", 0, "m", out, {}, False, tools=plan).model_dump(exclude_none=True)
    msg = resp["choices"][0]["message"]
    assert msg["content"] == "Checking. " and msg["tool_calls"][0]["function"]["name"] == "set_alarm"
    assert resp["choices"][0]["finish_reason"] == "tool_calls"
