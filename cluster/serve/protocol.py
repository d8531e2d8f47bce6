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

from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field

from pagedserve.cluster.serve.responses import OpenAIBase
from pagedserve.scheduler.sampling_params import SamplingParams

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
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class RequestBase(OpenAIBase):
    # Unknown fields are still ignored (clients send e.g. ``user``), as OpenAI does.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(RequestBase):
    include_usage: bool = False


class _SamplingFields(RequestBase):
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
    cache_salt: Text | None = None
    prompt_logprobs: Int | None = None
    truncate_prompt_tokens: Int | None = None

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
            skip_special_tokens=self.skip_special_tokens,
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

    type: Text
    text: Text | None = None


class ChatMessage(RequestBase):
    role: Text
    # A string, or the OpenAI content-part list.
    content: Text | list[ContentPart] | None = None

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
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBase):
    model: Text | None = None
    tokens: list[TokenId]
