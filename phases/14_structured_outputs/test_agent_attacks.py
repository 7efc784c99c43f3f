"""The agent path under attack (issue 46), each attack beside a good streaming client whose greedy
text must not change and which must never wait long for its next chunk (phase 10's ``Witness``):
20,000 tools, a history of 50,000 tool calls, a schema nested 100 levels, slow grammars flooding
the compile workers while another client's small schema still compiles. (A 30 MB body is a 413
before it is decoded: phase 10; these attacks fit the 8 MiB body cap.)"""
from __future__ import annotations

import http.client
import importlib
import json

import pytest

from agent_cases import HISTORY, TOOLS, TOOLS_TEMPLATE
from engine.core.llm_engine import LLMEngine
from engine.scheduling.structured.compiler import GrammarCompiler

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")

SMALL_ERROR = 1024
COMPILE_LIMIT_S = 2.0  # a slow schema's compile is stopped here (the server's default is 10 s)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = server_cases.make_text_checkpoint(tmp_path_factory.mktemp("agent-model"), seed=13,
                                              chat_template=TOOLS_TEMPLATE)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=1024)
    engine._grammar_compiler = GrammarCompiler(engine.tokenizer, engine.config.vocab_size, engine.eos_token_ids,
                                               workers=1, timeout_s=COMPILE_LIMIT_S)  # a core left to serve
    with server_cases.running_server(engine, tool_call_parser="hermes") as running:
        yield running
    engine._grammar_compiler.close()


@pytest.fixture(scope="module")
def witness(served):
    return server_cases.Witness(served.url)


def post(url: str, body: dict | bytes, source: str = "127.0.0.1") -> tuple[int, dict]:
    """POST ``body`` (or its JSON already encoded: a big body is built before the witness runs, see
    ``Witness.beside``) from the loopback address ``source`` (another client, as the server tells
    them apart); the status and the JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120, source_address=(source, 0))
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    assert len(raw) < SMALL_ERROR or response.status == 200, f"the error echoes the input back ({len(raw)} bytes)"
    return response.status, json.loads(raw)


def ask(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
            "temperature": 0, **fields}


def test_tool_attacks_are_refused_at_their_caps_beside_a_good_stream(served, witness):
    """20,000 tools and a history of 50,000 tool calls: each a 400 naming the field and its cap,
    before any is read; a schema nested 100 levels is a 400, not a 500."""
    tool = TOOLS[0]
    many = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(20_000)]
    raw = json.dumps(ask(tools=many)).encode()
    status, body = witness.beside(lambda: post(served.url, raw))
    assert status == 400 and body["error"]["param"] == "tools" and "128" in body["error"]["message"]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                   "tool_calls": [call] * 50_000}]
    raw = json.dumps({**ask(), "messages": history, "tools": TOOLS}).encode()
    status, body = witness.beside(lambda: post(served.url, raw))
    assert status == 400 and "4096" in body["error"]["message"], body
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    status, body = witness.beside(lambda: post(served.url, ask(response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})))
    assert status == 400, body
    server_cases.wait_idle(served.engine_client)


def slow_schema(i: int) -> dict:
    """A schema whose grammar takes far longer than COMPILE_LIMIT_S to compile (a 30,000-string enum)."""
    return {"type": "object", "properties": {"pick": {"enum": [f"choice-{i}-{j}" for j in range(30_000)]}},
            "required": ["pick"]}


def test_slow_grammars_cannot_starve_another_clients_schema(served, witness):
    """One client floods the compile workers with slow schemas (each refused at the limit, a 400
    naming response_format); meanwhile another client's small schema compiles and its answer
    validates; asking for a refused schema again is answered at once from the cache."""
    import concurrent.futures

    jsonschema = pytest.importorskip("jsonschema")
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}

    slow_bodies = [json.dumps(ask(response_format={"type": "json_schema", "json_schema": {
        "name": f"slow{i}", "schema": slow_schema(i)}})).encode() for i in range(4)]

    def attack() -> list:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(post, served.url, body) for body in slow_bodies]
            good = post(served.url, ask(max_tokens=40, response_format={
                "type": "json_schema", "json_schema": {"name": "small", "schema": small}}), source="127.0.0.2")
            return [f.result() for f in slow] + [good]

    *slow, good = witness.beside(attack)
    for status, body in slow:
        assert status == 400 and body["error"]["param"].startswith("response_format"), body
    assert good[0] == 200, good
    jsonschema.validate(json.loads(good[1]["choices"][0]["message"]["content"]), small)
    server_cases.wait_idle(served.engine_client)


PARAMETERS = TOOLS[0]["function"]["parameters"]
AGENT_CASES = [  # (route, a good body, the fields a client may have left out, Anthropic's error shape)
    ("/v1/chat/completions", {**ask(max_tokens=4), "messages": [*HISTORY, {"role": "user", "content": "thanks"}],
                              "tools": TOOLS[:1], "tool_choice": "auto", "parallel_tool_calls": False,
                              "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
     {"messages", "role", "content", "type", "function", "name", "arguments", "id", "tool_call_id"}, False),
    ("/v1/responses", {"model": "tiny", "instructions": "be brief", "max_output_tokens": 4, "temperature": 0,
                       "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                                 {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                  "arguments": '{"city": "Paris"}'},
                                 {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}],
                       "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
                       "tool_choice": "auto", "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"},
                       "metadata": {"k": "v"}, "store": False},
     {"input", "role", "content", "type", "text", "call_id", "name", "arguments", "output"}, False),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "temperature": 0, "system": [{"type": "text", "text": "hi"}],
                      "messages": [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": [
                                       {"type": "text", "text": "checking"},
                                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                        "input": {"city": "Paris"}}]},
                                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                 "content": "18 C"}]}],
                      "tools": [{"name": "get_weather", "description": "weather", "input_schema": PARAMETERS}],
                      "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
                      "output_config": {"effort": "low"}, "stop_sequences": ["\n\n"], "metadata": {"user_id": "u"}},
     {"messages", "max_tokens", "role", "content", "type", "text", "id", "name", "tool_use_id"}, True),
]


def test_every_malformed_value_is_a_4xx_in_the_routes_shape_naming_the_clients_field(served, witness):
    """Each value of a chat (tools, a call history), Responses, Messages and count_tokens body
    replaced by an array, an object, a number, a string, a boolean or null (a list or an object
    where a string belongs was a 500: role, content[].type, thinking.type, output_config.effort):
    answered, or a 4xx error object in the route's shape (Anthropic's on /v1/messages) naming the
    field the client sent -- never a field the server made of it (max_completion_tokens,
    response_format, stop) -- and never a 500, beside a good stream."""
    cases = AGENT_CASES + [("/v1/messages/count_tokens", {k: v for k, v in AGENT_CASES[2][1].items()
                                                          if k != "max_tokens"}, AGENT_CASES[2][2], True)]

    def attack() -> list[int]:
        return [server_cases.assert_malformed_refused(served.url, route, body, required, anthropic)
                for route, body, required, anthropic in cases]

    assert all(witness.beside(attack))
    server_cases.wait_idle(served.engine_client)


def test_a_failure_of_the_server_is_a_500_in_the_routes_shape(served, monkeypatch):
    """A failure of the server's own while reading a request is a 500 error object in the shape of
    the route's API: Anthropic's on /v1/messages (and count_tokens), OpenAI's elsewhere."""
    def broken(request):
        raise RuntimeError("a planted failure")

    monkeypatch.setattr(served.server.protocol, "chat", broken)
    body = AGENT_CASES[2][1]
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        status, raw = server_cases.http(served.url + route, body)
        answer = json.loads(raw)
        assert status == 500 and answer["type"] == "error" and answer["error"]["type"] == "api_error", answer
    status, raw = server_cases.http(served.url + "/v1/chat/completions", ask())
    assert status == 500 and server_cases.assert_error_object(raw)["type"] == "server_error"


def test_a_costly_request_that_cannot_fit_is_refused_before_it_is_paid(served, witness):
    """128 tools of 150 properties (2.6 MiB, under every cap) cannot fit this server's 1,024-token
    context: the tools' JSON is counted against the length bound before any schema is checked or
    the template rendered, a 400 naming tools (context_length_exceeded) at once, beside a good stream."""
    raw = json.dumps(ask(tools=server_cases.costly_tools())).encode()
    status, body = witness.beside(lambda: post(served.url, raw))
    assert status == 400 and body["error"]["param"] == "tools", body
    assert body["error"]["code"] == "context_length_exceeded" and "1024" in body["error"]["message"], body


def test_each_distinct_schema_is_checked_once(monkeypatch):
    """The meta-schema check of a schema runs once while its answer is cached (agents send the same
    tools with every turn), again for a schema that differs, and a cached refusal stays a refusal."""
    import jsonschema_rs

    from engine.scheduling.structured import spec

    checked = []
    real = jsonschema_rs.meta.validate
    monkeypatch.setattr(jsonschema_rs.meta, "validate", lambda schema: checked.append(schema) or real(schema))
    good = {"type": "object", "properties": {"city": {"type": "string", "description": "checked once, 57"}}}
    bad = {"type": "object", "properties": {"city": {"type": "strin", "description": "checked once, 57"}}}
    assert [spec.schema_problem(good) for _ in range(3)] == [None] * 3 and len(checked) == 1
    assert spec.schema_problem(json.loads(json.dumps(good))) is None and len(checked) == 1  # equal, not the same
    problems = [spec.schema_problem(bad) for _ in range(2)]
    assert problems[0] is not None and problems[0] == problems[1] and len(checked) == 2
