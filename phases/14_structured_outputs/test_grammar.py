"""Structured outputs below the engine: request specs, grammar compilation (xgrammar, off the
caller's thread, cached, time-limited) and the token bitmask that constrains sampling.

Generation is driven by random logits over the shipped demo model's tokenizer (8192 tokens):
fill the mask, mask the logits, sample (seeded multinomial, or argmax), accept the token, until
the grammar accepts EOS. The decoded text is then checked by an independent judge (``json`` +
``jsonschema``, ``re.fullmatch``, membership, a recursive-descent parser), so a mask that lets
one wrong token through fails. ``python phases/14_structured_outputs/test_grammar.py`` prints
cold and cached compile times as JSON.
"""
from __future__ import annotations

import json
import re

import pytest

from engine.structured.spec import StructuredOutputError, StructuredSpec, spec_from_request


def schema_spec(schema: dict) -> StructuredSpec:
    return spec_from_request({"structured_outputs": {"json": schema}})


# --- request specs ---------------------------------------------------------------------------

def test_a_request_without_a_constraint_has_no_spec():
    assert spec_from_request({}) is None
    assert spec_from_request({"response_format": {"type": "text"}}) is None
    assert spec_from_request({"response_format": None, "structured_outputs": None}) is None


def test_specs_are_canonical_hashable_and_keyed():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    from_openai = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}})
    from_vllm = spec_from_request({"structured_outputs": {"json": json.dumps(schema, indent=4)}})
    assert from_openai == from_vllm and hash(from_openai) == hash(from_vllm) and from_openai.key == from_vllm.key
    assert from_openai.value == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    assert (from_openai.param, from_vllm.param) == ("response_format.json_schema.schema", "structured_outputs.json")
    assert len({from_openai, from_vllm}) == 1
    # key order is part of the spec: it orders the output's keys
    reordered = schema_spec({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    assert reordered.key != from_openai.key
    assert spec_from_request({"response_format": {"type": "json_object"}}) == StructuredSpec("json_object", "")
    assert spec_from_request({"structured_outputs": {"choice": ["a", "é"]}}).value == '["a","é"]'
    assert spec_from_request({"structured_outputs": {"regex": "a+", "json": None, "disable_fallback": False}}) == \
        StructuredSpec("regex", "a+")
    assert len({StructuredSpec(k, "x").key for k in ("regex", "grammar")}) == 2
    with pytest.raises(ValueError, match="kind"):
        StructuredSpec("xml", "")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}},
     "response_format.json_schema.name", "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema at type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"minimum": "zero"}}}}}},
     "response_format.json_schema.schema", "at properties/a/minimum"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON Schema object"),
    ({"structured_outputs": {"json": {"required": "a"}}}, "structured_outputs.json", "not a valid JSON Schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": ["a"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty array of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "non-empty array of strings"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "non-empty array of strings"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "non-empty string"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_a_bad_spec_names_its_field(body, param, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)) as caught:
        spec_from_request(body)
    assert caught.value.param == param
