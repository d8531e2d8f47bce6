"""``tools`` + ``tool_choice`` on /v1/chat/completions: what each choice asks of the
engine, and how the conversation's tool turns reach the chat template.

    tool_choice            the output is constrained to               answered as
    ---------------------  -----------------------------------------  --------------------------
    {"type": "function",   that function's ``parameters`` schema      one tool call, arguments =
     "function": {name}}   (structured outputs json)                  the text; finish "stop"
    "required"             [{"name": <a tool>, "parameters": <its     the array's calls;
                           schema>}, ...] (anyOf over tools, >= 1)    finish "tool_calls"
    "auto" (the default    nothing: the template shows the model the  Hermes <tool_call> blocks
     when tools are given) tools; needs a template that renders them  -> calls, the rest content
    "none"                 nothing; tools are not shown to the model  plain text

These are vLLM's semantics (its serving_chat + hermes parser): named and "required"
are guaranteed by the grammar whatever the model, "auto" is only as good as the model's
training on its own template. Parsing the output is in tool_parsers.py.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

MODES = ("none", "auto", "required")
AUTO_UNSUPPORTED = ("tool_choice 'auto' needs a chat template that renders tools, and this model's "
                    "chat template does not render tools; use tool_choice 'required' or a named "
                    "function (the output is then constrained to the tools' schemas), or 'none'.")


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "named" | "required" | "auto"
    tools: list[dict]  # the request's tools, as plain dicts (what the template gets)
    function_name: str | None = None  # mode "named"
    schema: dict | None = None  # the JSON schema the output is constrained to (named, required)


def _tool_name(i: int, tool) -> str:
    name = tool.function.name
    if not name:
        raise ValueError(f"tools[{i}].function.name must not be empty.")
    return name


def _check_compiles(where: str, schema: dict) -> None:
    """400 now for a schema the grammar backend cannot compile, naming the tool (and not
    later inside the engine, where the message cannot say which tool it was)."""
    try:
        import xgrammar
    except ImportError:  # no backend here: the engine's own check still applies
        return
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except Exception as e:  # xgrammar raises RuntimeError with the C++ location first
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)
        raise ValueError(f"{where} does not compile as a JSON schema (xgrammar): {reason}") from None


def _parameters(tool) -> dict:
    # A function without parameters takes an empty object (as OpenAI and vLLM treat it).
    params = tool.function.parameters
    return copy.deepcopy(params) if params else {"type": "object", "properties": {}}


def required_schema(tools: list, parallel_tool_calls: bool | None = None) -> dict:
    """vLLM's "required" schema: an array of >= 1 {name, parameters} objects, each one
    of the tools (anyOf). ``$defs`` of the tools move to the top, where ``$ref``s that
    say ``#/$defs/...`` find them; two tools defining one name differently is refused."""
    defs: dict = {}
    variants = []
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        for name, sub in params.pop("$defs", {}).items():
            if name in defs and defs[name] != sub:
                raise ValueError(f"tools[{i}] defines $defs/{name} differently from an earlier "
                                 "tool; give shared definitions one schema.")
            defs[name] = sub
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_plan(body, template_has_tools: bool) -> ToolPlan | None:
    """The request's tool use, or None for plain text. Raises ValueError (-> 400) naming
    the problem."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise ValueError(f"tool_choice {choice!r} needs tools: give `tools` "
                             "(a list of functions) or leave tool_choice out.")
        return None
    names = [_tool_name(i, t) for i, t in enumerate(tools)]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two tools are named {dup!r}; tool names must be unique.")
    plain = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}.')
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                             f"(tools: {', '.join(map(repr, names))}).")
        i = names.index(name)
        schema = _parameters(tools[i])
        _check_compiles(f"tools[{i}].function.parameters ({name!r})", schema)
        return ToolPlan("named", plain, function_name=name, schema=schema)
    if choice not in MODES:
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, '
                         f"got {choice!r}.")
    if choice == "none":
        return None
    if choice == "required":
        for i, t in enumerate(tools):
            _check_compiles(f"tools[{i}].function.parameters ({names[i]!r})", _parameters(t))
        return ToolPlan("required", plain, schema=required_schema(tools, body.parallel_tool_calls))
    if not template_has_tools:
        raise ValueError(AUTO_UNSUPPORTED)
    return ToolPlan("auto", plain)


def constrain_to_schema(params, schema: dict) -> None:
    """The output of every sample of ``params`` must be JSON matching ``schema``."""
    try:
        from pagedserve.scheduler.sampling_params import StructuredOutputsParams
    except ImportError:
        raise ValueError("tool_choice 'required' or a named function needs structured outputs, "
                         "which this server build lacks; use tool_choice 'auto' or 'none'.") from None
    if getattr(params, "structured_outputs", None) is not None:
        raise ValueError("tool_choice 'required' or a named function constrains the output "
                         "itself; do not combine it with response_format / structured_outputs.")
    params.structured_outputs = StructuredOutputsParams(json=schema)
