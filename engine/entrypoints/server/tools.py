"""An OpenAI chat request's tool fields checked where the request enters (``validate_tools``), the
JSON schema a forced call must follow (``call_schema``), and the messages as chat templates take
them (``messages_for_template``).

Checked: ``tools`` (at most ``max_tools``, OpenAI's 128 by default; each ``{"type": "function",
"function": {"name", "description"?, "parameters"?, "strict"?}}``, names unique and
``[a-zA-Z0-9_-]{1,64}``, ``parameters`` a JSON schema (Draft 2020-12) of type object),
``tool_choice`` (``"none" | "auto" | "required" | {"type": "function", "function": {"name": <a
tool>}}``; ``"required"`` and a named function need tools), ``parallel_tool_calls`` (a boolean),
and in ``messages`` the assistant ``tool_calls`` (at most ``max_history_calls`` in all; ``id``:
1 to 256 letters, digits, ``_ - . :``; ``type: "function"``; ``function.name``: a function name
as above, whether or not the request still offers it; ``function.arguments``: a JSON object as
text) and the ``tool`` messages (``tool_call_id``: a string naming an earlier assistant tool
call). Names and ids are checked because chat templates write them into the prompt as they are
(``"name": "{{ name }}"``): one holding quotes or a template's special tokens would write turns of
its own. Unknown keys inside a tool or a tool choice are refused. Every error is a
``ToolRequestError`` whose message starts with the field's path (``tools[1].function.parameters:
...``) and never echoes more than ~100 characters of the input. The checks are linear in the
body's size.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jsonschema import Draft202012Validator, SchemaError

from engine.entrypoints.server.request_body import RequestLimits, clipped

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CALL_ID = re.compile(r"[a-zA-Z0-9_.:-]{1,256}")  # OpenAI's call_..., vLLM's chatcmpl-tool-..., Kimi's functions.f:0
_CHOICES = ("none", "auto", "required")
MAX_TOOLS = RequestLimits.tools  # OpenAI's own limit
MAX_HISTORY_CALLS = RequestLimits.history_tool_calls


class ToolRequestError(ValueError):
    """A tool field of the request that cannot be honoured (an HTTP 400); ``param``: the field's path."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


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


def validate_tools(body: dict, max_tools: int = MAX_TOOLS, max_history_calls: int = MAX_HISTORY_CALLS) -> ToolRequest:
    """The tool fields of a chat request body, checked (see the module docstring)."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolRequestError("tools", "must be an array")
    if len(tools) > max_tools:
        raise ToolRequestError("tools", f"holds {len(tools)} tools; at most {max_tools} are taken")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise ToolRequestError(f"tools[{i}].function.name", f"{name!r} names two tools")
        names.add(name)
    choice, function = _check_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls", "must be a boolean")
    _check_messages(body.get("messages"), max_history_calls)
    return ToolRequest(tools, choice, function, parallel is not False)


def _check_tool(tool, where: str) -> str:
    if not isinstance(tool, dict):
        raise ToolRequestError(where, "must be an object")
    _known_keys(tool, {"type", "function"}, where)
    if tool.get("type") != "function":
        raise ToolRequestError(f"{where}.type", "must be 'function'")
    function, where = tool.get("function"), f"{where}.function"
    if not isinstance(function, dict):
        raise ToolRequestError(where, "must be an object")
    _known_keys(function, {"name", "description", "parameters", "strict"}, where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolRequestError(f"{where}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(function.get("description", ""), str):
        raise ToolRequestError(f"{where}.description", "must be a string")
    if not isinstance(function.get("strict", False), bool):
        raise ToolRequestError(f"{where}.strict", "must be a boolean")
    if "parameters" in function:
        _check_parameters(function["parameters"], f"{where}.parameters")
    return name


def _check_parameters(schema, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolRequestError(where, "must be a JSON schema object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise ToolRequestError(where, f"not a JSON schema: {clipped(e.message)}") from None
    if schema.get("type", "object") != "object":
        raise ToolRequestError(where, "must be a JSON schema of type 'object' (arguments are an object)")


def _check_choice(choice, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise ToolRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                                  "{'type': 'function', 'function': {'name': ...}}")
        if choice == "required" and not names:
            raise ToolRequestError("tool_choice", "'required' needs tools")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(choice.get("function"), dict) or not isinstance(choice["function"].get("name"), str):
        raise ToolRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                              "{'type': 'function', 'function': {'name': ...}}")
    _known_keys(choice, {"type", "function"}, "tool_choice")
    _known_keys(choice["function"], {"name"}, "tool_choice.function")
    name = choice["function"]["name"]
    if name not in names:
        raise ToolRequestError("tool_choice", f"unknown function {clipped(repr(name))}")
    return "required", name


def _check_messages(messages, max_calls: int) -> None:
    """The tool parts of ``messages``; the rest (roles, content) is the protocol's to check."""
    if not isinstance(messages, list):
        return
    call_ids: set[str] = set()
    calls = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        where = f"messages[{i}]"
        if m.get("role") == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise ToolRequestError(f"{where}.tool_calls", "must be an array")
            calls += len(m["tool_calls"])
            if calls > max_calls:
                raise ToolRequestError(f"{where}.tool_calls", f"the messages hold more than {max_calls} tool calls "
                                                              "in all")
            for j, call in enumerate(m["tool_calls"]):
                call_ids.add(_check_message_call(call, f"{where}.tool_calls[{j}]"))
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id is None:
                raise ToolRequestError(f"{where}.tool_call_id", "required for a tool message")
            if not isinstance(call_id, str):
                raise ToolRequestError(f"{where}.tool_call_id", "must be a string")
            if call_id not in call_ids:
                raise ToolRequestError(f"{where}.tool_call_id",
                                       f"{clipped(repr(call_id))} answers no earlier tool call")


def _check_message_call(call, where: str) -> str:
    if not isinstance(call, dict):
        raise ToolRequestError(where, "must be an object")
    if not isinstance(call.get("id"), str):
        raise ToolRequestError(f"{where}.id", "must be a string")
    if not _CALL_ID.fullmatch(call["id"]):
        raise ToolRequestError(f"{where}.id", "must be 1 to 256 letters, digits, '_', '-', '.' or ':'")
    if call.get("type", "function") != "function":
        raise ToolRequestError(f"{where}.type", "must be 'function'")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError(f"{where}.function", "must be an object with a string 'name'")
    if not _NAME.fullmatch(function["name"]):
        raise ToolRequestError(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise ToolRequestError(f"{where}.function.arguments", "must be a string (a JSON object)")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ToolRequestError(f"{where}.function.arguments", "not a JSON object")
    return call["id"]


def _known_keys(obj: dict, known: set[str], where: str) -> None:
    unknown = [key for key in obj if key not in known]
    if unknown:
        raise ToolRequestError(f"{where}.{clipped(min(unknown))}", "unknown field")


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
