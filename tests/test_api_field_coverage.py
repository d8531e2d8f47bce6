"""The rule for the request schemas: every field a client may send is implemented, or it
is on the short list of fields accepted and ignored (protocol.ACCEPTED_AND_IGNORED, the
same list in deploy/README.md), or it is a field of OpenAI's or vLLM's that this server
refuses naming it (protocol.NOT_IMPLEMENTED). A field that no such schema has is accepted
in a body or a message and named back to the client; inside our own nested objects it is
refused.

Adding a field to cluster/front/openai/schemas.py means registering it below as implemented (or, if ignoring
it cannot change what a client gets back, adding it to both ignored lists). The walk
covers the nested models too (messages, content parts, stream_options), and the check
is shown to fail on a planted field; the openai SDK's own request parameters are held to
the three lists.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pydantic
import pytest
from pydantic import BaseModel

from pagedserve.cluster.front.openai import schemas as protocol
from pagedserve.cluster.front.openai.schemas import (ACCEPTED_AND_IGNORED, ChatCompletionRequest,
                                               CompletionRequest)

README = Path(__file__).resolve().parent.parent / "deploy" / "README.md"

# Fields both endpoints take (protocol._SamplingFields).
SAMPLING = {"model", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
            "presence_penalty", "frequency_penalty", "top_k", "min_p", "min_tokens", "ignore_eos",
            "priority", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
            "skip_special_tokens", "return_token_ids", "return_tokens_as_token_ids", "cache_salt",
            # structured outputs and logit_bias (tests/test_structured_outputs.py); the
            # guided_* backend / whitespace fields are a 400 unless they change nothing
            "logit_bias", "response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
            # tests/test_prompt_logprobs.py, tests/test_serve_batch_echo.py
            "prompt_logprobs", "truncate_prompt_tokens",
            # tests/test_vllm_api.py (vLLM's test_batched_chat_completions_logprob_token_ids)
            "logprob_token_ids",
            # tests/test_serve_vllm_parity.py
            "truncation_side", "use_beam_search", "length_penalty", "add_special_tokens"}

# Model class name -> the fields it implements. Register new fields here.
IMPLEMENTED: dict[str, set[str]] = {
    # best_of: top n by cumulative logprob; suffix: a 400 naming it (no FIM model)
    "CompletionRequest": SAMPLING | {"prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"},
    "ChatCompletionRequest": SAMPLING | {"messages", "max_tokens", "max_completion_tokens",
                                         "logprobs", "top_logprobs", "add_generation_prompt",
                                         "continue_final_message", "echo",
                                         "tools", "tool_choice", "parallel_tool_calls",
                                         # tests/test_serve_reasoning.py
                                         "chat_template_kwargs", "include_reasoning", "reasoning_effort"},
    "ChatMessage": {"role", "content", "tool_calls", "tool_call_id", "name",
                    # to the chat template, as vLLM passes them (tests/test_serve_vllm_parity.py)
                    "reasoning", "reasoning_content", "refusal"},
    "ContentPart": {"type", "text"},
    "StreamOptions": {"include_usage", "continuous_usage_stats"},
    # response_format's json_schema: the schema is always enforced (strict or not); name and
    # description label it for the client and change no token.
    "JsonSchemaFormat": {"name", "description", "json_schema", "strict"},
    "ResponseFormat": {"type", "json_schema"},
    "StructuredOutputsField": {"json_", "regex", "choice", "grammar", "json_object"},
    # tools: descriptions reach a chat template that renders tools (tool_choice.py)
    "ChatTool": {"type", "function"},
    "FunctionDefinition": {"name", "description", "parameters", "strict"},
    "ToolCallIn": {"id", "type", "function"},
    "FunctionCallIn": {"name", "arguments"},
}


def _nested_models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]


def _registered(model: type[BaseModel], implemented: dict[str, set[str]]) -> set[str] | None:
    """The set of the nearest class in the MRO that is registered (a subclass that adds a
    field without registering it is caught: it falls back to its base's set)."""
    for cls in model.__mro__:
        if cls.__name__ in implemented:
            return implemented[cls.__name__]
    return None


def uncovered(root: type[BaseModel], implemented: dict[str, set[str]] = IMPLEMENTED,
              ignored: frozenset[str] = ACCEPTED_AND_IGNORED) -> list[str]:
    """'Model.field' for each field under ``root`` that is neither implemented nor ignored."""
    seen, todo, missing = set(), [root], []
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        known = _registered(model, implemented)
        for name, info in model.model_fields.items():
            if known is None or (name not in known and name not in ignored):
                missing.append(f"{model.__name__}.{name}")
            todo.extend(_nested_models(info.annotation))
    return sorted(missing)


def _walk(root: type[BaseModel]) -> set[type[BaseModel]]:
    seen, todo = set(), [root]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(n for f in m.model_fields.values() for n in _nested_models(f.annotation))
    return seen


def readme_ignored() -> set[str]:
    """The backticked names of the bullets under deploy/README.md's "Accepted and ignored"."""
    text = README.read_text()
    section = text.split("### Accepted and ignored fields", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^- `([a-z_]+)`", section, flags=re.M))


@pytest.mark.parametrize("root", [CompletionRequest, ChatCompletionRequest])
def test_every_request_field_is_implemented_or_documented_as_ignored(root):
    assert uncovered(root) == []


def test_ignored_fields_are_the_readmes_and_are_declared():
    assert readme_ignored() == set(ACCEPTED_AND_IGNORED)
    for root in (CompletionRequest, ChatCompletionRequest):
        assert set(ACCEPTED_AND_IGNORED) <= set(root.model_fields)
        assert not set(ACCEPTED_AND_IGNORED) & IMPLEMENTED[root.__name__]  # one or the other


def test_registry_names_only_fields_that_exist():
    models = {m.__name__: m for r in (CompletionRequest, ChatCompletionRequest) for m in _walk(r)}
    for name, fields in IMPLEMENTED.items():
        assert name in models, name
        assert fields <= set(models[name].model_fields), (name, fields - set(models[name].model_fields))


OPEN = {"CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest", "ChatMessage"}


def test_unknown_fields_are_named_known_unimplemented_ones_refused_nested_ones_refused():
    for root in (CompletionRequest, ChatCompletionRequest, protocol.BatchChatCompletionRequest):
        for model in _walk(root):
            if model is protocol.ContentPart:  # refuses a text part's extras in a validator
                continue
            # A body and a message take what no schema knows (named back to the client);
            # a nested object of ours refuses it.
            assert model.model_config.get("extra") == ("allow" if model.__name__ in OPEN else "forbid"), model
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x", "x_trace": 1}], "logit_bias_typo": {}})
    assert body.unknown_fields() == ["logit_bias_typo", "messages[0].x_trace"]
    for known in ("service_tier", "bad_words", "allowed_token_ids"):
        with pytest.raises(pydantic.ValidationError) as e:
            CompletionRequest.model_validate({"prompt": "x", known: 1})
        assert e.value.errors()[0]["type"] == "not_implemented" and known in e.value.errors()[0]["msg"]
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "audio": {}}]})
    assert e.value.errors()[0]["type"] == "not_implemented"
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]})
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "stream": True,
                                          "stream_options": {"include_usage": True, "chunked": 1}})
    ok = CompletionRequest.model_validate({"prompt": "x", "user": "u-1", "metadata": {"k": "v"},
                                           "store": False, "safety_identifier": "s",
                                           "prompt_cache_key": "p"})
    assert ok.to_sampling_params() == CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params()
    assert ok.unknown_fields() == []


def test_every_openai_request_parameter_is_implemented_ignored_or_refused():
    """The openai SDK's own request parameters: none may fall through as "unknown" (that
    would accept and ignore a field a client relies on)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for root, sdk in ((CompletionRequest, completion_create_params.CompletionCreateParamsBase),
                      (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase)):
        known = set(root.model_fields) | protocol.NOT_IMPLEMENTED
        assert set(typing.get_type_hints(sdk)) - known == set(), root.__name__
    from openai.types.chat import ChatCompletionAssistantMessageParam

    known = set(protocol.ChatMessage.model_fields) | protocol.NOT_IMPLEMENTED_IN_MESSAGES
    assert set(typing.get_type_hints(ChatCompletionAssistantMessageParam)) - known == set()
    assert not protocol.NOT_IMPLEMENTED & (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))


def test_the_check_catches_a_planted_field():
    class Planted(CompletionRequest):
        frobnicate: int = 0

    class PlantedOptions(protocol.StreamOptions):
        chunk_size: int = 1

    class PlantedNested(CompletionRequest):
        stream_options: PlantedOptions | None = None

    assert uncovered(Planted) == ["Planted.frobnicate"]
    assert uncovered(PlantedNested) == ["PlantedOptions.chunk_size"]

    class Unregistered(BaseModel):
        anything: int = 0

    class PlantedModel(ChatCompletionRequest):
        extra_model: Unregistered | None = None

    assert uncovered(PlantedModel) == ["PlantedModel.extra_model", "Unregistered.anything"]
    # Ignoring is not a way out unless the field is on the ignored list.
    assert uncovered(Planted, ignored=ACCEPTED_AND_IGNORED | {"frobnicate"}) == []
