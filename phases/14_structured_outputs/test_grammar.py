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

import asyncio
import json
import re
import threading
import time

import pytest

from engine.llm_engine import DEFAULT_MODEL_DIR, _load_tokenizer
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutputError, StructuredSpec, spec_from_request

VOCAB = 8192  # the demo model's

SCHEMAS = {
    "nested objects": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "name": {"type": "string", "maxLength": 8}},
                 "required": ["id", "name"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array bounds": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                     "minItems": 2, "maxItems": 4},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": [1, 2.5, "XL", None]}},
              "required": ["color", "size"]},
    "integer bounds": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "string", "pattern": "^[a-c]{1,3}$"},
                        {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}]},
    "optional keys": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "b": {"type": "boolean"}, "c": {"type": "null"}},
                      "required": ["b"]},
    "string patterns": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["zip", "code"]},
    "string lengths": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 6}, "maxItems": 3},
    "number bounds": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["x"]},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "required": ["n"], "properties": {
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}},
}
PATHOLOGICAL_DEPTH = 6  # nested anyOf of arrays / objects: 52 KB of schema, ~0.6 s to compile on one core


@pytest.fixture(scope="module")
def tokenizer():
    return _load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def compiler(tokenizer, eos):
    compiler = GrammarCompiler(tokenizer, VOCAB, [eos])
    yield compiler
    compiler.close()


@pytest.fixture
def make_compiler(tokenizer, eos):
    """Fresh compilers (own cache and workers) whose compiles are counted: ``compiler.calls``
    lists the specs compiled, ``compiler.finished`` is set after each compile ends."""
    made = []

    def make(**kwargs):
        compiler = GrammarCompiler(tokenizer, VOCAB, [eos], **kwargs)
        compiler.calls, compiler.finished = [], threading.Event()
        compile_now = compiler._compile_now

        def counted(spec):
            compiler.calls.append(spec)
            try:
                return compile_now(spec)
            finally:
                compiler.finished.set()
        compiler._compile_now = counted
        made.append(compiler)
        return compiler
    yield make
    for compiler in made:
        compiler.close()


def schema_spec(schema: dict) -> StructuredSpec:
    return spec_from_request({"structured_outputs": {"json": schema}})


def pathological_schema(depth: int = PATHOLOGICAL_DEPTH) -> dict:
    """Each level refers to the one below three times, inline: the schema and its compile
    grow by ~3x (~6x in time) per level."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "array", "items": schema, "maxItems": 3},
                            {"type": "object", "properties": {"a": schema, "b": schema}}]}
    return schema


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


# --- compiling -------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "The parenthesis is not closed"),
    ({"structured_outputs": {"regex": r"\bword"}}, "structured_outputs.regex", "Word boundary is not supported"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", 'Rule "foo" is not defined'),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar", '"root" is not found'),
    # valid JSON Schemas (jsonschema accepts them) that xgrammar refuses
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema",
     "Lookbehind is not supported"),
    ({"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}, "structured_outputs.json",
     "Cannot find field '$defs'"),
])
def test_a_spec_xgrammar_refuses_is_an_error_naming_its_field(compiler, body, param, message):
    spec = spec_from_request(body)
    for _ in range(2):  # the second answer comes from the cache
        with pytest.raises(StructuredOutputError, match=re.escape(message)) as caught:
            compiler.compile(spec)
        assert caught.value.param == param
        assert "/project/" not in str(caught.value)  # xgrammar's source location is stripped


def test_a_cached_spec_returns_the_same_grammar_at_once(make_compiler):
    compiler = make_compiler()
    spec = schema_spec(SCHEMAS["nested objects"])
    start = time.perf_counter()
    first = compiler.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    second = compiler.compile(spec)
    cached = time.perf_counter() - start
    assert second is first and asyncio.run(compiler.compile_async(spec)) is first
    assert compiler.calls == [spec]
    assert cached < min(cold, 0.01)
    # an equal spec from the other request field shares the entry (the param is not part of it)
    assert compiler.compile(spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMAS["nested objects"]}}})) is first


def test_the_cache_is_bounded_least_recently_used_first(make_compiler):
    compiler = make_compiler(cache_size=2)
    a, b, c = (StructuredSpec("regex", r) for r in ("a+", "b+", "c+"))
    grammar_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is grammar_a  # a is now the most recent; c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is grammar_a
    compiler.compile(b)
    assert compiler.calls == [a, b, c, b]


def test_concurrent_requests_for_one_spec_compile_it_once(make_compiler):
    compiler = make_compiler(workers=2)
    spec = schema_spec(pathological_schema(4))  # slow enough (~50 ms) for the requests to overlap
    results, gate = [], threading.Barrier(8)

    def request():
        gate.wait()
        results.append(compiler.compile(spec))
    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results)

    async def requests():
        other = StructuredSpec("regex", "[0-9]{4}")
        return await asyncio.gather(*(compiler.compile_async(s) for s in [other] * 8 + [spec]))
    grammars = asyncio.run(requests())
    assert all(g is grammars[0] for g in grammars[:8]) and grammars[8] is results[0]
    assert [s.kind for s in compiler.calls] == ["json_schema", "regex"]


def test_a_pathological_schema_hits_the_time_limit_and_stays_refused(make_compiler):
    """The request waits no longer than the limit; the compile finishes in the background, ran
    past the limit itself, so the spec is cached as refused: asked again, it is refused at once
    and compiled no more. The worker is then free for other specs."""
    compiler = make_compiler(workers=1, timeout_s=0.02)
    spec = schema_spec(pathological_schema())
    start = time.perf_counter()
    with pytest.raises(StructuredOutputError, match="compiling the grammar took longer than 0.02 s") as caught:
        compiler.compile(spec)
    waited = time.perf_counter() - start
    assert caught.value.param == "structured_outputs.json"
    assert compiler.finished.wait(120)
    assert waited < time.perf_counter() - start  # the request did not wait for the compile to end
    for _ in range(3):
        with pytest.raises(StructuredOutputError, match="took longer than 0.02 s"):
            compiler.compile(spec)
    assert compiler.calls == [spec]
    compiler.timeout_s = 30.0
    assert compiler.compile(StructuredSpec("regex", "ok")) is not None


def test_a_flood_of_one_pathological_schema_takes_one_worker_once(make_compiler):
    compiler = make_compiler(workers=2, timeout_s=0.02)
    spec = schema_spec(pathological_schema())
    errors = []

    def request():
        try:
            compiler.compile(spec)
        except StructuredOutputError as e:
            errors.append(e)
    threads = [threading.Thread(target=request) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 10 and compiler.calls == [spec]
    assert compiler.finished.wait(120)
    assert compiler.calls == [spec]


def test_a_compile_given_up_while_queued_is_cancelled_and_not_refused(make_compiler):
    """One worker busy with a pathological schema: a request queued behind it times out, its
    compile never starts, and the spec is not held against it (it was only queued)."""
    compiler = make_compiler(workers=1, timeout_s=0.02)
    slow, queued = schema_spec(pathological_schema()), StructuredSpec("regex", "[a-z]+")
    for spec in (slow, queued):
        with pytest.raises(StructuredOutputError, match="took longer"):
            compiler.compile(spec)
    assert compiler.finished.wait(120)
    compiler.timeout_s = 30.0
    later = StructuredSpec("regex", "[0-9]+")
    assert compiler.compile(later) is not None  # queued after the given-up one: the worker skipped it
    assert compiler.compile(queued) is not None
    assert compiler.calls == [slow, later, queued]


def test_the_async_wait_leaves_the_event_loop_running(make_compiler):
    compiler = make_compiler(workers=1, timeout_s=0.2)
    spec = schema_spec(pathological_schema())

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)
        ticker = asyncio.create_task(tick())
        with pytest.raises(StructuredOutputError, match="took longer than 0.2 s"):
            await compiler.compile_async(spec)
        ticker.cancel()
        return ticks
    assert asyncio.run(main()) >= 10
    assert compiler.finished.wait(120)


def test_an_unexpected_compile_failure_reaches_the_caller_and_is_not_cached(make_compiler):
    compiler = make_compiler()
    spec = StructuredSpec("regex", "x")
    compile_now = compiler._compile_now
    compiler._compile_now = lambda s: {}["boom"]
    with pytest.raises(KeyError):
        compiler.compile(spec)
    compiler._compile_now = compile_now
    assert compiler.compile(spec) is not None
