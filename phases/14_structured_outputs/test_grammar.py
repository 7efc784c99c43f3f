"""Structured outputs below the engine: request specs, grammar compilation (xgrammar, tried in
worker processes, cached, time-limited; the pool's own behaviour is in test_compile_workers.py)
and the token bitmask that constrains sampling.

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

import jsonschema
import pytest
import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.tokenizer import load_tokenizer
from engine.scheduling.structured.compiler import GrammarCompiler
from engine.scheduling.structured.matchers import GrammarMatchers, apply_bitmask
from engine.scheduling.structured.spec import StructuredOutputError, StructuredSpec, spec_from_request
from grammar_cases import VOCAB, counted_compilers, schema_spec, slow_spec

SEEDS = range(20)

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
REGEXES = [r"[a-z]{2,5}-\d{3}", r"(foo|bar)+baz", r"[A-Za-z0-9._]{1,10}@[a-z]{2,8}\.(com|org)", r"(αβ|γ)x?[0-9]{2}"]
CHOICES = ["", 'say "hi"', "back\\slash", ".*+?[](){}|^$", "line\nbreak\ttab", "é€😀 ünïcödé", "\x01",
           "  spaced  ", "plain"]
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""
PATHOLOGICAL_DEPTH = 6  # nested anyOf of arrays / objects: 52 KB of schema, 0.2-0.6 s to compile on one core


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def compiler(tokenizer, eos):
    compiler = GrammarCompiler(tokenizer, VOCAB, [eos])
    yield compiler
    compiler.close()


@pytest.fixture
def make_compiler(tokenizer):
    yield from counted_compilers(tokenizer)


def pathological_schema(depth: int = PATHOLOGICAL_DEPTH) -> dict:
    """Each level refers to the one below three times, inline: the schema and its compile
    grow by ~3x (~6x in time) per level."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "array", "items": schema, "maxItems": 3},
                            {"type": "object", "properties": {"a": schema, "b": schema}}]}
    return schema


def allowed(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> set[int]:
    """The tokens whose bit is set in ``bitmask[row]``, read bit by bit."""
    words = bitmask[row].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def generate(compiled, seed: int, greedy: bool, eos: int, bias: torch.Tensor | None = None,
             budget: int = 512) -> list[int]:
    """Output tokens (EOS excluded) sampled from random logits under ``compiled``'s mask; fails if
    the grammar refuses a sampled token, terminates on a token other than EOS, or runs past
    ``budget`` tokens. ``bias`` is added to every step's logits."""
    matchers = GrammarMatchers(VOCAB)
    matchers.add("r", compiled)
    bitmask = matchers.allocate(1)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(budget):
        matchers.fill([(0, "r")], bitmask)
        logits = torch.randn(1, VOCAB, generator=generator)
        if bias is not None:
            logits += bias
        apply_bitmask(logits, bitmask, [0])
        token = int(logits.argmax() if greedy else torch.multinomial(logits.softmax(-1), 1, generator=generator))
        assert matchers.accept("r", [token]), f"the grammar refused token {token}, which its mask allowed"
        if matchers.is_terminated("r"):
            assert token == eos
            return out
        out.append(token)
    pytest.fail(f"no EOS within {budget} tokens")


def outputs(compiled, tokenizer, eos, bias=None) -> list[str]:
    return [tokenizer.decode(generate(compiled, seed, greedy, eos, bias)) for seed in SEEDS for greedy in (False, True)]


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
     "response_format.json_schema.schema", "not a valid JSON Schema: at type"),
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


def test_the_cache_is_bounded_least_recently_used_first(make_compiler, tokenizer, eos):
    a, b, c = (StructuredSpec("regex", r) for r in ("a+", "b+", "c+"))
    size = make_compiler().compile(a).memory_size_bytes  # the three grammars have one shape, one size
    compiler = make_compiler(cache_bytes=int(2.5 * size))  # room for two
    grammar_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is grammar_a  # a is now the most recent; c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is grammar_a
    compiler.compile(b)
    assert compiler.calls == [a, b, c, b]


def test_concurrent_requests_for_one_spec_compile_it_once(make_compiler):
    """Requests for one spec join the job queued or running for it, or find it cached: it is
    compiled once, and every request gets the same grammar."""
    compiler = make_compiler(workers=2)
    spec = schema_spec(pathological_schema(4))
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
        return await asyncio.gather(*(compiler.compile_async(s, client=f"c{i % 3}")
                                      for i, s in enumerate([other] * 8 + [spec])))
    grammars = asyncio.run(requests())
    assert all(g is grammars[0] for g in grammars[:8]) and grammars[8] is results[0]
    assert [s.kind for s in compiler.calls] == ["json_schema", "regex"]


def test_a_flood_of_one_slow_schema_takes_one_worker_once(make_compiler):
    compiler = make_compiler(workers=2, timeout_s=1.0)
    spec = slow_spec("flood")
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
    assert len(errors) == 10 and all("took longer than 1 s" in str(e) for e in errors)
    assert compiler.calls == [spec]


def test_a_queued_compile_nobody_waits_for_is_dropped_and_not_refused(make_compiler):
    """One worker busy with a slow schema: a request queued behind it is cancelled (its client
    left), so its compile never starts, and the spec is not held against it; the request queued
    after it runs next."""
    compiler = make_compiler(workers=1, timeout_s=1.0)
    slow, dropped, later = slow_spec("busy"), StructuredSpec("regex", "[a-z]+"), StructuredSpec("regex", "[0-9]+")

    async def main():
        busy = asyncio.create_task(compiler.compile_async(slow))
        gone = asyncio.create_task(compiler.compile_async(dropped))
        await asyncio.sleep(0)  # both requests are queued (the tasks ran to their first wait)
        gone.cancel()
        grammar = await compiler.compile_async(later)
        with pytest.raises(StructuredOutputError, match="took longer than 1 s"):
            await busy
        with pytest.raises(asyncio.CancelledError):
            await gone
        return grammar
    assert asyncio.run(main()) is not None
    assert compiler.calls == [slow, later]  # the worker skipped the dropped one
    assert compiler.compile(dropped) is not None
    assert compiler.calls == [slow, later, dropped]


def test_the_async_wait_leaves_the_event_loop_running(make_compiler):
    compiler = make_compiler(workers=1, timeout_s=1.0)
    spec = slow_spec("loop")  # the compile outlasts the limit: the wait is the limit's 1 s on any host

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)  # one loop iteration a tick: thousands in the wait, 0-1 if it blocks
        ticker = asyncio.create_task(tick())
        with pytest.raises(StructuredOutputError, match="took longer than 1 s"):
            await compiler.compile_async(spec)
        ticker.cancel()
        return ticks
    assert asyncio.run(main()) >= 5


def test_an_unexpected_compile_failure_reaches_the_caller_and_is_not_cached(make_compiler):
    """A failure that is not xgrammar refusing the spec (here a tool_call spec without its
    prefix, which no request parses to) is an error for its callers, tried again when asked again."""
    compiler = make_compiler()
    spec = StructuredSpec("tool_call", '{"schema": {}}')
    for _ in range(2):
        with pytest.raises(RuntimeError, match="compiling the grammar failed: KeyError: 'prefix'"):
            compiler.compile(spec)
    assert compiler.calls == [spec, spec]
    assert compiler.compile(StructuredSpec("regex", "x")) is not None


def test_a_completed_grammar_allows_exactly_the_stop_tokens(tokenizer, eos):
    """Two stop tokens and a model vocabulary 40 ids wider than the tokenizer's: the padding ids
    are never allowed, and once the grammar is complete only the stop ids are."""
    vocab = VOCAB + 40
    compiler = GrammarCompiler(tokenizer, vocab, {eos, 7})
    try:
        matchers = GrammarMatchers(vocab)
        matchers.add("r", compiler.compile(StructuredSpec("json_object", "")))
        bitmask = matchers.allocate(1)
        matchers.fill([(0, "r")], bitmask)
        assert not allowed(bitmask, 0, vocab) & set(range(VOCAB, vocab))
        assert matchers.accept("r", tokenizer.encode('{"a": [1, 2]}'))
        matchers.fill([(0, "r")], bitmask)
        assert allowed(bitmask, 0, vocab) == {eos, 7}
        assert matchers.accept("r", [7]) and matchers.is_terminated("r")
        with pytest.raises(ValueError, match="vocabulary of 8232"):
            GrammarMatchers(VOCAB).add("r", compiler.compile(StructuredSpec("regex", "a")))
    finally:
        compiler.close()


# --- generation under the mask ---------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMAS)
def test_generated_json_validates_against_its_schema(compiler, tokenizer, eos, name):
    schema = SCHEMAS[name]
    texts = outputs(compiler.compile(schema_spec(schema)), tokenizer, eos)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    if name == "optional keys":  # the optional keys are really optional
        assert {"a" in json.loads(t) for t in texts} == {True, False}


def test_a_length_bounded_string_refuses_raw_control_characters(compiler, tokenizer):
    """xgrammar 0.2.9 lets raw control characters into strings with minLength / maxLength
    (mlc-ai/xgrammar#800); the compiler closes that hole. Unbounded strings never had it."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}, "t": {"type": "string"}},
              "required": ["s", "t"]}
    matchers = GrammarMatchers(VOCAB)
    for i, text in enumerate(('{"s": "a\tb', '{"s": "a\x14', '{"s": "ab", "t": "\t')):
        matchers.add(i, compiler.compile(schema_spec(schema)))
        assert not matchers.accept(i, tokenizer.encode(text)), repr(text)
    matchers.add("ok", compiler.compile(schema_spec(schema)))
    assert matchers.accept("ok", tokenizer.encode('{"s": "é€😀 xyz~", "t": "a\\tb\\u0014"}'))


def test_generated_keys_follow_the_schemas_order(compiler, tokenizer, eos):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"]}
    for text in outputs(compiler.compile(schema_spec(schema)), tokenizer, eos):
        assert list(json.loads(text)) == ["zeta", "alpha"]


def test_json_object_generates_objects(compiler, tokenizer, eos):
    """Strings close on a token containing a quote; those get a +4 bias so that random strings end."""
    bias = torch.tensor([4.0 if '"' in tokenizer.decode([t]) else 0.0 for t in range(VOCAB)])
    texts = outputs(compiler.compile(spec_from_request({"response_format": {"type": "json_object"}})),
                    tokenizer, eos, bias)
    assert all(isinstance(json.loads(t), dict) for t in texts)
    assert any(json.loads(t) for t in texts)  # not only {}


@pytest.mark.parametrize("pattern", REGEXES)
def test_generated_text_matches_its_regex(compiler, tokenizer, eos, pattern):
    for text in outputs(compiler.compile(spec_from_request({"structured_outputs": {"regex": pattern}})),
                        tokenizer, eos):
        assert re.fullmatch(pattern, text), text


def test_generated_text_is_one_of_the_choices(compiler, tokenizer, eos):
    compiled = compiler.compile(spec_from_request({"structured_outputs": {"choice": CHOICES}}))
    texts = outputs(compiled, tokenizer, eos)
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    matchers = GrammarMatchers(VOCAB)
    for i, choice in enumerate(CHOICES):  # each choice, as the tokenizer encodes it, is accepted whole
        matchers.add(i, compiled)
        assert matchers.accept(i, tokenizer.encode(choice) + [eos]) and matchers.is_terminated(i), repr(choice)
    matchers.add("prefix", compiled)
    assert matchers.accept("prefix", tokenizer.encode("plai")) and not matchers.accept("prefix", [eos])


def parse_arithmetic(text: str) -> bool:
    """Whether ``text`` is in ARITHMETIC's language (recursive descent)."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        digits = re.match(r"0|[1-9][0-9]{0,2}", text[pos:])
        pos += digits.end() if digits else 0
        return digits is not None
    return expr() and pos == len(text)


def test_generated_text_parses_with_its_grammar(compiler, tokenizer, eos):
    assert parse_arithmetic("1+(22-(333))") and not parse_arithmetic("1+") and not parse_arithmetic("01")
    texts = outputs(compiler.compile(spec_from_request({"structured_outputs": {"grammar": ARITHMETIC}})),
                    tokenizer, eos)
    assert all(parse_arithmetic(t) for t in texts), texts
    assert any("(" in t for t in texts)


# --- matchers and masks ----------------------------------------------------------------------

def test_a_refused_token_leaves_its_request_and_the_others_untouched(compiler, tokenizer):
    compiled = compiler.compile(schema_spec(SCHEMAS["nested objects"]))
    matchers = GrammarMatchers(VOCAB)
    prefix = tokenizer.encode('{"user": {"id": 1')
    for request_id in ("bad", "good"):
        matchers.add(request_id, compiled)
        assert matchers.accept(request_id, prefix)
    assert not matchers.accept("bad", tokenizer.encode("x"))
    # two acceptable tokens, then one refused: the call accepts none of them
    assert not matchers.accept("bad", tokenizer.encode("2") + tokenizer.encode(', "name"') + tokenizer.encode("}"))
    matchers.add("fresh", compiled)
    assert matchers.accept("fresh", prefix)
    bitmask = matchers.allocate(3)
    matchers.fill([(0, "bad"), (1, "good"), (2, "fresh")], bitmask)
    assert torch.equal(bitmask[0], bitmask[2]) and torch.equal(bitmask[1], bitmask[2])
    assert matchers.accept("bad", tokenizer.encode('2, "name": "x"}, "active": true}') + [0])
    assert matchers.is_terminated("bad") and not matchers.is_terminated("good")
    matchers.remove("bad")
    matchers.remove("bad")  # a no-op
    with pytest.raises(KeyError):
        matchers.accept("bad", [1])
    with pytest.raises(ValueError, match="already has a grammar"):
        matchers.add("good", compiled)


def test_masks_of_requests_in_one_bitmask_never_mix(compiler, tokenizer):
    """Rows filled together equal each request's mask filled alone; rows not named keep what
    they held."""
    grammars = [compiler.compile(spec) for spec in (
        schema_spec(SCHEMAS["enums"]), StructuredSpec("regex", REGEXES[0]), StructuredSpec("choice", '["yes","no"]'))]
    matchers = GrammarMatchers(VOCAB)
    for i, grammar in enumerate(grammars):
        matchers.add(i, grammar)
    assert matchers.accept(0, tokenizer.encode('{"color": "'))
    assert matchers.accept(1, tokenizer.encode("ab"))
    together = matchers.allocate(5)
    together[3] = 12345
    rows = [(4, 0), (0, 2), (2, 1)]
    matchers.fill(rows, together)
    for row, request_id in rows:
        alone = matchers.allocate(1)
        matchers.fill([(0, request_id)], alone)
        assert torch.equal(together[row], alone[0])
    assert len({frozenset(allowed(together, row)) for row, _ in rows}) == 3
    assert (together[1] == -1).all() and (together[3] == 12345).all()


def mask_truth(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``apply_bitmask`` by a loop over the bits."""
    expected = logits.clone()
    for r in rows:
        words = bitmask[r].tolist()
        for t in range(logits.shape[1]):
            if not (words[t // 32] >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_equals_the_loop_over_bits(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [3, 0, 5]  # 1000 is not a multiple of 32: the last word is partly used
    base = torch.randn(6, vocab + 24, generator=generator).to(dtype)
    logits = base[:, :vocab]  # a view with unit stride along V, row stride vocab + 24
    bitmask = torch.randint(-2**31, 2**31, (8, (vocab + 31) // 32), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[5] = -1  # every token allowed
    expected = mask_truth(logits, bitmask, rows)
    untouched = base[:, vocab:].clone()
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.equal(base[:, vocab:], untouched)
    apply_bitmask(logits, bitmask, [])  # no rows: nothing happens
    assert torch.equal(logits, expected)


def test_apply_bitmask_refuses_a_mismatched_bitmask():
    logits = torch.zeros(2, 100)
    for bad in (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32),
                torch.zeros(4, 2, dtype=torch.int32).t()):
        with pytest.raises(ValueError, match="bitmask must be"):
            apply_bitmask(logits, bad, [0])
    with pytest.raises(ValueError, match="unit stride"):
        apply_bitmask(torch.zeros(100, 2).t(), torch.zeros(2, 4, dtype=torch.int32), [0])
    for rows in ([2], [-1], [0, 3]):
        with pytest.raises(ValueError, match="rows must index both"):
            apply_bitmask(logits, torch.zeros(4 if rows == [2] else 2, 4, dtype=torch.int32), rows)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_on_cuda_equals_the_loop_over_bits(dtype):
    """xgrammar's Triton kernel on the engine's logits dtypes, against the loop on the host."""
    generator = torch.Generator().manual_seed(1)
    vocab, rows = 151_936, [0, 2, 7]  # Qwen's padded vocabulary; rows not sorted, some left out
    logits = torch.randn(8, vocab, generator=generator).to(dtype)
    bitmask = torch.randint(-2**31, 2**31, (8, (vocab + 31) // 32), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    keep = torch.zeros(8, vocab, dtype=torch.bool)
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1  # [8, W, 32], bit t % 32 of word t // 32
    keep[rows] = bits.reshape(8, -1)[rows, :vocab].bool()
    expected = torch.where(keep | ~torch.isin(torch.arange(8), torch.tensor(rows))[:, None], logits,
                           torch.tensor(float("-inf"), dtype=dtype))
    assert torch.equal(mask_truth(logits[:, :300], bitmask, rows), expected[:, :300])  # the vector form is the loop
    on_device = logits.cuda()
    apply_bitmask(on_device, bitmask.cuda(), rows)
    assert torch.equal(on_device.cpu(), expected)


def compile_timings(tokenizer, eos) -> dict:
    """Milliseconds to compile each kind of spec cold (a fresh compiler) and again (the cache)."""
    specs = {"json_schema (nested objects)": schema_spec(SCHEMAS["nested objects"]),
             "json_schema (array of objects)": schema_spec(SCHEMAS["array of objects"]),
             "json_object": StructuredSpec("json_object", ""), "regex": StructuredSpec("regex", REGEXES[2]),
             "choice": spec_from_request({"structured_outputs": {"choice": CHOICES}}),
             "grammar": StructuredSpec("grammar", ARITHMETIC),
             f"pathological (depth {PATHOLOGICAL_DEPTH})": schema_spec(pathological_schema())}
    compiler = GrammarCompiler(tokenizer, VOCAB, [eos], timeout_s=60.0)
    timings = {}
    try:
        for name, spec in specs.items():
            cold = time.perf_counter()
            compiler.compile(spec)
            cached = time.perf_counter()
            compiler.compile(spec)
            timings[name] = {"cold_ms": round((cached - cold) * 1e3, 3),
                             "cached_ms": round((time.perf_counter() - cached) * 1e3, 4)}
    finally:
        compiler.close()
    return timings


if __name__ == "__main__":
    _tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    print(json.dumps({"vocab": VOCAB, "timings": compile_timings(_tokenizer, _tokenizer.eos_token_id)}, indent=1))


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_a_forced_tool_call_parses_and_validates(compiler, tokenizer, eos, parser_name, choice):
    """``tool_choice`` ``required`` or a named function: the ``tool_call`` spec (the parser's call
    prefix, the call object's schema, its suffix) makes every output one call that the same
    parser reads whole, naming a tool of the request, its arguments valid for its parameters."""
    from agent_cases import TOOLS
    from engine.entrypoints.server.openai_types import ChatRequest
    from engine.entrypoints.server.request_body import RequestLimits
    from engine.entrypoints.server.request_model import validated
    from engine.entrypoints.server.tool_parsers import tool_parser
    from engine.entrypoints.server.tools import call_schema, validate_tools
    from engine.scheduling.structured.spec import tool_call_spec

    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": choice if choice == "required" else {"type": "function", "function": {"name": choice}}}
    parser = tool_parser(parser_name)
    request = validate_tools(validated(ChatRequest, body, RequestLimits()))
    compiled = compiler.compile(tool_call_spec(parser.call_prefix, call_schema(request, parser.arguments_key),
                                               parser.call_suffix))
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for text in outputs(compiled, tokenizer, eos):
        content, calls = parser.extract(text)
        assert content is None and len(calls) == 1, text
        assert calls[0].name in parameters and (choice == "required" or calls[0].name == choice)
        jsonschema.validate(json.loads(calls[0].arguments), parameters[calls[0].name])
