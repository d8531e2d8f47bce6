"""What the chat template sees of a conversation's tools (the prompt side of
``tools`` / ``tool_choice``; the constraint side is cluster/front/openai/tool_choice.py): does the
template render tools, and the earlier tool calls fitted to what it can render. And a
request's ``chat_template_kwargs`` (vLLM's), fitted to the variables the template reads."""

from __future__ import annotations

import copy
import functools
import json
import re

# A template that mentions these renders them (what HF templates with tool support do;
# a template that never names them cannot show them to the model).
_TOOLS_RE = re.compile(r"\btools\b")
_TOOL_CALLS_RE = re.compile(r"\btool_calls\b")


def template_source(tokenizer) -> str:
    src = getattr(tokenizer, "chat_template", None)
    if isinstance(src, dict):  # named templates: the default one is what is applied
        src = src.get("default") or next(iter(src.values()), None)
    return src if isinstance(src, str) else ""


def renders_tools(tokenizer) -> bool:
    return bool(_TOOLS_RE.search(template_source(tokenizer)))


def hermes_call_text(call: dict) -> str:
    """An assistant's earlier call as the Hermes text a model would have written."""
    fn = call.get("function", {})
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                        ensure_ascii=False) + "\n</tool_call>"


def adapt_messages(messages: list[dict], tokenizer) -> list[dict]:
    """Fit the conversation's tool turns to what the template can render.

    A template that renders ``tool_calls`` gets them with ``arguments`` parsed into an
    object (HF templates write them with ``tojson``, as vLLM passes them). One that does
    not (ChatML templates that only print role + content) would drop the calls: they are
    written into the assistant's content as Hermes blocks instead, so the model still
    sees what it called before the "tool" message that answers it. Content is never None
    here: templates concatenate it."""
    knows_calls = bool(_TOOL_CALLS_RE.search(template_source(tokenizer)))
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls and knows_calls:
            m["tool_calls"] = [_with_parsed_arguments(c) for c in calls]
        elif calls:
            del m["tool_calls"]
            texts = [hermes_call_text(_with_parsed_arguments(c)) for c in calls]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + texts)
        out.append(m)
    return out


def _with_parsed_arguments(call: dict) -> dict:
    call = copy.deepcopy(call)
    fn = call.get("function", {})
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError):
        return call  # not JSON: the template gets the text as it came
    fn["arguments"] = args
    return call


# What render_chat passes the template from the request's own fields: those win over a
# chat_template_kwargs of the same name (as vLLM's request fields do).
SET_BY_THE_REQUEST = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


@functools.lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    """The names a Jinja template reads from its context (its undeclared variables)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError:  # the template's own error comes when it is applied
        return frozenset()


def template_kwargs(tokenizer, kwargs: dict | None) -> dict:
    """The part of a request's ``chat_template_kwargs`` the template reads (as vLLM's
    resolve_chat_template_kwargs keeps it): the rest would reach the tokenizer's own
    apply_chat_template keywords (``tokenize``, ``return_dict``, ...), not the template."""
    if not kwargs:
        return {}
    names = _template_variables(template_source(tokenizer)) - SET_BY_THE_REQUEST
    return {k: v for k, v in kwargs.items() if k in names}
