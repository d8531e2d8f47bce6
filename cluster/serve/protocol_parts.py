"""The building blocks of the request schemas (protocol.py): strict scalar types, the
base model that refuses unknown fields, the fields accepted and ignored, and the nested
objects of structured outputs and tools. See protocol.py for the rules they follow."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field

from pagedserve.cluster.serve.responses import OpenAIBase

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


# Fields accepted and ignored: OpenAI's, whose ignoring cannot change what a client gets
# back (bookkeeping for OpenAI's own services). Listed in deploy/README.md; every other
# field is implemented, and an unknown one is a 400 that names it: silently dropping a
# field a client relies on (say ``logit_bias``) gives it a different answer with no hint.
# tests/test_api_field_coverage.py holds code, this list and the README to that.
ACCEPTED_AND_IGNORED = frozenset({"user", "safety_identifier", "metadata", "store",
                                  "prompt_cache_key"})


class RequestBase(OpenAIBase):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _IgnoredFields(RequestBase):
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
