"""OpenAI-compatible response and error shapes (pydantic v2), with vLLM's extensions
(``stop_reason``, ``token_ids``, ``prompt_token_ids``). Request schemas, which validate
what users send, are in protocol.py; these only describe what the server answers.
"""

from __future__ import annotations

import re
import time
import uuid
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    # Unknown fields are ignored (clients send e.g. ``user``), as the OpenAI server does.
    model_config = ConfigDict(extra="ignore")


class PromptTokensDetails(OpenAIBase):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (this tenant's own)


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIBase):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBase):
    """vLLM's Logprob, as its ``prompt_logprobs`` serialize it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (None for the first): token id (as a JSON key) -> logprob.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(OpenAIBase):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprobTop(OpenAIBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(OpenAIBase):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(OpenAIBase):
    name: str
    arguments: str  # JSON text, as OpenAI sends it (the client parses it)


class ToolCall(OpenAIBase):
    id: str = Field(default_factory=lambda: tool_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: call_ + 24 characters


class ChatResponseMessage(OpenAIBase):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _keep_null_content(self, handler):
        # OpenAI sends ``"content": null`` beside tool_calls; exclude_none would drop it.
        data = handler(self)
        data.setdefault("content", None)
        return data


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBase):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsList | None = None  # vLLM: per response, not per choice


class DeltaFunctionCall(OpenAIBase):
    name: str | None = None
    arguments: str | None = None  # a fragment: a call's fragments concatenate to its JSON


class DeltaToolCall(OpenAIBase):
    index: int  # which call of this choice; id/type/name come in its first delta only
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBase):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(OpenAIBase):
    """OpenAI streams completions with the same object name as the final response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBase):
    count: int
    max_model_len: int
    tokens: list[int]



class DetokenizeResponse(OpenAIBase):
    prompt: str


class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo


# HTTP status -> OpenAI error ``type`` (the openai SDK's exception class names); other
# statuses get the HTTP phrase, e.g. 413 -> "RequestEntityTooLargeError".
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                422: "UnprocessableEntityError", 429: "RateLimitError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return re.sub(r"[^A-Za-z]", "", HTTPStatus(status).phrase.title()) + "Error"
    except ValueError:
        return "APIError"


# An absolute path of two or more parts (not the "//" of a URL): a server-side detail.
_PATH = re.compile(r"(?<![\w:/.])/(?:[\w.\-]+/)+[\w.\-]*")
_INTERNAL = "internal error; see the server log"


def public_message(message: str) -> str:
    """What a 5xx may tell a client of the server's own failure: the first line, no
    traceback, no source path (the log has the whole story, with the request id)."""
    lines = message.strip().splitlines()
    if not lines or lines[0].startswith("Traceback"):
        return _INTERNAL
    return _PATH.sub("<path>", lines[0])[:300]


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if status >= 500:
        message = public_message(message)
    info = ErrorInfo(message=message, type=_error_type(status), param=param, code=status)
    return ErrorResponse(error=info).model_dump()

