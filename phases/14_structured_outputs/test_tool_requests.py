"""Tool fields of a chat request (engine/server/tools.py): every bad field is an error naming it;
the schema a forced tool choice enforces takes exactly the calls of the chosen functions, and a
call written to it reads back through the parser; messages reach the template with parsed arguments."""
import copy
import json
import re

import pytest
from jsonschema import Draft202012Validator

from engine.server.tool_parsers import tool_parser
from engine.server.tools import ToolRequest, ToolRequestError, call_schema, messages_for_template, validate_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "get_time"}}
# a pydantic-style schema: its $refs point into its own $defs
BOOK = {"type": "function", "function": {"name": "book-trip", "strict": True, "parameters": {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}, "stops": {"type": "array",
                                                                                "items": {"$ref": "#/$defs/Place"}}},
    "required": ["to"], "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"], "additionalProperties": False}}}}}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def body(**fields) -> dict:
    return {"messages": copy.deepcopy(MESSAGES), "tools": [WEATHER, NOW]} | fields


def test_a_valid_request_and_the_defaults():
    assert validate_tools(body()) == ToolRequest([WEATHER, NOW], "auto", None, True)
    assert validate_tools({"messages": MESSAGES}) == ToolRequest([], "none", None, True)
    assert validate_tools(body(tool_choice={"type": "function", "function": {"name": "get_time"}},
                               parallel_tool_calls=False)) == ToolRequest([WEATHER, NOW], "required", "get_time", False)
    assert validate_tools(body(tools=None, tool_choice="none")).tool_choice == "none"


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f"} | function}


@pytest.mark.parametrize("fields, message", [
    ({"tools": {"a": 1}}, "tools: must be an array"),
    ({"tools": [WEATHER, "f"]}, "tools[1]: must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type: must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0].extra: unknown field"),
    ({"tools": [{"type": "function"}]}, "tools[0].function: must be an object"),
    ({"tools": [tool(name="get weather")]}, "tools[0].function.name: must be 1 to 64 letters"),
    ({"tools": [tool(name="x" * 65)]}, "tools[0].function.name: must be 1 to 64 letters"),
    ({"tools": [tool(name=7)]}, "tools[0].function.name: must be 1 to 64 letters"),
    ({"tools": [WEATHER, NOW, WEATHER]}, "tools[2].function.name: 'get_weather' names two tools"),
    ({"tools": [tool(description=1)]}, "tools[0].function.description: must be a string"),
    ({"tools": [tool(strict="yes")]}, "tools[0].function.strict: must be a boolean"),
    ({"tools": [tool(returns={})]}, "tools[0].function.returns: unknown field"),
    ({"tools": [NOW, tool(parameters={"type": "objekt"})]}, "tools[1].function.parameters: not a JSON schema: "),
    ({"tools": [tool(parameters={"type": "object", "required": "city"})]},
     "tools[0].function.parameters: not a JSON schema: 'city' is not of type 'array'"),
    ({"tools": [tool(parameters=[])]}, "tools[0].function.parameters: must be a JSON schema object"),
    ({"tools": [tool(parameters={"type": "string"})]}, "tools[0].function.parameters: must be a JSON schema of type"),
    ({"tool_choice": "any"}, "tool_choice: must be 'none', 'auto', 'required' or"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice: unknown function 'x'"),
    ({"tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice: must be 'none', 'auto', 'required'"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time", "x": 1}}},
     "tool_choice.function.x: unknown field"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice: unknown function 'get_time'"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls: must be a boolean"),
])
def test_a_bad_tool_field_is_an_error_naming_it(fields, message):
    with pytest.raises(ToolRequestError) as e:
        validate_tools(body(**fields))
    assert str(e.value).startswith(message), str(e.value)
    assert isinstance(e.value, ValueError) and str(e.value).startswith(e.value.param + ": ")


def with_message(index: int, message: dict) -> list[dict]:
    messages = copy.deepcopy(MESSAGES)
    messages[index] = message
    return messages


@pytest.mark.parametrize("messages, message", [
    (with_message(2, {"role": "tool", "content": "18 C"}), "messages[2].tool_call_id: required for a tool message"),
    (with_message(2, {"role": "tool", "tool_call_id": 1, "content": "x"}),
     "messages[2].tool_call_id: must be a string"),
    (with_message(2, {"role": "tool", "tool_call_id": "call_9", "content": "x"}),
     "messages[2].tool_call_id: 'call_9' answers no earlier tool call"),
    (MESSAGES[2:], "messages[0].tool_call_id: 'call_1' answers no earlier tool call"),
    (with_message(1, {"role": "assistant", "tool_calls": {"id": "call_1"}}),
     "messages[1].tool_calls: must be an array"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}), "messages[1].tool_calls[0].id: must be a string"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"arguments": "{}"}}]}),
     "messages[1].tool_calls[0].function: must be an object with a string 'name'"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "code", "function": {
        "name": "f", "arguments": "{}"}}]}), "messages[1].tool_calls[0].type: must be 'function'"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {
        "name": "f", "arguments": {"city": "Paris"}}}]}),
     "messages[1].tool_calls[0].function.arguments: must be a string (a JSON object)"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {
        "name": "f", "arguments": '{"city": '}}]}), "messages[1].tool_calls[0].function.arguments: not a JSON object"),
    (with_message(1, {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {
        "name": "f", "arguments": "[1]"}}]}), "messages[1].tool_calls[0].function.arguments: not a JSON object"),
])
def test_a_bad_tool_message_is_an_error_naming_it(messages, message):
    with pytest.raises(ToolRequestError, match="^" + re.escape(message)):
        validate_tools(body(messages=messages))


def valid(schema: dict, instance) -> bool:
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema).is_valid(instance)


def test_a_named_function_forces_its_call():
    schema = call_schema(validate_tools(body(tool_choice={"type": "function", "function": {"name": "get_weather"}})))
    assert list(schema["properties"]) == ["name", "arguments"]  # the parsers read the name first
    assert valid(schema, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
    assert not valid(schema, {"name": "get_time", "arguments": {}})
    assert not valid(schema, {"name": "get_weather", "arguments": {"unit": "celsius"}})  # city required
    assert not valid(schema, {"name": "get_weather", "arguments": {"city": "Paris", "when": "now"}})
    assert not valid(schema, {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"})
    assert not valid(schema, {"name": "get_weather"})


def test_required_forces_a_call_of_any_tool():
    schema = call_schema(validate_tools(body(tools=[WEATHER, NOW, BOOK], tool_choice="required")))
    assert valid(schema, {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert valid(schema, {"name": "get_time", "arguments": {}})
    assert not valid(schema, {"name": "get_time", "arguments": {"tz": "UTC"}})  # no parameters: the empty object
    assert valid(schema, {"name": "book-trip", "arguments": {"to": {"city": "Rome"}, "stops": [{"city": "Pisa"}]}})
    assert not valid(schema, {"name": "book-trip", "arguments": {"to": {"city": "Rome"}, "stops": [{"town": "P"}]}})
    assert not valid(schema, {"name": "search", "arguments": {}})
    assert call_schema(validate_tools(body(tool_choice="auto"))) is None
    assert call_schema(validate_tools(body(tool_choice="none"))) is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_forced_call_reads_back_through_the_parser(parser):
    """What the engine makes the model write (the parser's prefix, an instance of the schema with
    its arguments key, the suffix) is one call for the whole and the streaming parse."""
    p = tool_parser(parser)
    schema = call_schema(validate_tools(body(tools=[WEATHER, BOOK], tool_choice="required")), p.arguments_key)
    call = {"name": "book-trip", p.arguments_key: {"to": {"city": "Rome"}}}
    assert valid(schema, call)
    text = p.call_prefix + json.dumps(call, indent=2) + p.call_suffix
    content, calls = p.extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("book-trip", '{"to":{"city":"Rome"}}')]
    stream = p.stream()
    deltas = stream.feed(text) + stream.finish()
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"to":{"city":"Rome"}}'


def test_messages_reach_the_template_with_parsed_arguments():
    rendered = messages_for_template(MESSAGES)
    assert rendered[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert rendered[0] == MESSAGES[0] and rendered[2] == MESSAGES[2]
    assert MESSAGES[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed
