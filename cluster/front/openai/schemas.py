"""The OpenAI-compatible schemas (pydantic v2), with vLLM's extensions: what users
send (request bodies, validated here) and what the server answers (response and error
shapes, with ``stop_reason``, ``token_ids``, ``prompt_token_ids``).

Field names and defaults follow the OpenAI API; the vLLM-style extensions (``top_k``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``priority``, ``repetition_penalty``,
``return_token_ids``) ride in the same body. Range checks live in one place,
``SamplingParams._verify``; a schema only converts, so every user mistake yields the
same message whether it came over HTTP or through the offline ``LLM``.

Converting is strict, because whatever slips past the edge fails later, inside a step
or a response encoder, where it costs more than one request:
- an integer is a JSON integer (not ``"5"``, ``5.0`` or ``true``), bounded to int64 as
  in OpenAI's API and vLLM (it ends up in torch tensors and generators);
- a boolean is a JSON boolean (not ``"yes"`` or ``1``);
- a float is a finite number (Python's json accepts ``Infinity`` and ``NaN``);
- a string encodes as UTF-8: JSON may carry a lone surrogate (``"\ud800"``), which the
  tokenizer cannot encode and no UTF-8 response can echo.

Fields: a body or chat message accepts a field that no OpenAI or vLLM schema has (named
back in a header, as ``unknown_fields``) and refuses one those schemas have and this server
does not implement (``NOT_IMPLEMENTED``); the objects nested in a body refuse any unknown key.

In order: the response shapes, the building blocks of the request schemas (strict scalar
types, the base models, the fields accepted and ignored, the nested objects of structured
outputs and tools), then the request bodies.
"""

from __future__ import annotations

import re
import time
import uuid
from http import HTTPStatus
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    # Unknown fields are ignored (clients send e.g. ``user``), as the OpenAI server does.
    model_config = ConfigDict(extra="ignore")


class PromptTokensDetails(OpenAIBase):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (this tenant's own)


class CompletionTokensDetails(OpenAIBase):
    reasoning_tokens: int = 0  # the thinking's tokens (with --reasoning-parser, as vLLM counts them)


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


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


# A whole (not streamed) completion or chat response is sent with every field below, null
# included, as vLLM sends them: clients read the attributes (the openai SDK has an extra one
# only if it was sent), and vLLM's test_invocations holds the JSON's keys to the SDK's.
class CompletionResponse(OpenAIBase):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _keep_null_prompt_logprobs(self, handler):
        # vLLM sends each choice's "prompt_logprobs": null when none were asked for, and its
        # clients read choice.prompt_logprobs (the openai SDK has the attribute only if sent).
        data = handler(self)
        for choice in data.get("choices") or ():
            choice.setdefault("prompt_logprobs", None)
        return data


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
    # OpenAI's, never set here (no refusals, annotations, audio or legacy function calls).
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    tool_calls: list[ToolCall] | None = None
    # The thinking, with --reasoning-parser (vLLM's field; reasoning_content is its older
    # name, still read by clients written for it: both carry the same text).
    reasoning: str | None = None
    reasoning_content: str | None = None

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
    # OpenAI's, never set here.
    metadata: dict | None = None
    moderation: dict | None = None
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsList | None = None  # vLLM: per response, not per choice
    prompt_token_ids: list[int] | None = None  # with return_token_ids, as vLLM

    @model_serializer(mode="wrap")
    def _keep_null_prompt_logprobs(self, handler):
        # As CompletionResponse: vLLM's "prompt_logprobs": null, which its clients read.
        data = handler(self)
        data.setdefault("prompt_logprobs", None)
        return data


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
    reasoning: str | None = None  # with --reasoning-parser: the thinking's delta (and, the same,
    reasoning_content: str | None = None  # under its older name)
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
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the first chunk only (vLLM)


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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's); None for the base model
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBase):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid text: a lone surrogate at position {e.start} "
                         "(strings must be valid Unicode)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# OpenAI's reasoning_effort values and vLLM's ("max": DeepSeek V4's)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


# Fields accepted and ignored: OpenAI's, whose ignoring cannot change what a client gets
# back (bookkeeping for OpenAI's own services). Listed in deploy/README.md; every other
# field is implemented, and an unknown one is a 400 that names it: silently dropping a
# field a client relies on (say ``logit_bias``) gives it a different answer with no hint.
# tests/test_api_field_coverage.py holds code, this list and the README to that.
ACCEPTED_AND_IGNORED = frozenset({"user", "safety_identifier", "metadata", "store",
                                  "prompt_cache_key"})

# Fields of OpenAI's or vLLM's request schemas that this server does not implement: a 400
# that names them, never dropped (a client that sends one relies on it). A field that no
# OpenAI or vLLM schema has is accepted, as vLLM accepts it: it is logged and named in the
# response's x-pagedserve-ignored-fields header (clients send fields meant for other
# servers, e.g. through the openai SDK's extra_body). The test of the field walk holds this
# list to the openai SDK's own request parameters.
NOT_IMPLEMENTED = frozenset({
    # OpenAI chat completions
    "audio", "function_call", "functions", "modalities", "moderation", "prediction",
    "prompt_cache_options", "prompt_cache_retention", "service_tier", "verbosity",
    "web_search_options",
    # vLLM's completions and chat completions
    "allowed_token_ids", "bad_words", "chat_template", "documents",
    "early_stopping", "ec_transfer_params", "kv_transfer_params", "logits_processors",
    "media_io_kwargs", "mm_payload", "mm_processor_kwargs", "prompt_embeds",
    "repetition_detection", "request_id", "return_mm_kwargs", "return_prompt_text", "return_token_offsets",
    "routed_experts_prompt_start", "session_id", "spaces_between_special_tokens", "stream_interval",
    "thinking_token_budget", "watermarking",
})
# The same inside a chat message (OpenAI's message parameters).
NOT_IMPLEMENTED_IN_MESSAGES = frozenset({"audio", "function_call"})


class RequestBase(OpenAIBase):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _OpenBody(RequestBase):
    """A request body or chat message: a field OpenAI's and vLLM's schemas do not have is
    kept aside (``unknown_fields``) for the front to log and name; one they have and this
    server does not implement is a 400 naming it."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    # The refused names; or, as a dict, name -> the values that ask for what the server does
    # anyway (None always does): only other values are refused (the Responses API's body).
    _not_implemented: ClassVar[frozenset[str] | dict[str, tuple]] = NOT_IMPLEMENTED

    def _refused(self, name: str, value) -> bool:
        if name not in self._not_implemented:
            return False
        harmless = self._not_implemented.get(name, ()) if isinstance(self._not_implemented, dict) else None
        return harmless is None or (value is not None and value not in harmless)

    @model_validator(mode="after")
    def _refuse_the_not_implemented(self):
        named = sorted(k for k, v in (self.model_extra or {}).items() if self._refused(k, v))
        if named:
            raise PydanticCustomError(
                "not_implemented", "{fields}: not implemented by this server (deploy/README.md)",
                {"fields": ", ".join(named)})
        return self

    def unknown_fields(self) -> list[str]:
        """The fields of this body that no schema here knows, its messages' too (as
        ``messages[i].name``, ``messages[i][j].name`` in a batch): accepted and ignored."""
        names = sorted(k for k in self.model_extra or () if k not in self._not_implemented)
        for i, m in enumerate(getattr(self, "messages", None) or ()):
            for j, msg in (enumerate(m) if isinstance(m, list) else [(None, m)]):
                at = f"messages[{i}]" if j is None else f"messages[{i}][{j}]"
                names += [f"{at}.{k}" for k in sorted(msg.model_extra or ())]
        return names


class _IgnoredFields(_OpenBody):
    """ACCEPTED_AND_IGNORED, typed as OpenAI types them (a wrong type is still a 400)."""

    user: Text | None = None
    safety_identifier: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    prompt_cache_key: Text | None = None


class StreamOptions(RequestBase):
    include_usage: bool = False
    # vLLM's: usage on every chunk too (only with include_usage, as vLLM).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestBase):
    name: Text | None = None
    description: Text | None = None
    # ``schema`` would shadow BaseModel.schema: stored as json_schema, sent as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(RequestBase):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestBase):
    """vLLM's ``structured_outputs`` body field (vLLM >= 0.10); exactly one is set."""

    # ``json`` would shadow BaseModel.json: stored as json_, sent as "json".
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class FunctionCallIn(RequestBase):
    name: Text
    arguments: Text  # JSON text, as the server sent it


class ToolCallIn(RequestBase):
    """A call in an assistant message that the client sends back (the conversation so far)."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(RequestBase):
    name: Text
    description: Text | None = None
    # A JSON Schema object; whether it compiles is checked where it is used (tool_choice.py).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestBase):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingFields(_IgnoredFields):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM extensions.
    top_k: Int | None = None
    min_p: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    priority: Int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"
    cache_salt: Text | None = None
    # OpenAI: {"token id": bias in [-100, 100]}.
    logit_bias: dict[Text, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM < 0.10's names for the same, still sent by many clients.
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # Accepted only when they change nothing (never silently ignored).
    guided_decoding_backend: Text | None = None
    guided_whitespace_pattern: Text | None = None
    prompt_logprobs: Int | None = None
    # vLLM's: the logprobs of these token ids at each generated position, with the sampled
    # one's, instead of the top N (logprobs must be asked).
    logprob_token_ids: list[TokenId] | None = Field(None, max_length=128)
    truncate_prompt_tokens: Int | None = None
    # Which end truncate_prompt_tokens keeps: "left" (vLLM's default) cuts the start,
    # keeping the last tokens; "right" keeps the first.
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's beam search (cluster/front/beam_search.py): n beams, scored by cumulative
    # logprob over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out, bad = {}, []
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                bad.append(key)
        if bad:  # all of them, as vLLM names them
            raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
        return out

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint of this body, from whichever field carries it."""
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported (JSON output is compact).")
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise ValueError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not "
                             "supported; this server uses xgrammar.")
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema.")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", StructuredOutputsParams(**{name: value})))
        if len(found) > 1:
            raise ValueError("give one output constraint, got "
                             + ", ".join(name for name, _ in found) + ".")
        return found[0][1] if found else None

    # What beam search takes besides the prompt. Any other field set away from its default
    # is a 400 naming it (vLLM's beam search drops them without a word). ``temperature`` is
    # taken and changes nothing: the search is deterministic and draws no sample.
    _BEAM_FIELDS: ClassVar[frozenset[str]] = frozenset({
        "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature",
        "ignore_eos", "length_penalty", "use_beam_search", "include_stop_str_in_output", "return_token_ids",
        "skip_special_tokens", "priority", "cache_salt", "add_generation_prompt", "continue_final_message",
        "add_special_tokens", "stream", "stream_options", "chat_template_kwargs",
    }) | ACCEPTED_AND_IGNORED

    def beam_width(self) -> int | None:
        """The beam width (``n``) with use_beam_search, else None; ValueError (a 400) for a
        field beam search does not take."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies only with use_beam_search.")
            return None
        fields = type(self).model_fields
        off = sorted(f for f in (self.model_fields_set & fields.keys()) - self._BEAM_FIELDS
                     if getattr(self, f) != fields[f].default)
        if off:
            raise ValueError(f"use_beam_search does not take {', '.join(off)} (beam search keeps the "
                             f"{self.n} most likely sequences; it does not sample).")
        return self.n

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):  # declared before: validated first
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return v

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for out-of-range values."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[] if self.stop is None else self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, logprob_token_ids=self._logprob_token_ids(logprobs),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            structured_outputs=self._structured_outputs(),
            prompt_logprobs=self._prompt_logprobs(logprobs),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left")

    def _logprob_token_ids(self, logprobs: int | None) -> list[int] | None:
        if not self.logprob_token_ids:
            return None
        if logprobs is None:  # vLLM's words
            raise ValueError("when using `logprob_token_ids`, `logprobs` must be set (true in a chat request).")
        if self.use_beam_search:
            raise ValueError("`logprob_token_ids` is not supported with beam search.")
        return list(self.logprob_token_ids)

    def _prompt_logprobs(self, logprobs: int | None) -> int | None:
        # vLLM refuses prompt logprobs on a stream (they would all come in the first chunk).
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a batch: a list of strings or of token-id lists
    # (one engine request per prompt; cluster/front/serving_completion.py).
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: Text | None = None
    add_special_tokens: bool = True  # BOS etc. around a text prompt (vLLM)

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo (vLLM): the prompt back, with its logprobs, nothing new."""
        return self.max_tokens == 0 and self.echo

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix is not None:  # fill-in-the-middle needs a model trained for it
            raise ValueError("suffix is not supported by this model.")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo).")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n when stream=True (the best samples are "
                             "known only at the end).")
        # One step computes the prompt's logits; its sampled token is dropped afterwards.
        max_tokens = 1 if self.prompt_only else self.max_tokens
        params = self._sampling_params(max_tokens, self.logprobs)
        return params if self.best_of is None else params.clone(best_of=self.best_of)

    def _prompt_logprobs(self, logprobs: int | None) -> int | None:
        # echo with logprobs shows the prompt's tokens with theirs (vLLM, OpenAI).
        asked = super()._prompt_logprobs(logprobs)
        if self.echo and logprobs is not None:
            return max(asked or 0, logprobs)
        return asked

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one or a batch; ValueError for an empty one."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if len(p) == 0:
            raise ValueError("prompt must not be empty.")
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        if any(len(q) == 0 for q in p):
            raise ValueError("prompt must not contain an empty prompt.")
        return list(p)  # type: ignore[arg-type]


class ContentPart(RequestBase):
    """One part of OpenAI's content-part list. ``type`` is required, as in OpenAI's API;
    only text parts are understood, other types are refused by ``ChatMessage.text``."""

    # Other part types (image_url, input_audio, ...) bring their own payload fields: those
    # are allowed through, for ChatMessage.text to refuse the part by its type (a clearer
    # 400 than "unknown field image_url"); a text part's unknown fields are refused here.
    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None

    @model_validator(mode="after")
    def _text_part_fields(self):
        if self.type == "text" and self.model_extra:
            raise ValueError(f"unknown field(s) {sorted(self.model_extra)} in a text content part")
        return self


class ChatMessage(_OpenBody):
    _not_implemented: ClassVar[frozenset[str]] = NOT_IMPLEMENTED_IN_MESSAGES

    role: Text
    # A string, or the OpenAI content-part list.
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # role "assistant"
    tool_call_id: Text | None = None  # role "tool": the call this message answers
    name: Text | None = None
    # An assistant turn's reasoning and refusal, sent back with the conversation: they go
    # to the chat template, which renders them if it knows them (as vLLM passes them).
    reasoning: Text | None = None
    reasoning_content: Text | None = None
    refusal: Text | None = None

    def template_dict(self) -> dict:
        """What the chat template sees (tool_choice.adapt_messages fits it to the template)."""
        msg: dict[str, Any] = dict(role=self.role, content=self.text())
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        elif self.role == "tool":
            raise ValueError("a message with role 'tool' needs tool_call_id (the id of the call it answers).")
        for key in ("name", "reasoning", "reasoning_content", "refusal"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg

    def text(self) -> str:
        """Raises ValueError (-> HTTP 400) for a non-text part."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"unsupported content part type {part.type!r}; only 'text'.")
            parts.append(part.text or "")
        return "".join(parts)


def _template_mode(body) -> bool | str:
    """What render_chat appends for a body with vLLM's chat-template switches: True (the
    generation prompt), False (nothing), or "continue" (the last message left open)."""
    if body.continue_final_message:
        if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        return "continue"
    return body.add_generation_prompt


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    # checked in tool_choice.tool_plan, which names what is wrong.
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false}: Qwen3's
    # switch), those it reads; and whether the thinking (--reasoning-parser) is sent back.
    chat_template_kwargs: dict[Text, Any] | None = None
    include_reasoning: bool = True
    reasoning_effort: ReasoningEffort | None = None  # to the template: template_kwargs()

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_leave_the_template_alone(cls, v):
        unexpected = sorted({"chat_template", "tokenize"} & set(v or ()))
        if unexpected:  # vLLM's words
            raise ValueError(f"Found unexpected chat template kwargs from request: {unexpected}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        # As vLLM: -1 is the whole vocabulary; 0 without logprobs asks for nothing.
        if v is not None and v < -1:
            raise ValueError("`top_logprobs` must be a positive value or -1.")
        if v is not None and v != 0 and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return v
    # vLLM: continue the last (assistant) message instead of starting a new turn; echo
    # returns that message's content ahead of the generated text.
    continue_final_message: bool = False
    echo: bool = False
    # vLLM: False, the chat template writes BOS itself; True adds the tokenizer's too.
    add_special_tokens: bool = False

    def template_mode(self) -> bool | str:
        return _template_mode(self)

    def template_kwargs(self) -> dict | None:
        """The chat template's extra variables, as vLLM's build_chat_params makes them:
        ``chat_template_kwargs`` with ``reasoning_effort`` (the request's, over theirs) and,
        unless they name it, ``enable_thinking``: off for effort "none", on for any other."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = dict(self.chat_template_kwargs or {}, reasoning_effort=self.reasoning_effort)
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content when its role is the one that
        answers, "assistant" after a generation prompt, else the last message's own (the
        one continued), so a continued message comes back whole."""
        last = self.messages[-1]
        new_turn = self.add_generation_prompt and not self.continue_final_message
        if not self.echo or (new_turn and last.role != "assistant"):
            return ""
        return last.text()

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the chat fields, with ``messages`` a list of
    conversations, each answered by one choice (index i). As in vLLM: no streaming, no
    tools, n = 1, no beam search."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _batch_limits(self):
        for name, bad in (("stream", self.stream), ("tools", self.tools), ("n", self.n != 1),
                          ("use_beam_search", self.use_beam_search)):
            if bad:
                raise ValueError(f"Batch chat completions do not support `{name}`"
                                 + (": set `n` to 1." if name == "n" else "."))
        return self

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, every other field as sent."""
        fields = {k: getattr(self, k) for k in ChatCompletionRequest.model_fields if k != "messages"}
        return [ChatCompletionRequest.model_construct(_fields_set=self.model_fields_set, messages=conv, **fields)
                for conv in self.messages]


class TokenizeRequest(_OpenBody):
    """vLLM's /tokenize: a prompt, or chat messages rendered as a chat request's are."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None  # rendered as a chat request's would be (if the template does)
    chat_template_kwargs: dict[Text, Any] | None = None  # as a chat request's
    # None: vLLM's defaults, True for a prompt and False for messages (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # the tokens as the vocabulary spells them

    def template_mode(self) -> bool | str:
        return _template_mode(self)


class DetokenizeRequest(_OpenBody):
    model: Text | None = None
    tokens: list[TokenId]
