"""Model output -> OpenAI tool calls, whole (``parse``) and as stream deltas (``ToolStream``).

    named     the text IS the arguments (constrained to the function's schema):
              stream: delta 1 = {index 0, id, type, name, arguments: text so far}, then
              {index 0, arguments: fragment} per step; finish_reason as generated ("stop")
    required  the text is [{"name": ..., "parameters": {...}}, ...] (constrained):
              stream: a JSON scanner finds each element's "name" and the raw text of its
              "parameters" value, which streams as that call's arguments fragments
              (header first, once the name is known); finish_reason "tool_calls"
    auto      Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks are
              calls, the text around them is content. stream: text outside blocks goes
              out as content at once, except a tail that may be the start of
              "<tool_call>" (held back a step); a block goes out as one call delta, whole,
              when its closing tag arrives; finish_reason "tool_calls" if any call

A call's streamed argument fragments concatenate to JSON that parses to the same object
as the non-streamed arguments (those are re-serialized; the stream is the raw text).
Output that does not parse (cut off by max_tokens) is answered as content, with the
engine's finish_reason ("length"), never as a 500.
"""

from __future__ import annotations

import json

from pagedserve.cluster.front.openai.schemas import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                                ToolCall, tool_call_id)
from pagedserve.cluster.front.openai.tool_choice import ToolPlan

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _call(name: str, arguments) -> ToolCall:
    args = arguments if isinstance(arguments, str) else _dumps(arguments)
    return ToolCall(function=FunctionCall(name=name, arguments=args))


def parse_required(text: str) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        calls.append(_call(it["name"], it.get("parameters", {})))
    return calls


def _hermes_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): the stream's reading of the whole text at once, so a streamed
    and a non-streamed answer say the same. A block that is not a JSON {"name",
    "arguments"} object stays in the content (the model's text, not a call we trust)."""
    stream = ToolStream(ToolPlan("auto", []))
    content, deltas = stream.feed(text)
    tail, more, _ = stream.finish(None)
    content = (content or "") + (tail or "")
    calls = [ToolCall(id=d.id, function=FunctionCall(name=d.function.name, arguments=d.function.arguments))
             for d in deltas + more]
    return content if content.strip() else None, calls


def parse(plan: ToolPlan, text: str, finish_reason: str | None
          ) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """(content, tool_calls, finish_reason) of one finished choice."""
    if plan.mode == "named":
        return None, [_call(plan.function_name, text)], finish_reason
    if plan.mode == "required":
        calls = parse_required(text)
        if calls is None:
            return text, None, finish_reason
        return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    content, calls = parse_hermes(text)
    if not calls:
        return content, None, finish_reason
    return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One choice's stream: ``feed(delta_text)`` -> (content delta, tool call deltas);
    ``finish(finish_reason)`` flushes and gives the finish_reason to send."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0  # calls whose header went out
        self._text = ""  # required: everything seen (whether it parses decides finish_reason)
        self._scan = _ArrayScanner() if plan.mode == "required" else None
        self._held = ""  # auto: text that may be the start of a <tool_call> tag, or a block

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        if self.plan.mode == "named":
            return None, self._named(delta)
        if self._scan is not None:
            self._text += delta
            return None, self._scan.feed(delta)
        return self._auto(delta)

    def finish(self, finish_reason: str | None) -> tuple[str | None, list[DeltaToolCall], str | None]:
        if self.plan.mode == "named":
            return None, self._named("", final=True), finish_reason
        if self._scan is not None:
            ok = parse_required(self._text) is not None
            return None, [], "tool_calls" if ok and finish_reason == "stop" else finish_reason
        held, self._held = self._held, ""
        content, deltas = None, []
        if held.startswith(HERMES_START):  # a block never closed: a call if it parses
            call = _hermes_block(held[len(HERMES_START):])
            if call is not None:
                deltas.append(self._header(call))
            else:
                content = held
        elif held:
            content = held
        called = self.num_calls > 0
        return content, deltas, "tool_calls" if called and finish_reason == "stop" else finish_reason

    # ---------------------------------------------------------------- modes
    def _named(self, delta: str, final: bool = False) -> list[DeltaToolCall]:
        if self.num_calls == 0 and (delta or final):
            self.num_calls = 1
            return [DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                  function=DeltaFunctionCall(name=self.plan.function_name,
                                                             arguments=delta))]
        if delta:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        return []

    def _header(self, call: ToolCall) -> DeltaToolCall:
        self.num_calls += 1
        return DeltaToolCall(index=self.num_calls - 1, id=call.id, type="function",
                             function=DeltaFunctionCall(name=call.function.name,
                                                        arguments=call.function.arguments))

    def _auto(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        buf, content, deltas = self._held + delta, [], []
        while buf:
            if buf.startswith(HERMES_START):
                end = buf.find(HERMES_END)
                if end < 0:
                    break  # inside a block: wait for its end
                block, buf = buf[len(HERMES_START):end], buf[end + len(HERMES_END):]
                call = _hermes_block(block)
                if call is not None:
                    deltas.append(self._header(call))
                else:  # not a call after all: the model's text
                    content.append(HERMES_START + block + HERMES_END)
                continue
            start = buf.find(HERMES_START)
            if start < 0:
                keep = _partial_tag_len(buf)
                content.append(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            content.append(buf[:start])
            buf = buf[start:]
        self._held = buf
        text = "".join(content)
        return text or None, deltas


def _partial_tag_len(s: str) -> int:
    """Length of the longest tail of ``s`` that is a proper prefix of "<tool_call>"."""
    for k in range(min(len(s), len(HERMES_START) - 1), 0, -1):
        if HERMES_START.startswith(s[-k:]):
            return k
    return 0


class _ArrayScanner:
    """Streams the calls of a "required" array as its characters arrive.

    It tracks JSON nesting (strings and escapes included) just enough to know, inside
    each element object (depth 2), which key's value a character belongs to:

        [ { "name" : "get_weather" , "parameters" : { "city" : "Paris" } } , { ...
        1 2   key    name value        key            arguments (raw)   2 1  (depth)

    "name" is decoded when its string closes; the "parameters" value's raw characters
    are the call's arguments. Arguments that come before the name wait for it: the
    header carries id and name, and OpenAI clients expect it first."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = self.esc = False
        self.state = "key"  # inside an element: key | colon | value | in_value | after
        self.kind = ""  # the current value: container | string | scalar
        self.key = ""
        self.key_chars: list[str] | None = None  # while reading a key string
        self.name_chars: list[str] = []
        self.num_calls = 0  # elements closed so far (the index of the open one)
        self._out: list[DeltaToolCall] = []
        self._new_call()

    def _new_call(self) -> None:
        self.name: str | None = None
        self.args = ""  # parameters text not yet sent
        self.header_sent = False

    def feed(self, delta: str) -> list[DeltaToolCall]:
        for ch in delta:
            self._char(ch)
        self._flush()
        out, self._out = self._out, []
        return out

    def _flush(self) -> None:
        if self.name is None or (self.header_sent and not self.args):
            return
        args, self.args = self.args, ""
        if self.header_sent:
            self._out.append(DeltaToolCall(index=self.num_calls,
                                           function=DeltaFunctionCall(arguments=args)))
            return
        self.header_sent = True
        self._out.append(DeltaToolCall(index=self.num_calls, id=tool_call_id(), type="function",
                                       function=DeltaFunctionCall(name=self.name, arguments=args)))

    def _end_value(self) -> None:
        if self.key == "name":
            try:
                name = json.loads("".join(self.name_chars))
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        self.state = "after"

    def _take(self, ch: str) -> None:
        """ch belongs to the value being read (at any depth)."""
        if self.key == "parameters":
            self.args += ch
        elif self.key == "name":
            self.name_chars.append(ch)

    def _char(self, ch: str) -> None:
        top = self.depth == 2  # directly inside an element object
        if self.in_str:
            if self.key_chars is not None:  # a key: collected raw, decoded at its quote
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    self.key = json.loads('"' + "".join(self.key_chars) + '"')
                    self.key_chars, self.state = None, "colon"
                    return
                self.key_chars.append(ch)
                return
            self._take(ch)
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if top and self.kind == "string":
                    self._end_value()
            return
        if top and self.state == "in_value" and self.kind == "scalar" and (ch in ",}" or ch.isspace()):
            self._end_value()  # the delimiter is not part of the scalar
        if ch.isspace():
            if self.state == "in_value":
                self._take(ch)
            return
        if top and self.state == "key" and ch == '"':
            self.in_str, self.key_chars = True, []
            return
        if top and self.state == "colon" and ch == ":":
            self.state = "value"
            return
        if top and self.state == "value":
            self.state, self.name_chars = "in_value", []
            self.kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
        if self.state == "in_value":
            self._take(ch)
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 2 and self.state == "in_value" and self.kind == "container":
                self._end_value()
            elif self.depth == 1 and ch == "}":  # an element closed: its call is complete
                self._flush()
                self.num_calls += 1
                self.state, self.key = "key", ""
                self._new_call()
        elif ch == "," and top and self.state == "after":
            self.state = "key"
