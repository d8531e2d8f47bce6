"""The Responses API's request body and response object (OpenAI's shapes, as vLLM serves
them), and the translation of a body into the chat route's one request type.

    ResponsesRequest ──▶ input_messages(): the items as chat messages
          │                 "text"                         -> {role: user, content}
          │                 {type: message, role, content}  -> {role, content} (developer -> system;
          │                                                    input_text / output_text parts joined)
          │                 {type: function_call, ...}      -> assistant {tool_calls: [...]}
          │                                                    (consecutive calls: one message)
          │                 {type: function_call_output}    -> {role: tool, tool_call_id, content}
          │                 {type: reasoning, content: [reasoning_text]}
          │                                                 -> assistant {reasoning} (the message or
          │                                                    calls after it join that turn, as vLLM's)
          └──────────────▶ to_chat(history): ChatCompletionRequest
                            [system: instructions] + history + the items, tools, tool_choice,
                            text.format -> response_format, max_output_tokens -> max_tokens

A field this server does not implement is a 400 naming it (``NOT_IMPLEMENTED``) unless its
value asks for what the server does anyway (``background: false``, ``truncation:
"disabled"``, ...); a field no OpenAI or vLLM schema has is accepted and named back, as on
the other routes. Input items, tools and tool_choice are checked here (not by pydantic
unions, whose errors name the union's arms): a bad one is a ``FieldError`` naming its path,
``input[2].content[0].type``, and an item or tool type this server does not implement is
one too (built-in tools such as web_search or file_search, a reasoning item's
encrypted_content).
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

import pydantic
from pydantic import Field

from pagedserve.cluster.front.openai.schemas import (ChatCompletionRequest, Int, OpenAIBase, ReasoningEffort,
                                                     RequestBase, Text, _OpenBody)

# Responses fields this server does not implement -> the values that ask for what it does
# anyway (None is always one). Any other value is a 400 naming the field.
NOT_IMPLEMENTED: dict[str, tuple] = {
    # OpenAI's
    "access_programs": (), "background": (False,), "background_options": (), "context_management": (),
    "conversation": (), "image": (), "include": ([],), "max_tool_calls": (), "moderation": (), "prompt": (),
    "prompt_cache_options": (), "prompt_cache_retention": (),
    "service_tier": ("auto", "default"), "stream_options": ({}, {"include_obfuscation": False}),
    "top_logprobs": (0,), "truncation": ("disabled",),
    # vLLM's
    "enable_response_messages": (False,), "kv_transfer_params": (), "mm_processor_kwargs": (),
    "previous_input_messages": (), "request_id": (),
}
TEXT_PARTS = ("input_text", "output_text")
# vLLM's fields that reach the chat request as they are.
VLLM_SAMPLING = ("priority", "cache_salt", "seed", "stop", "top_k", "min_p", "repetition_penalty", "ignore_eos")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"  # OpenAI's shape


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # msg_..., fc_...


class FieldError(ValueError):
    """A 400 naming the field (``param``) it is about."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _validated(model: type[pydantic.BaseModel], data: Any, at: str):
    """``model`` from ``data``, or the FieldError of its first problem, named under ``at``."""
    if not isinstance(data, dict):
        raise FieldError(at, f"must be an object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = at + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        msg = "unknown field (not implemented by this server)" if err["type"] == "extra_forbidden" else err["msg"]
        raise FieldError(where, msg) from None


# ---------------------------------------------------------------- the request
class _TextPart(RequestBase):
    type: Literal["input_text", "output_text"]
    text: Text
    # An output_text part sent back (a previous response's output as input): labels, no tokens.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _MessageItem(RequestBase):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Any]
    # A previous response's output message sent back carries these: they change no token.
    id: Text | None = None
    status: Text | None = None
    phase: Text | None = None


class _FunctionCallItem(RequestBase):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text, as the server sent it
    id: Text | None = None
    status: Text | None = None


class _ReasoningText(RequestBase):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class _ReasoningItem(RequestBase):
    """A previous response's reasoning item sent back: its text reaches the chat template as
    the assistant turn's ``reasoning`` (which renders it if it knows it)."""

    type: Literal["reasoning"]
    summary: list[_ReasoningText] = Field(default_factory=list)
    content: list[_ReasoningText] | None = None
    encrypted_content: None = None  # only its absence: this server encrypts nothing
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        parts = self.content or self.summary  # vLLM reads the content, else the summary
        return parts[0].text if parts else ""


class _FunctionCallOutputItem(RequestBase):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[Any]
    id: Text | None = None
    status: Text | None = None


class _FunctionTool(RequestBase):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(RequestBase):
    """``text.format``: OpenAI's flat form of chat's response_format."""

    type: Literal["text", "json_schema", "json_object"]
    name: Text | None = None
    description: Text | None = None
    # ``schema`` would shadow BaseModel.schema: stored as json_schema, sent as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ReasoningConfig(RequestBase):
    """OpenAI's ``reasoning``: ``effort`` is the chat's ``reasoning_effort`` (to the chat
    template, as vLLM passes it); summaries are not made here (the reasoning item carries the
    whole thinking), so asking for one is a 400."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name

    def effort_only(self) -> ReasoningEffort | None:
        for name in ("summary", "generate_summary"):
            if getattr(self, name) is not None:
                raise FieldError(f"reasoning.{name}", "not implemented by this server (no reasoning summaries: "
                                                      "the reasoning item carries the whole thinking)")
        return self.effort


class TextConfig(RequestBase):
    format: TextFormat | None = None
    verbosity: None = None  # only its absence: this server has no verbosity knob


def _text_of(parts: str | list, at: str) -> str:
    """The text of a content (a string, or text parts); FieldError for another part type."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise FieldError(f"{at}[{j}].type", f"content part type {kind!r} is not implemented by this "
                                                f"server (text only: {', '.join(map(repr, TEXT_PARTS))})")
        out.append(_validated(_TextPart, part, f"{at}[{j}]").text)
    return "".join(out)


def items_to_messages(items: list, at: str = "input") -> list[dict]:
    """Responses input items (dicts) as chat messages, in order; FieldError naming a bad one."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        here = f"{at}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            m = _validated(_MessageItem, item, here)
            role = "system" if m.role == "developer" else m.role  # chat templates know "system"
            text = _text_of(m.content, f"{here}.content")
            prev = messages[-1] if messages else None
            if role == "assistant" and prev is not None and prev["role"] == "assistant" and prev["content"] is None \
                    and "reasoning" in prev and not prev.get("tool_calls"):
                prev["content"] = text  # the answer after its reasoning: one turn
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:  # vLLM refuses it too
                raise FieldError(f"{here}.encrypted_content", "encrypted reasoning is not implemented by this "
                                                              "server (it encrypts none)")
            r = _validated(_ReasoningItem, item, here)
            messages.append({"role": "assistant", "content": None, "reasoning": r.text()})
        elif kind == "function_call":
            c = _validated(_FunctionCallItem, item, here)
            call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # parallel calls: one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            o = _validated(_FunctionCallOutputItem, item, here)
            messages.append({"role": "tool", "tool_call_id": o.call_id, "content": _text_of(o.output, f"{here}.output")})
        elif isinstance(item, dict):
            raise FieldError(f"{here}.type", f"input item type {kind!r} is not implemented by this server "
                                             f"(it takes {', '.join(map(repr, ITEM_TYPES))})")
        else:
            raise FieldError(here, f"must be an object, got {type(item).__name__}")
    return messages


class ResponsesRequest(_OpenBody):
    # Refused by value, not by presence (schemas._OpenBody).
    _not_implemented: ClassVar[dict[str, tuple]] = NOT_IMPLEMENTED

    model: Text | None = None
    input: Text | list[Any]
    instructions: Text | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    # "none" | "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: Text | None = None
    stream: bool = False
    metadata: dict[Text, Text] | None = None  # echoed on the response object
    # Accepted and ignored, as on the other routes (schemas.ACCEPTED_AND_IGNORED).
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    # vLLM's extensions (sampling ones as the chat route takes them: passed on as they are).
    priority: Int = 0
    cache_salt: Text | None = None
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages (not its instructions: they are not carried
        to a response that continues this one, as OpenAI's are not)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise FieldError("input", "must not be empty")
        return items_to_messages(self.input)

    def chat_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError(f"tools[{i}].type", f"tool type {kind!r} is not implemented by this server "
                                                     "(only 'function' tools; no built-in tools such as "
                                                     "web_search or file_search)")
            t = _validated(_FunctionTool, tool, f"tools[{i}]")
            out.append({"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)})
        return out

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"} \
                and isinstance(choice["name"], str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise FieldError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...} '
                                        f"(other forms, such as allowed_tools or built-in tools, are not "
                                        f"implemented by this server), got {choice!r}")

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.json_schema is None:
            raise FieldError("text.format.schema", "a json_schema format needs its schema")
        schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def to_chat(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request that answers this one: ``conversation`` (the history, then this
        request's input messages) after the instructions. FieldError / ValueError: a 400."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise FieldError("max_output_tokens", f"must be at least 1, got {self.max_output_tokens}")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body = dict(model=self.model, messages=system + conversation, max_tokens=self.max_output_tokens,
                    temperature=self.temperature, top_p=self.top_p, tools=self.chat_tools(),
                    tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                    response_format=self.response_format(), stream=self.stream,
                    reasoning_effort=self.reasoning.effort_only() if self.reasoning is not None else None,
                    **{k: getattr(self, k) for k in VLLM_SAMPLING})
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except pydantic.ValidationError as e:  # checked above; what is left is the chat's own word
            err = e.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None

    def shell(self, rid: str, model: str, created: int) -> ResponseObject:
        """The response object before its output: what the request set, echoed."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text is not None else {}
        return ResponseObject(
            id=rid, created_at=created, status="in_progress", model=model, instructions=self.instructions,
            max_output_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            tools=self.tools or [], tool_choice=self.tool_choice or "auto",
            parallel_tool_calls=self.parallel_tool_calls is not False,
            previous_response_id=self.previous_response_id, store=self.store,
            text={"format": {"type": "text"}, **text}, metadata=self.metadata or {}, user=self.user,
            reasoning=self.reasoning.model_dump(exclude_none=True) if self.reasoning is not None else None)


# ---------------------------------------------------------------- the response
class OutputText(OpenAIBase):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(OpenAIBase):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBase):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(OpenAIBase):
    """A reasoning item: the model's thinking (--reasoning-parser), before its answer."""

    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(OpenAIBase):
    """A function_call output item (the model asks the client to call ``name``)."""

    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(OpenAIBase):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBase):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBase):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(OpenAIBase):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[ReasoningOutput | OutputMessage | FunctionCallOutput] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict | None = None
    incomplete_details: dict | None = None  # {"reason": "max_output_tokens"}
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list = Field(default_factory=list)  # as the request gave them
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict | None = None  # the request's, echoed
    metadata: dict = Field(default_factory=dict)
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False

    def to_json(self) -> dict:
        return self.model_dump(mode="json")
