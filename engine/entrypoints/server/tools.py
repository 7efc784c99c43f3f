"""An OpenAI chat request's tool fields checked where the request enters (``validate_tools``), the
JSON schema a forced call must follow (``call_schema``), and the messages as chat templates take
them (``messages_for_template``).

The request's model (``openai_types.ChatRequest``) has checked every type, the tools' names, the
history's call ids (chat templates write them into the prompt as they are) and the cap on the
history's calls; what is checked here needs the request as a whole: tool names unique; each
``parameters`` a JSON schema (Draft 2020-12) of type object (``spec.schema_problem``: each distinct
schema checked once); ``tool_choice`` naming one of the tools (``"required"`` and a named function
need tools); in ``messages`` each assistant tool call's ``arguments`` a JSON object as text, each
``tool`` message's ``tool_call_id`` naming an earlier assistant tool call. Every error is a 400
``APIError`` naming the field's path (``tools[1].function.parameters``) that never echoes more than
~100 characters of the input. The checks are linear in the body's size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.entrypoints.server.openai_types import ChatRequest
from engine.entrypoints.server.request_body import APIError, clipped, shown
from engine.scheduling.structured.spec import schema_problem


def _error(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}' {message}", param=param)


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]           # the request's tools as given (what the chat template's ``tools`` takes)
    tool_choice: str            # "none" | "auto" | "required" (a named function is "required" ...)
    function: str | None        # ... with its name here
    parallel_tool_calls: bool

    @property
    def names(self) -> frozenset[str]:
        """The names of the request's functions (the only calls its output may hold)."""
        return frozenset(tool["function"]["name"] for tool in self.tools)


def validate_tools(request: ChatRequest) -> ToolRequest:
    """The tool fields of a typed chat request, checked (see the module docstring)."""
    names: set[str] = set()
    for i, tool in enumerate(request.tools or []):
        function = tool.function
        if function.name in names:
            raise _error(f"tools[{i}].function.name", f"{function.name!r} names two tools")
        names.add(function.name)
        if function.parameters is not None:
            _check_parameters(function.parameters, f"tools[{i}].function.parameters")
    choice, function = _check_choice(request.tool_choice, names)
    _check_messages(request)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    return ToolRequest(tools, choice, function, request.parallel_tool_calls is not False)


def _check_parameters(schema: dict, where: str) -> None:
    problem = schema_problem(schema)
    if problem is not None:
        raise _error(where, f"is not a JSON schema: {problem}")
    if schema.get("type", "object") != "object":
        raise _error(where, "must be a JSON schema of type 'object' (arguments are an object)")


def _check_choice(choice, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice == "required" and not names:
            raise _error("tool_choice", "'required' needs tools")
        return choice, None
    name = choice.function.name
    if name not in names:
        raise _error("tool_choice", f"names no tool of the request: {shown(name)}")
    return "required", name


def _check_messages(request: ChatRequest) -> None:
    """The tool parts of the messages; the rest (roles, content) is the protocol's to check."""
    call_ids: set[str] = set()
    for i, m in enumerate(request.messages):
        where = f"messages[{i}]"
        if m.role == "assistant" and m.tool_calls is not None:
            for j, call in enumerate(m.tool_calls):
                _check_arguments(call.function.arguments, f"{where}.tool_calls[{j}].function.arguments")
                call_ids.add(call.id)
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise _error(f"{where}.tool_call_id", "is required for a tool message")
            if m.tool_call_id not in call_ids:
                raise _error(f"{where}.tool_call_id", f"{clipped(repr(m.tool_call_id))} answers no earlier tool call")


def _check_arguments(arguments: str, where: str) -> None:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _error(where, "is not a JSON object")


def call_schema(request: ToolRequest, arguments_key: str = "arguments") -> dict | None:
    """The JSON schema of the call object a forced tool choice makes the model write, or ``None``
    when the choice forces nothing (``none``, ``auto``).

    A named function ``f``: ``{"type": "object", "properties": {"name": {"const": "f"},
    <arguments_key>: {"$ref": "#/$defs/f"}}, "required": ["name", <arguments_key>],
    "additionalProperties": false, "$defs": {"f": <f's parameters>}}`` (properties in that order:
    the parsers read the name first); ``required``: ``anyOf`` such objects over every tool, one
    ``$defs`` entry per tool. Each parameters schema is moved to ``#/$defs/<name>`` with its local
    ``$ref`` pointers rewritten to match, ``"type": "object"`` added, ``$schema`` dropped; a
    function without ``parameters`` takes only ``{}``. The engine enforces ``parser.call_prefix``
    + this schema + ``parser.call_suffix`` (hermes: ``<tool_call>\\n`` ... ``\\n</tool_call>``;
    llama3_json: bare, key ``parameters``): exactly one call, whatever ``parallel_tool_calls`` says.
    """
    if request.tool_choice != "required":
        return None
    functions = [t["function"] for t in request.tools if request.function in (None, t["function"]["name"])]
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, arguments_key: {"$ref": f"#/$defs/{f['name']}"}},
              "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    definitions = {f["name"]: _moved(_parameters(f), f"#/$defs/{f['name']}") for f in functions}
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"$defs": definitions}


def _parameters(function: dict) -> dict:
    if "parameters" not in function:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object"} | {k: v for k, v in function["parameters"].items() if k != "$schema"}


_DATA_KEYWORDS = {"const", "enum", "default", "examples"}  # their values are instances, not schemas
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema


def _moved(schema, base: str):
    """``schema`` with its local ``$ref`` pointers (``#...``) made relative to ``base``."""
    if isinstance(schema, list):
        return [_moved(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _moved(s, base) for name, s in value.items()}
        else:
            moved[key] = value if key in _DATA_KEYWORDS else _moved(value, base)
    return moved


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Copies of checked ``messages`` with each assistant tool call's ``arguments`` parsed into an
    object (Llama 3's template writes them with ``tojson``, Qwen's takes either)."""
    def parsed(call: dict) -> dict:
        return call | {"function": call["function"] | {"arguments": json.loads(call["function"]["arguments"])}}

    return [m | {"tool_calls": [parsed(c) for c in m["tool_calls"]]} if m.get("tool_calls") else dict(m)
            for m in messages]
