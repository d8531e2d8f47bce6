"""Reasoning output (--reasoning-parser, vLLM's): a thinking model's <think> ... </think> goes to
the chat message's ``reasoning`` (and ``reasoning_content``), streamed as reasoning deltas, and
to the Responses API's reasoning item; structured outputs and tool calls apply to the answer
after it; ``chat_template_kwargs`` reach the template (Qwen3's enable_thinking) and
``include_reasoning: false`` drops the thinking.

The story, first as units: the parsers split a text the same way whole and in any deltas (a
</think> cut anywhere, even inside the tag), and read from the prompt's ids whether the output
starts inside the thinking (Qwen3's thinking switch, a prompt that closed it already); the
engine holds a grammar back until the end-of-thinking token, so the thinking is free text and
the answer after it is what the grammar allows. Then over HTTP with the openai SDK, on a tiny
model scripted to think (tests/_reasoning_helpers.py: a random model never writes <think>):
the message, the stream (the tag spelled in seven tokens still splits the text), the thinking
switch, a grammar and tool calls after the thinking, and the Responses API's reasoning item,
whole, streamed and sent back.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from _reasoning_helpers import ANSWER, REASONING, SPLIT_ANSWER, SPLIT_PREFIX, make_thinking_model
from pagedserve.cluster.text.reasoning import REASONING_PARSERS, ReasoningParser

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return make_thinking_model(tmp_path_factory.mktemp("thinking") / "think-model")


@pytest.fixture(scope="module")
def tokenizer(think_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_model)


# ------------------------------------------------------------------ units: the parsers
@pytest.mark.parametrize("text, in_reasoning, reasoning, content", [
    ("<think>Let me see.</think>\n\nYes.", True, "Let me see.", "\n\nYes."),
    ("Let me see.</think>Yes.", True, "Let me see.", "Yes."),  # the template wrote <think>
    ("Let me see", True, "Let me see", None),  # cut off while thinking: all thinking
    ("Let me <th", True, "Let me <th", None),  # ... even inside what looked like a tag
    ("</think>Yes.", True, None, "Yes."),
    ("Hmm.</think>", True, "Hmm.", None),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # after the thinking, text is text
    ("a<think>b</think>c", True, "ab", "c"),  # a <think> inside the thinking is dropped
    ("Yes.</think>", False, None, "Yes.</think>"),  # the prompt closed the thinking
])
def test_a_text_splits_the_same_whole_and_in_any_deltas(text, in_reasoning, reasoning, content):
    parser = ReasoningParser("deepseek_r1", "<think>", "</think>", 1, 2)
    assert parser.split(text, in_reasoning) == (reasoning, content)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for deltas in cuts:
        stream, got = parser.stream(in_reasoning), ([], [])
        for d in deltas:
            r, c = stream.feed(d)
            got[0].append(r or "")
            got[1].append(c or "")
            assert r is None or not r.endswith(("<", "</", "</th")), "a tag's start is held back"
        r, c = stream.finish()
        got[0].append(r or "")
        assert ("".join(got[0]) or None, "".join(got[1]) or None) == (reasoning, content), deltas


def test_where_the_output_starts_is_read_from_the_prompt(tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_start|>")}
    text = [5, 6, 7]  # any ordinary tokens
    qwen3 = ReasoningParser.for_tokenizer("qwen3", tokenizer)
    r1 = ReasoningParser.for_tokenizer("deepseek_r1", tokenizer)
    closed_before = [ids["<think>"], *text, ids["</think>"], *text, ids["<|im_start|>"], *text]
    for parser in (qwen3, r1):
        assert parser.starts_in_reasoning(text)  # the template may have written <think>: vLLM's default
        assert parser.starts_in_reasoning(text + [ids["<think>"], *text])  # the prompt opened it
        assert not parser.starts_in_reasoning(text + [ids["<think>"], ids["</think>"], *text])  # ... and closed it
    # qwen3 reads the last turn only; deepseek_r1 the whole prompt, as vLLM's parsers do
    assert qwen3.starts_in_reasoning(closed_before) and not r1.starts_in_reasoning(closed_before)
    # Qwen3's switch; deepseek_r1 has none
    assert not qwen3.starts_in_reasoning(text, {"enable_thinking": False})
    assert qwen3.starts_in_reasoning(text, {"enable_thinking": True})
    assert r1.starts_in_reasoning(text, {"enable_thinking": False})
    assert qwen3.reasoning_tokens([ids["<think>"], 5, 6, ids["</think>"], 7], True) == 2
    assert ReasoningParser.from_description(qwen3.describe()) == qwen3


def test_the_flag_the_config_file_and_the_builder_name_a_parser_it_knows(serve_model):
    """`pagedserve serve --reasoning-parser`, serve_config.yaml's ``reasoning_parser`` (as
    every engine field) and EngineConfig for build_app: the same field; an unknown name and
    a tokenizer without the tags are refused, naming what is wrong."""
    from transformers import AutoTokenizer

    from pagedserve.cluster.app import split_args
    from pagedserve.cluster.cli.args import engine_config_from_args
    from pagedserve.cluster.cli.main import build_parser
    from pagedserve.config import EngineConfig

    args = build_parser().parse_args(["serve", "--model", "pagedserve-demo", "--reasoning-parser", "deepseek_r1"])
    assert engine_config_from_args(args).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])
    assert split_args({"model": "pagedserve-demo", "reasoning-parser": "qwen3"})[0].reasoning_parser == "qwen3"
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        EngineConfig(reasoning_parser="granite")
    with pytest.raises(ValueError, match="the tokenizer has no <think> or </think> token"):
        ReasoningParser.for_tokenizer("qwen3", AutoTokenizer.from_pretrained(serve_model))


def test_chat_template_kwargs_reach_the_template(tokenizer):
    from pagedserve.cluster.text.tokenizer_pool import render_chat

    on = render_chat(tokenizer, ASK, True)
    off = render_chat(tokenizer, ASK, True, chat_template_kwargs={"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    # what the template does not read, and the request's own fields, are not its to set
    assert render_chat(tokenizer, ASK, True, chat_template_kwargs={"unknown": 1, "add_generation_prompt": False,
                                                                     "messages": []}) == on


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(tokenizer):
    """vLLM's build_chat_params: the request's reasoning_effort is a template variable, and
    turns enable_thinking off ("none") or on unless chat_template_kwargs name it."""
    from pagedserve.cluster.front.openai.schemas import ChatCompletionRequest
    from pagedserve.cluster.text.tokenizer_pool import render_chat

    def rendered(**body):
        req = ChatCompletionRequest.model_validate({"messages": ASK, **body})
        return render_chat(tokenizer, ASK, True, chat_template_kwargs=req.template_kwargs())

    plain = rendered()
    assert rendered(reasoning_effort="low") == "<|im_start|>system\nReasoning: low<|im_end|>\n" + plain
    assert rendered(reasoning_effort="none").endswith("<think>\n\n</think>\n\n")
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith(
        "assistant\n")
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate({"messages": ASK, "reasoning_effort": "extreme"})


def test_anthropic_thinking_becomes_the_chat_requests_template_switch():
    """thinking disabled -> enable_thinking false, enabled / adaptive -> true (unless the
    body's vLLM chat_template_kwargs say); a thinking block sent back is that assistant
    turn's reasoning, a redacted one is dropped; Anthropic's shapes are checked."""
    from pagedserve.cluster.front.anthropic.schemas import MessagesRequest

    def chat(**body):
        return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": ASK, **body}).to_chat()

    assert chat().template_kwargs() is None
    assert chat(thinking={"type": "disabled"}).template_kwargs() == {"enable_thinking": False}
    assert chat(thinking={"type": "enabled", "budget_tokens": 1024}).template_kwargs() == {"enable_thinking": True}
    assert chat(thinking={"type": "adaptive"}, chat_template_kwargs={"enable_thinking": False}).template_kwargs() \
        == {"enable_thinking": False}
    effort = chat(output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert effort.template_kwargs() == {"reasoning_effort": "low", "enable_thinking": True}  # vLLM's mapping
    assert effort.response_format.json_schema.json_schema == {"type": "object"}
    turns = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Greet back.", "signature": "abc"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "and?"}]
    assert [m.template_dict() for m in chat(messages=turns).messages][1] == \
        {"role": "assistant", "content": "Hi!", "reasoning": "Greet back."}
    for bad, says in (({"type": "enabled"}, "budget_tokens"), ({"type": "disabled", "budget_tokens": 2000},
                                                                "budget_tokens"),
                      ({"type": "between_tools"}, "thinking.type")):
        with pytest.raises(ValueError, match=says):
            chat(thinking=bad)
    with pytest.raises(ValueError, match="has type 'thinking': user messages take text and tool_result"):
        chat(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}])


# ------------------------------------------------------------------ units: the engine's grammar
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_grammar_starts_where_the_thinking_ends(think_model, parser):
    """The same constrained request with and without ``reasoning`` (the front sets it for a
    chat): the grammar waits for </think>, so the scripted thinking comes out whole and the
    answer after it is a choice; from the first token, the grammar leaves no room to think."""
    from pagedserve.cluster.engine.llm_engine import LLMEngine
    from pagedserve.cluster.executors import executor_class_for
    from pagedserve.cluster.text.tokenizer_pool import render_chat
    from pagedserve.cluster.wire.request import EngineRequest
    from pagedserve.config import EngineConfig
    from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

    cfg = EngineConfig(model=think_model, dtype="float32", num_gpu_blocks_override=32, max_model_len=256,
                       reasoning_parser=parser, device="cpu")
    engine = LLMEngine(cfg, executor_class_for(cfg))
    try:
        prompt = engine.tokenizer.encode(render_chat(engine.tokenizer, ASK, True), add_special_tokens=False)
        for rid, reasoning in (("thinks", True), ("plain", False)):
            params = SamplingParams(max_tokens=40, temperature=0,
                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
            engine.add_engine_request(engine.make_request(EngineRequest(rid, list(prompt), params,
                                                                        reasoning=reasoning)))
        texts = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts[out.request_id] = (out.outputs[0].text, out.outputs[0].finish_reason)
    finally:
        engine.shutdown()
    thought, answer = texts["thinks"][0].split("</think>")
    assert thought == f"<think>{REASONING}" and answer in ("yes", "no") and texts["thinks"][1] == "stop"
    assert texts["plain"][0] in ("yes", "no")


# ------------------------------------------------------------------ over HTTP
# A Serve app of its own and ~a minute of requests: under -m scenarios (CI runs it), out of
# the default run's 12 minutes; the units above keep the parsers and the engine's grammar there.
HTTP = pytest.mark.scenarios


@pytest.fixture(scope="module")
def base(serve_url, think_model):
    from ray import serve

    from conftest import delete_app
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=think_model, reasoning_parser="qwen3", max_model_len=512, num_gpu_blocks_override=64,
                       max_num_seqs=4, max_waiting_requests=8, dtype="float32", seed=0)
    serve.run(build_app(cfg, name_prefix="reasoning-"), name="reasoning-test", route_prefix="/reasoning")
    yield f"{serve_url}/reasoning"
    delete_app("reasoning-test")


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=kw.pop("messages", ASK), max_tokens=48,
                                          temperature=0, **kw)


def _streamed(chunks) -> tuple[str, str, list[str]]:
    """(reasoning, content, the deltas that carried either) of a chat stream."""
    reasoning = content = ""
    deltas = []
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            r = (d.model_extra or {}).get("reasoning")
            assert r == (d.model_extra or {}).get("reasoning_content")
            reasoning, content = reasoning + (r or ""), content + (d.content or "")
            deltas += [x for x in (r, d.content) if x]
    return reasoning, content, deltas


@HTTP
def test_the_thinking_is_the_messages_reasoning(client, model, tokenizer):
    r = _chat(client, model)
    msg = r.choices[0].message
    assert (msg.reasoning, msg.content) == (REASONING, ANSWER) and msg.reasoning_content == REASONING
    assert r.choices[0].finish_reason == "stop"
    thinking_tokens = len(tokenizer.encode(REASONING, add_special_tokens=False))
    assert r.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    # streamed: reasoning deltas, then content deltas, the same texts
    reasoning, content, _ = _streamed(_chat(client, model, stream=True))
    assert (reasoning, content) == (REASONING, ANSWER)


@HTTP
def test_a_think_tag_spelled_in_pieces_still_ends_the_thinking(client, model):
    """The scripted model continues "Wait" with </think> in seven tokens (one step each),
    then "Bye": the parser holds each piece back until the tag is whole."""
    kw = dict(messages=ASK + [{"role": "assistant", "content": SPLIT_PREFIX}],
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    msg = _chat(client, model, **kw).choices[0].message
    assert (msg.content, msg.reasoning) == (SPLIT_ANSWER, None)
    chunks = list(_chat(client, model, stream=True, **kw))
    reasoning, content, deltas = _streamed(chunks)
    # no delta carries a piece of the tag; how many deltas "Bye" arrives in is the stream's
    # flow control (a reader slower than the steps gets merged deltas), not the parser's
    assert (reasoning, content) == ("", SPLIT_ANSWER) and "<" not in "".join(deltas)


@HTTP
def test_enable_thinking_false_reaches_the_template(base, client, model):
    kwargs = {"enable_thinking": False}
    tok = httpx.post(f"{base}/tokenize", json={"messages": ASK, "chat_template_kwargs": kwargs}).json()
    text = httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msg = _chat(client, model, extra_body={"chat_template_kwargs": kwargs}).choices[0].message
    assert (msg.reasoning, msg.content) == (None, ANSWER)  # the model answered without thinking
    assert _streamed(_chat(client, model, stream=True, extra_body={"chat_template_kwargs": kwargs}))[:2] == \
        ("", ANSWER)
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and "unexpected chat template kwargs" in r.json()["error"]["message"]


@HTTP
def test_include_reasoning_false_drops_the_thinking(client, model):
    r = _chat(client, model, extra_body={"include_reasoning": False})
    msg = r.choices[0].message
    assert (msg.reasoning, msg.content) == (None, ANSWER)
    assert _streamed(_chat(client, model, stream=True, extra_body={"include_reasoning": False}))[:2] == ("", ANSWER)


@HTTP
def test_structured_outputs_start_after_the_thinking(client, model):
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}},
                  {"response_format": {"type": "json_schema", "json_schema": {
                      "name": "a", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                              "required": ["ok"]}}}}):
        for stream in (False, True):
            kw = (dict(extra_body=extra) if "structured_outputs" in extra
                  else dict(response_format=extra["response_format"]))
            if stream:
                reasoning, content, _ = _streamed(_chat(client, model, stream=True, **kw))
            else:
                msg = _chat(client, model, **kw).choices[0].message
                reasoning, content = msg.reasoning, msg.content
            assert reasoning == REASONING
            if "structured_outputs" in extra:
                assert content in ("yes", "no")
            else:
                assert isinstance(json.loads(content)["ok"], bool)


ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}
HERMES = '<tool_call>{"name": "set_alarm", "arguments": {"on": true}}</tool_call>'


@HTTP
def test_tool_calls_are_read_after_the_thinking(client, model):
    # a named tool: its grammar starts after the thinking
    r = _chat(client, model, tools=[ALARM], tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    msg = r.choices[0].message
    assert msg.reasoning == REASONING and msg.content is None
    [call] = msg.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ALARM["function"]["parameters"])
    # "auto": the Hermes block after the thinking is the call (forced: the scripted model answers text)
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in HERMES)
    kw = dict(tools=[ALARM], extra_body={"structured_outputs": {"regex": regex}, "max_tokens": 128})
    choice = _chat(client, model, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning == REASONING
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("set_alarm", {"on": True})]
    chunks = list(_chat(client, model, stream=True, **kw))
    reasoning, content, _ = _streamed(chunks)
    calls = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or ()]
    assert reasoning == REASONING and content == "" and [c.function.name for c in calls] == ["set_alarm"]


@HTTP
def test_the_responses_api_has_a_reasoning_item(client, model):
    r = client.responses.create(model=model, input="hi", max_output_tokens=48, temperature=0)
    thought, msg = r.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert [c.text for c in thought.content] == [REASONING] and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    # streamed: the reasoning item's events first, read by the SDK's own accumulator
    with client.responses.stream(model=model, input="hi", max_output_tokens=48, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert "response.reasoning_text.delta" in kinds[:first_text] and "response.reasoning_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == REASONING
    # sent back, as the next turn's input or by previous_response_id: the conversation goes on
    again = client.responses.create(model=model, input=[{"role": "user", "content": "hi"}, *r.output,
                                                        {"role": "user", "content": "and?"}],
                                    max_output_tokens=48, temperature=0)
    follow = client.responses.create(model=model, previous_response_id=r.id, input="and?", max_output_tokens=48,
                                     temperature=0)
    assert again.usage.input_tokens == follow.usage.input_tokens and again.output_text == ANSWER


@HTTP
def test_reasoning_effort_reaches_the_template_over_http(base, client, model):
    """The openai SDK's reasoning_effort, on chat and (as reasoning.effort) on the Responses
    API: the template writes it into the prompt; "none" switches the thinking off."""
    r = _chat(client, model, reasoning_effort="low", extra_body={"return_token_ids": True})
    prompt = httpx.post(f"{base}/detokenize", json={"tokens": r.prompt_token_ids}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nReasoning: low<|im_end|>\n")
    assert (r.choices[0].message.reasoning, r.choices[0].message.content) == (REASONING, ANSWER)
    msg = _chat(client, model, reasoning_effort="none").choices[0].message
    assert (msg.reasoning, msg.content) == (None, ANSWER)
    r = client.responses.create(model=model, input="hi", max_output_tokens=48, temperature=0,
                                reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == ANSWER and r.reasoning.effort == "none"
    r = client.responses.create(model=model, input="hi", max_output_tokens=48, temperature=0,
                                reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.usage.input_tokens > client.responses.create(model=model, input="hi", max_output_tokens=48,
                                                          temperature=0).usage.input_tokens  # "Reasoning: high"


@pytest.fixture(scope="module")
def claude(base):
    import anthropic

    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


THINK = {"type": "enabled", "budget_tokens": 1024}


@HTTP
def test_anthropic_thinking_block_comes_before_the_text(claude, model):
    msg = claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking=THINK,
                                 extra_body={"temperature": 0.0})
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "end_turn"
    thought, text = msg.content
    assert (thought.thinking, text.text) == (REASONING, ANSWER) and thought.signature
    # streamed, read by the SDK's own accumulator: thinking_delta ..., signature_delta, then the text
    with claude.messages.stream(model=model, max_tokens=48, messages=ASK, thinking=THINK,
                                extra_body={"temperature": 0.0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", REASONING), ("text", ANSWER)] and final.content[0].signature
    raw = [e for e in claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking=THINK, stream=True,
                                             extra_body={"temperature": 0.0})]
    starts = [(e.index, e.content_block.type) for e in raw if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [(e.index, e.delta.type) for e in raw if e.type == "content_block_delta"]
    first_text = deltas.index((1, "text_delta"))
    assert deltas[first_text - 1] == (0, "signature_delta")
    assert {d for d in deltas[:first_text - 1]} == {(0, "thinking_delta")}
    assert "".join(e.delta.thinking for e in raw if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == REASONING
    assert [e.type for e in events if e.type == "thinking"]  # the SDK's own thinking events
    # output_config (vLLM's mapping): format constrains the text after the thinking; effort
    # reaches the template, which writes it into the prompt
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking=THINK,
                                    output_config={"format": {"type": "json_schema", "schema": schema}},
                                    extra_body={"temperature": 0.0})
    assert shaped.content[0].thinking == REASONING and isinstance(json.loads(shaped.content[1].text)["ok"], bool)
    low = claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking=THINK,
                                 output_config={"effort": "low"}, extra_body={"temperature": 0.0})
    assert low.usage.input_tokens + low.usage.cache_read_input_tokens > msg.usage.input_tokens + \
        msg.usage.cache_read_input_tokens and low.content[0].thinking == REASONING
    # display "omitted": the block stays, its text does not
    hidden = claude.messages.create(model=model, max_tokens=48, messages=ASK,
                                    thinking={**THINK, "display": "omitted"}, extra_body={"temperature": 0.0})
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content][0] == ("thinking", "")


@HTTP
def test_anthropic_thinking_disabled_and_sent_back(claude, model):
    """disabled: Qwen3's switch in the template, no thinking block; a thinking block sent back
    with the conversation is accepted (this template drops it from the prompt, as Qwen3's
    drops earlier turns' thinking)."""
    off = claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0.0})
    assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]
    count = lambda **kw: claude.messages.count_tokens(model=model, **kw).input_tokens  # noqa: E731
    assert count(messages=ASK, thinking={"type": "disabled"}) == count(messages=ASK) + 4  # <think>\n\n</think>\n\n
    msg = claude.messages.create(model=model, max_tokens=48, messages=ASK, thinking=THINK,
                                 extra_body={"temperature": 0.0})
    turns = ASK + [{"role": "assistant", "content": msg.content},  # sent back as the SDK gave it
                   {"role": "user", "content": "and?"}]
    plain = ASK + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "and?"}]
    again = claude.messages.create(model=model, max_tokens=48, messages=turns, thinking=THINK,
                                   extra_body={"temperature": 0.0})
    assert [b.type for b in again.content] == ["thinking", "text"]
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count(messages=plain, thinking=THINK)
