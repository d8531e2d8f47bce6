"""OpenAI-compatible request schemas (pydantic v2), with vLLM's extensions.

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
- a string encodes as UTF-8: JSON may carry a lone surrogate (``"\\ud800"``), which the
  tokenizer cannot encode and no UTF-8 response can echo.
Response shapes are in responses.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagedserve.cluster.serve.protocol_parts import (  # noqa: F401  (re-exported)
    ACCEPTED_AND_IGNORED, INT64_MAX, INT64_MIN, ChatTool, FunctionCallIn, FunctionDefinition, Int,
    JsonSchemaFormat, RequestBase, ResponseFormat, StreamOptions, StructuredOutputsField, Text, TokenId,
    ToolCallIn, _IgnoredFields)
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams


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
    truncate_prompt_tokens: Int | None = None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
            out[token] = bias
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
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            structured_outputs=self._structured_outputs(),
            prompt_logprobs=self._prompt_logprobs(logprobs),
            truncate_prompt_tokens=self.truncate_prompt_tokens)

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
    # (one engine request per prompt; cluster/serve/completions.py).
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: Text | None = None

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


class ChatMessage(RequestBase):
    role: Text
    # A string, or the OpenAI content-part list.
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # role "assistant"
    tool_call_id: Text | None = None  # role "tool": the call this message answers
    name: Text | None = None

    def template_dict(self) -> dict:
        """What the chat template sees (tool_choice.adapt_messages fits it to the template)."""
        msg: dict[str, Any] = dict(role=self.role, content=self.text())
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        elif self.role == "tool":
            raise ValueError("a message with role 'tool' needs tool_call_id (the id of the call it answers).")
        if self.name is not None:
            msg["name"] = self.name
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

    def template_mode(self) -> bool | str:
        """What render_chat appends: True (the generation prompt), False (nothing), or
        "continue" (the last message left open)."""
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("Cannot set both `continue_final_message` and "
                                 "`add_generation_prompt` to True.")
            return "continue"
        return self.add_generation_prompt

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


class TokenizeRequest(RequestBase):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None  # rendered as a chat request's would be (if the template does)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBase):
    model: Text | None = None
    tokens: list[TokenId]
