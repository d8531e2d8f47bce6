"""The chat path's answers as Anthropic's (pure functions, no Serve): a chat completion as a
Message, the chat's SSE chunks as Anthropic's stream events, an OpenAI error as
Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

    chat finish_reason (stop_reason)     Anthropic stop_reason (stop_sequence)
    -----------------------------------  -------------------------------------
    a tool call in the answer            tool_use
    "stop", a stop string matched        stop_sequence (that string)
    "stop" (end of sequence)             end_turn
    "length"                             max_tokens

    usage: input_tokens = the prompt's tokens the prefix cache did not hold,
           cache_read_input_tokens = those it held (together: count_tokens' answer)

With --reasoning-parser the chat message's reasoning is a first block {type: thinking,
thinking, signature} (vLLM's: the signature a random hex string, for clients that keep it;
nothing checks one sent back). thinking.display "omitted": the block's thinking is "".

The stream (the chat's chunks carry usage, so the first one knows the prompt's size):

    first chunk    event: message_start  {message: {id, model, content: [], usage}}
                   event: ping
    thinking       content_block_start {index, content_block: {type: thinking, thinking: "",
                   signature: ""}}, content_block_delta {type: thinking_delta, thinking} ...,
                   content_block_delta {type: signature_delta, signature} as the block closes
    content        content_block_start {index, content_block: {type: text, text: ""}}
                   content_block_delta {index, delta: {type: text_delta, text}} ...
    a tool call    content_block_start {index, content_block: {type: tool_use, id, name,
                   input: {}}}, then content_block_delta {type: input_json_delta,
                   partial_json} per arguments fragment; a new block closes the last
    [DONE]         content_block_stop, message_delta {delta: {stop_reason, stop_sequence},
                   usage}, message_stop
    an error       event: error (the headers are gone: in-band, as Anthropic sends it)
"""

from __future__ import annotations

import json
import uuid

# HTTP status -> Anthropic's error type (its API's list; 503 is its "overloaded").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(status: int, body: dict) -> dict:
    """An OpenAI error body of the chat path, in Anthropic's shape (the chat's names of
    Anthropic's fields put back)."""
    info = body.get("error") or {}
    message = str(info.get("message") or "error")
    param = info.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    for chat_name, name in ((".function.parameters", ".input_schema"), ("tool_choice 'required'", "tool_choice any"),
                            ("`stop`", "`stop_sequences`")):
        message = message.replace(chat_name, name)
    return error_body(status, message)


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id as Anthropic spells one (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, matched, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn" if finish_reason is not None else None), None


def usage(chat_usage: dict | None) -> dict:
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": chat_usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def signature() -> str:
    return uuid.uuid4().hex


def message(chat: dict, show_thinking: bool = True) -> dict:
    """The chat completion JSON (one choice) as Anthropic's Message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"] if show_thinking else "",
                        "signature": signature()})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    calls = msg.get("tool_calls") or []
    for call in calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {"id": chat["id"], "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageStream:
    """One streamed message: ``feed`` takes one chat SSE line (``data: ...``), gives the
    Anthropic events it makes."""

    def __init__(self, rid: str, model: str, show_thinking: bool = True) -> None:
        """``model``: the body's, until the chat's first chunk names the one answering;
        ``show_thinking`` False: thinking blocks without their text (display "omitted")."""
        self.rid, self.model = rid, model
        self.show_thinking = show_thinking
        self.started = self.ended = False
        self.num_blocks = 0
        self.open_block: str | None = None  # "thinking" | "text" | "tool_use": the block now open (index num_blocks - 1)
        self.called = False
        self.finish: tuple[str | None, object] = (None, None)  # the chat's finish_reason, stop_reason
        self.usage: dict | None = None

    def feed(self, line: str) -> list[str]:
        data = line.strip().removeprefix("data:").strip()
        if self.ended:
            return []
        if data == "[DONE]":
            return self._end()
        chunk = json.loads(data)
        if "error" in chunk:  # sse_stream's in-band failure
            self.ended = True
            info = chunk["error"]
            return [event("error", from_openai_error(int(info.get("code") or 500), chunk))]
        self.model = chunk.get("model", self.model)  # an adapter's name, as the chat answers it
        out = [] if self.started else self._start(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                if self.show_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id") is not None:  # a call's first delta
                    self.called = True
                    out += self._block("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                    "name": fn.get("name"), "input": {}}, new=True)
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out

    def _start(self, chat_usage: dict | None) -> list[str]:
        self.started = True
        start = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": usage(chat_usage)}
        return [event("message_start", {"type": "message_start", "message": start}), event("ping", {"type": "ping"})]

    def _block(self, kind: str, block: dict, new: bool = False) -> list[str]:
        """Open a block of ``kind`` unless one is open (``new``: always a new one)."""
        if self.open_block == kind and not new:
            return []
        out = self._close()
        self.open_block = kind
        self.num_blocks += 1
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.num_blocks - 1,
                                                 "content_block": block}))
        return out

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.num_blocks - 1,
                                             "delta": delta})

    def _close(self) -> list[str]:
        if self.open_block is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": signature()})] \
            if self.open_block == "thinking" else []
        self.open_block = None
        return out + [event("content_block_stop", {"type": "content_block_stop", "index": self.num_blocks - 1})]

    def _end(self) -> list[str]:
        self.ended = True
        out = ([] if self.started else self._start(self.usage)) + self._close()
        reason, sequence = stop_reason(*self.finish, self.called)
        out.append(event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": usage(self.usage)}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out
