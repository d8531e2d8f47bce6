"""Anthropic's Messages API request bodies (POST /v1/messages, /v1/messages/count_tokens),
as strict as the OpenAI schemas, and their translation into the front's chat request
(``to_chat``): the chat serving path then renders, tokenizes and serves it as one engine
request, tools and all (serving_messages.py).

    Anthropic                                    chat completions (openai/schemas.py)
    -------------------------------------------  ---------------------------------------------
    system: str | [text blocks]                  a first {"role": "system"} message
    user: text blocks                            {"role": "user", content}
          tool_result blocks                     {"role": "tool", tool_call_id, content}, in order
                                                 (is_error: the content starts "Error: ")
    assistant: text and tool_use blocks          {"role": "assistant", content, tool_calls}
    a last assistant message (a prefill)         continue_final_message: the answer continues it
    assistant: thinking blocks                   that message's reasoning (the template renders or
                                                 drops it); redacted_thinking: dropped
    thinking {type: disabled}                    chat_template_kwargs enable_thinking: false (Qwen3's
                                                 switch); enabled / adaptive: true. budget_tokens and
                                                 display "summarized" are accepted and not enforced
    chat_template_kwargs (vLLM's)                the same, under what thinking sets
    output_config {effort, format}               reasoning_effort (vLLM's), response_format json_schema
    max_tokens, stop_sequences                   max_tokens, stop
    temperature, top_p, top_k                    the same
    tools [{name, description, input_schema}]    tools [{type: function, function: {name,
                                                 description, parameters}}]
    tool_choice auto | any | tool | none         "auto" | "required" | named function | "none"
      disable_parallel_tool_use                  parallel_tool_calls: false
    stream                                       stream, usage on every chunk
    metadata {user_id}                           accepted, not used (bookkeeping, as OpenAI's user)
    cache_control {type: ephemeral}, any level   accepted: the prefix cache keeps every prompt's
                                                 blocks without being asked

Every other field Anthropic defines is a 400 naming it (NOT_IMPLEMENTED), as is a field it
does not define (Anthropic's own answer); an image or document block is a 400 saying where
it is. The answer's thinking (--reasoning-parser) comes back as a thinking block
(anthropic_format.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.cluster.front.openai.schemas import ChatCompletionRequest, Int, Text

# Fields of Anthropic's request schemas (body, blocks, tools) that this server does not
# implement: each is a 400 naming it ("not implemented"), not the unknown field's 400.
NOT_IMPLEMENTED = frozenset({
    # the body
    "container", "context_management", "diagnostics", "inference_geo", "mcp_servers",
    "output_format", "service_tier", "speed", "user_profile_id", "workspace_id",
    # content blocks and tools
    "citations", "caller", "toolset_name", "strict", "input_examples", "defer_loading", "allowed_callers",
    "eager_input_streaming", "ttl",
})

# Block types Anthropic defines that this server cannot take, and why.
_UNSUPPORTED_BLOCKS = {
    "image": "images are not supported: this server serves text-only models; send text",
    "document": "documents are not supported: send their text as a text block",
    "search_result": "search_result blocks are not supported: send their text as a text block",
}


class AnthropicBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CacheControl(AnthropicBase):
    type: Literal["ephemeral"]


class TextBlock(AnthropicBase):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ToolUseBlock(AnthropicBase):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ThinkingBlock(AnthropicBase):
    """A previous answer's thinking, sent back: its signature is not checked (anthropic_format
    makes them; nothing here can verify one, as in vLLM)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text


class RedactedThinkingBlock(AnthropicBase):
    type: Literal["redacted_thinking"]
    data: Text


def _refuse_blocks(blocks: Any, allowed: tuple[str, ...], where: str) -> Any:
    """A 400 that says which block of ``blocks`` (a raw list) has a type not in ``allowed``."""
    if not isinstance(blocks, list):
        return blocks
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            why = _UNSUPPORTED_BLOCKS.get(kind) or f"{where} take {' and '.join(allowed)} blocks only"
            raise ValueError(f"content block {j} has type {kind!r}: {why}.")
    return blocks


class ToolResultBlock(AnthropicBase):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        return _refuse_blocks(v, ("text",), "tool_result contents")

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


def _parts(blocks) -> list[dict]:
    """Text blocks as the chat's content parts (joined there as any chat message's are)."""
    return [{"type": "text", "text": b.text} for b in blocks]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]
_ROLE_BLOCKS = {"user": ("text", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class Message(AnthropicBase):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_the_role(cls, data):
        if isinstance(data, dict) and data.get("role") in _ROLE_BLOCKS:
            _refuse_blocks(data.get("content"), _ROLE_BLOCKS[data["role"]], f"{data['role']} messages")
        return data

    def chat_messages(self) -> list[dict]:
        """This turn as chat messages: an assistant's text and calls are one message; a user's
        tool results are "tool" messages and its text user messages, in the order sent."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            text = _parts(b for b in self.content if b.type == "text")
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in self.content if b.type == "tool_use"]
            # vLLM's: the thinking is the message's reasoning (an opaque redacted block is dropped)
            thought = "".join(b.thinking for b in self.content if b.type == "thinking")
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                     **({"reasoning": thought} if thought else {})}]
        out: list[dict] = []
        for b in self.content:
            if b.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif out and out[-1]["role"] == "user":  # consecutive text blocks: one message
                out[-1]["content"] += _parts([b])
            else:
                out.append({"role": "user", "content": _parts([b])})
        return out


class Tool(AnthropicBase):
    """A client tool; server tools (web search, bash, ...) are refused by type."""

    type: Literal["custom"] | None = None
    name: Text = Field(min_length=1)
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data):
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"the server tool {kind!r} is not implemented by this server; give client "
                             "tools (name, description, input_schema).")
        return data

    def chat_tool(self) -> dict:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(AnthropicBase):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice: `name` goes with type "tool", and only there.')
        return self

    def chat_choice(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(AnthropicBase):
    """Anthropic's thinking config. The model thinks as its chat template has it: "disabled"
    turns Qwen3-style templates' enable_thinking off, "enabled" / "adaptive" on. budget_tokens
    is accepted and not enforced (vLLM's endpoint ignores it too): max_tokens bounds the
    thinking and the answer together, as it does on Anthropic's."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = Field(None, ge=1)
    # "omitted": the thinking block comes back empty, with its signature
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('`budget_tokens` goes with type "enabled", and is required there.')
        if self.type == "disabled" and self.display is not None:
            raise ValueError('`display` goes with type "enabled" or "adaptive".')
        return self


class JSONOutputFormat(AnthropicBase):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicBase):
    """As vLLM maps it: ``effort`` is the chat's reasoning_effort (to the chat template),
    ``format`` its json_schema response_format (enforced after the thinking)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None

    def chat_fields(self) -> dict:
        fields: dict[str, Any] = {}
        if self.effort is not None:
            fields["reasoning_effort"] = self.effort
        if self.format is not None:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": self.format.schema_}}
        return fields


class Metadata(AnthropicBase):
    user_id: Text | None = None


class CountTokensRequest(AnthropicBase):
    """POST /v1/messages/count_tokens: the conversation, without the sampling fields."""

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    chat_template_kwargs: dict[Text, Any] | None = None  # vLLM's extension, as on the chat route
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice.type!r} needs tools: give `tools` or leave "
                             "tool_choice out.")
        return self

    def chat_fields(self) -> dict:
        """The chat request's conversation fields (messages, tools, tool_choice, template mode)."""
        messages: list[dict] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else _parts(self.system)
            messages.append({"role": "system", "content": text})
        for m in self.messages:
            messages += m.chat_messages()
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.messages[-1].role == "assistant":  # a prefill: the answer continues it (Anthropic's)
            fields.update(continue_final_message=True, add_generation_prompt=False)
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:  # as vLLM's reasoning_effort: unless the kwargs name it
            kwargs.setdefault("enable_thinking", self.thinking.type != "disabled")
        if kwargs:
            fields["chat_template_kwargs"] = kwargs
        if self.output_config is not None:
            fields.update(self.output_config.chat_fields())
        if self.tools:
            fields["tools"] = [t.chat_tool() for t in self.tools]
            choice = self.tool_choice
            fields["tool_choice"] = "auto" if choice is None else choice.chat_choice()
            if choice is not None and choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def show_thinking(self) -> bool:
        """Whether thinking blocks carry their text (thinking.display "omitted": not)."""
        return self.thinking is None or self.thinking.display != "omitted"

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this body is; ValueError (a 400) where the chat path refuses it."""
        return ChatCompletionRequest.model_validate(self.chat_fields())


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def to_chat(self) -> ChatCompletionRequest:
        fields = self.chat_fields()
        fields.update(max_tokens=self.max_tokens, stream=self.stream)
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stream:  # message_start names the input tokens: usage on every chunk
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return ChatCompletionRequest.model_validate(fields)
