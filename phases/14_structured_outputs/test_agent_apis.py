"""The agent APIs beside chat completions, through the SDKs agents use, on a real loopback server:
OpenAI's Responses API (``client.responses``) and Anthropic's Messages API (the anthropic SDK, as
Claude Code calls it), each checked against an independent truth: the chat template rendered by
the tokenizer and the greedy text of an oracle engine, jsonschema for forced calls and formats.
Also the field policy (every OpenAI field the SDKs send is accepted), ``parallel_tool_calls``
under ``auto``, and the checkpoint's sampling defaults through ``python -m engine serve``."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest

from agent_cases import ADD, HISTORY, TOOLS
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from test_agent_server import BLOCK_SIZE, KEY, MAX_MODEL_LEN, THINKING_TEMPLATE, make_agent_checkpoint

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = {"temperature": 0}
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Answer in one word."
FUNCTION_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tool shape
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    return make_agent_checkpoint(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def engine(agent_model):
    return LLMEngine(agent_model, block_size=BLOCK_SIZE, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def oracle(agent_model):
    """A second engine: the greedy text and finish reason of a conversation rendered by the
    tokenizer's own template (no server code), each alone."""
    engine = LLMEngine(agent_model, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)

    def greedy(messages: list[dict], max_tokens: int, tools=None, stop=()) -> tuple[str, str, int]:
        prompt = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        token_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        rid = engine.add_request(token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop))
        while engine.has_unfinished_requests():
            engine.step()
        out = engine.pop_request(rid)
        return out.text, out.finish_reason, len(token_ids)
    return greedy


@pytest.fixture(scope="module")
def served(engine):
    with server_cases.running_server(engine, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                       timeout=2 * server_cases.HANG_GUARD_S) as c:
        yield c
    server_cases.wait_idle(served.engine_client)


@pytest.fixture
def claude(served):
    with anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0,
                             timeout=2 * server_cases.HANG_GUARD_S) as c:
        yield c
    server_cases.wait_idle(served.engine_client)


def conversation(instructions: str | None = INSTRUCTIONS) -> list[dict]:
    return ([{"role": "system", "content": instructions}] if instructions else []) + \
        [{"role": "user", "content": QUESTION}]


# ---- the Responses API ----------------------------------------------------------------------------

def test_responses_text_is_the_greedy_text_whole_and_streamed(client, oracle):
    """``input`` + ``instructions`` answer the oracle's greedy text of the same conversation;
    ``status`` follows its finish (incomplete at max_output_tokens); usage counts the prompt the
    template makes; the stream's events come in the documented order and assemble the same text."""
    for max_tokens in (6, 60):
        text, finish, num_prompt = oracle(conversation(), max_tokens)
        out = client.responses.create(model="tiny", input=QUESTION, instructions=INSTRUCTIONS,
                                      max_output_tokens=max_tokens, **GREEDY)
        assert out.output_text == text
        assert out.status == ("incomplete" if finish == "length" else "completed")
        assert (out.incomplete_details is not None) == (finish == "length")
        assert out.usage.input_tokens == num_prompt and out.usage.total_tokens == num_prompt + out.usage.output_tokens
        kinds = []
        with client.responses.stream(model="tiny", input=[{"role": "user", "content": QUESTION}],
                                     instructions=INSTRUCTIONS, max_output_tokens=max_tokens, **GREEDY) as stream:
            deltas = []
            for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
        assert "".join(deltas) == text
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == ("response.incomplete" if finish == "length" else "response.completed")
        body = [k for k in kinds[2:-1] if not k.endswith(".delta")]
        assert body == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                        "response.content_part.done", "response.output_item.done"], kinds
        if finish != "length":
            assert stream.get_final_response().output_text == text


def test_responses_json_schema_format_validates(client):
    """``text.format`` json_schema goes through the grammar path: the answer validates."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    out = client.responses.create(model="tiny", input="Report the weather in Paris as JSON.", max_output_tokens=120,
                                  text={"format": {"type": "json_schema", "name": "report", "schema": schema}},
                                  **GREEDY)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)


def _valid_arguments(name: str, arguments: str | dict) -> None:
    parameters = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, parameters)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "add"}])
def test_responses_forced_function_calls_validate_whole_and_streamed(client, tool_choice):
    """Function tools with tool_choice required or named: one ``function_call`` item whose
    arguments validate against the function's parameters; the stream's argument deltas assemble
    the same call."""
    fields = dict(model="tiny", input="Add 2 and 3, or tell me the weather.", tools=FUNCTION_TOOLS,
                  tool_choice=tool_choice, max_output_tokens=120, **GREEDY)
    out = client.responses.create(**fields)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and [item.type for item in out.output] == ["function_call"], out.output
    assert out.status == "completed" and calls[0].call_id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert calls[0].name == "add"
    _valid_arguments(calls[0].name, calls[0].arguments)
    with client.responses.stream(**fields) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert arguments == calls[0].arguments
    assert [(i.name, i.arguments) for i in final.output] == [(calls[0].name, calls[0].arguments)]


def test_responses_take_a_function_call_output_turn(client, tokenizer_of):
    """A ``function_call`` item and its ``function_call_output`` render as the assistant's call and
    the tool's result: the input tokens are those of the template's own rendering of that history."""
    call = HISTORY[1]["tool_calls"][0]
    items = [{"role": "user", "content": HISTORY[0]["content"]},
             {"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
              "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": call["id"], "output": HISTORY[2]["content"]}]
    out = client.responses.create(model="tiny", input=items, tools=FUNCTION_TOOLS, max_output_tokens=4, **GREEDY)
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**call, "function": {
        **call["function"], "arguments": json.loads(call["function"]["arguments"])}}]}, HISTORY[2]]
    rendered = tokenizer_of.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in rendered
    assert out.usage.input_tokens == len(tokenizer_of.encode(rendered, add_special_tokens=False))


def test_responses_refuse_what_needs_stored_state_in_openais_error_shape(served, client):
    for fields, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"frobnicate": 1}, "frobnicate"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0]")]:
        status, raw = server_cases.http(served.url + "/v1/responses", {"model": "tiny", "input": "hi", **fields})
        assert status == 400 and server_cases.assert_error_object(raw, param)
    out = client.responses.create(model="tiny", input="hi", store=True, max_output_tokens=2, **GREEDY)
    assert out.store is False  # accepted, nothing stored


# ---- the Anthropic Messages API -------------------------------------------------------------------

@pytest.mark.parametrize("system", [INSTRUCTIONS, [{"type": "text", "text": INSTRUCTIONS,
                                                    "cache_control": {"type": "ephemeral"}}]])
def test_messages_text_is_the_greedy_text_whole_and_streamed(claude, oracle, system):
    """``system`` (a string or text blocks) and a user turn answer the oracle's greedy text;
    stop_reason follows its finish; usage counts the prompt; the stream's text and final message
    equal the whole answer; count_tokens counts the same prompt."""
    for max_tokens in (6, 60):
        text, finish, num_prompt = oracle(conversation(), max_tokens)
        fields = dict(model="tiny", max_tokens=max_tokens, system=system,
                      messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
        out = claude.messages.create(**fields)
        assert [b.type for b in out.content] == (["text"] if text else []) and out.content[0].text == text
        assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == num_prompt
        assert out.usage.output_tokens > 0
        with claude.messages.stream(**fields) as stream:
            assert "".join(stream.text_stream) == text
            final = stream.get_final_message()
        assert [(b.type, b.text) for b in final.content] == [("text", text)] and final.stop_reason == out.stop_reason
        counted = claude.messages.count_tokens(model="tiny", system=system,
                                               messages=[{"role": "user", "content": QUESTION}])
        assert counted.input_tokens == num_prompt


def test_messages_stop_sequences_end_the_text_and_name_themselves(claude, oracle):
    text, _, _ = oracle(conversation(None), 40)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected, finish, _ = oracle(conversation(None), 40, stop=(stop,))
    out = claude.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
                                 stop_sequences=[stop], extra_body=GREEDY)
    assert finish == "stop" and out.content[0].text == expected
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_messages_forced_tool_use_validates_whole_and_streamed(claude, tool_choice):
    """tool_choice any or a named tool: one ``tool_use`` block whose input validates against its
    input_schema, stop_reason tool_use; the stream's input_json deltas build the same input."""
    fields = dict(model="tiny", max_tokens=120, tools=CLAUDE_TOOLS, tool_choice=tool_choice,
                  messages=[{"role": "user", "content": "Add 2 and 3, or tell me the weather."}], extra_body=GREEDY)
    out = claude.messages.create(**fields)
    assert [b.type for b in out.content] == ["tool_use"] and out.stop_reason == "tool_use"
    block = out.content[0]
    assert block.id.startswith("toolu_") and (tool_choice["type"] == "any" or block.name == "add")
    _valid_arguments(block.name, block.input)
    with claude.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", block.name, block.input)]
    assert final.stop_reason == "tool_use"


def test_messages_take_a_tool_result_turn(claude, tokenizer_of):
    """An assistant ``tool_use`` and the user's ``tool_result`` render as the call and its result:
    the input tokens are those of the template's own rendering of that history."""
    call = HISTORY[1]["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    messages = [{"role": "user", "content": HISTORY[0]["content"]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"],
                                                   "name": call["function"]["name"], "input": arguments}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                              "content": [{"type": "text", "text": HISTORY[2]["content"]}]}]}]
    out = claude.messages.create(model="tiny", max_tokens=4, tools=CLAUDE_TOOLS, messages=messages,
                                 extra_body=GREEDY)
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**call, "function": {
        **call["function"], "arguments": arguments}}]}, HISTORY[2]]
    rendered = tokenizer_of.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == \
        len(tokenizer_of.encode(rendered, add_special_tokens=False))


def test_messages_errors_are_anthropics(served):
    for body, kind in [({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "invalid_request_error"),
                       ({"model": "gpt-9", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                        "not_found_error")]:
        status, raw = server_cases.http(served.url + "/v1/messages", body)
        error = json.loads(raw)
        assert status in (400, 404) and error["type"] == "error" and error["error"]["type"] == kind, error


@pytest.fixture(scope="module")
def tokenizer_of(engine):
    return engine.tokenizer


# ---- keys, reasoning, field policy, parallel calls, checkpoint defaults ---------------------------

def test_keys_and_thinking_on_a_served_cli(agent_model, tmp_path):
    """``python -m engine serve --api-key KEY --reasoning-parser qwen3`` with a thinking template:
    the anthropic SDK's key is read (2.17 sends it as a bearer token; test_access covers x-api-key;
    right: served; wrong: 401 in Anthropic's shape), the
    Responses API refuses a wrong bearer key (401); with thinking enabled the reasoning comes back
    as a ``thinking`` block (Anthropic) and a ``reasoning`` item (Responses); disabled, none."""
    template = tmp_path / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    server = server_cases.start_server_process([
        sys.executable, "-m", "engine", "serve", "--model", str(agent_model), "--port", "0", "--max-model-len",
        str(MAX_MODEL_LEN), "--served-model-name", "tiny", "--api-key", KEY, "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--chat-template", str(template)])
    try:
        with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong, \
                pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as wrong, \
                pytest.raises(openai.AuthenticationError):
            wrong.responses.create(model="tiny", input="hi", max_output_tokens=2)
        with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0,
                                 default_headers={"anthropic-beta": "x"}) as claude:
            on = claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY)
            off = claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                         thinking={"type": "disabled"}, extra_body=GREEDY)
        assert on.content[0].type == "thinking" and on.content[0].thinking
        assert "thinking" not in [b.type for b in off.content]
        with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            out = client.responses.create(model="tiny", input="hi", max_output_tokens=8, **GREEDY)
        assert out.output[0].type == "reasoning" and out.output[0].content[0].text
    finally:
        rc = server_cases.stop_server_process(server, 2)
    assert rc == 0, "".join(server.stderr)


OPENAI_CHAT_FIELDS = dict(  # every field of the chat completions API that the SDK sends, each accepted
    reasoning_effort="low", verbosity="low", prompt_cache_key="k", prompt_cache_retention="24h",
    safety_identifier="s", modalities=["text"], prediction={"type": "content", "content": "x"},
    metadata={"k": "v"}, store=False, user="u", service_tier="auto", max_completion_tokens=3, n=1,
    parallel_tool_calls=False, tools=TOOLS, tool_choice="auto", seed=1, stop=["\n\n"], top_p=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, logprobs=True, top_logprobs=2,
    response_format={"type": "text"}, stream_options=None)
OPENAI_RESPONSES_FIELDS = dict(
    instructions="i", max_output_tokens=3, temperature=0, top_p=1.0, tools=FUNCTION_TOOLS, tool_choice="auto",
    parallel_tool_calls=False, text={"format": {"type": "text"}, "verbosity": "low"},
    reasoning={"effort": "low", "summary": "auto"}, store=False, metadata={"k": "v"}, user="u",
    safety_identifier="s", prompt_cache_key="k", service_tier="auto", include=[], truncation="disabled",
    max_tool_calls=2)


def test_every_openai_field_the_sdks_send_is_accepted(client):
    """Each field of docs/agents.md's "Fields" table, sent by the openai SDK, is honoured or ignored, never a 400;
    a field of no API is still a 400 naming it."""
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         **OPENAI_CHAT_FIELDS)
    assert out.choices[0].finish_reason in ("length", "stop")
    out = client.responses.create(model="tiny", input="hi", **OPENAI_RESPONSES_FIELDS)
    assert out.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"reasoning_efort": "low"})
    assert e.value.body["param"] == "reasoning_efort"


def test_reasoning_effort_none_turns_thinking_off_where_the_template_reads_it(client, tokenizer_of):
    """``reasoning_effort: "none"`` renders as ``enable_thinking: false`` (the template closes an
    empty block); other efforts reach the template as they are."""
    none = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          reasoning_effort="none", max_tokens=1)
    off = tokenizer_of.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False, enable_thinking=False)
    assert none.usage.prompt_tokens == len(tokenizer_of.encode(off, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       reasoning_effort="extreme", max_tokens=1)


TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call_under_auto(client, stream):
    """A model steered into writing two calls (a regex constraint) under tool_choice auto: both
    come back by default, one with ``parallel_tool_calls: false``."""
    for parallel, expected in ((True, [{"a": 1, "b": 2}, {"a": 3, "b": 4}]), (False, [{"a": 1, "b": 2}])):
        fields = dict(model="tiny", messages=[{"role": "user", "content": "Add."}], tools=[ADD], max_tokens=120,
                      parallel_tool_calls=parallel, extra_body={"structured_outputs": {"regex": re.escape(TWO_CALLS)}},
                      **GREEDY)
        if stream:
            calls: dict[int, str] = {}
            for chunk in client.chat.completions.create(stream=True, **fields):
                for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    calls[call.index] = calls.get(call.index, "") + (call.function.arguments or "")
            arguments = [calls[i] for i in sorted(calls)]
        else:
            message = client.chat.completions.create(**fields).choices[0].message
            arguments = [c.function.arguments for c in message.tool_calls or []]
        assert [json.loads(a) for a in arguments] == expected, parallel


def test_the_checkpoints_sampling_defaults_reach_every_entry_point(tmp_path):
    """A checkpoint whose generation_config.json samples with top_k 1 (greedy however hot): through
    ``python -m engine serve``, requests that name no sampling field give the greedy text on any
    seed (OpenAI's defaults would sample); naming top_k 0 samples again; ``python -m engine
    generate`` gives the same greedy text with no sampling flag."""
    model = make_agent_checkpoint(tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "top_k": 1,
                                                              "temperature": 1.5}))
    oracle = LLMEngine(model, max_model_len=256)
    greedy = oracle.generate("def f(x):", max_new_tokens=24, ignore_eos=True)
    greedy_to_eos = oracle.generate("def f(x):", max_new_tokens=24)
    server = server_cases.start_server_process([
        sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0", "--max-model-len", "256",
        "--served-model-name", "tiny"])
    try:
        texts = {seed: server_cases.http(server.url + "/v1/completions", {
            "prompt": "def f(x):", "max_tokens": 24, "ignore_eos": True, "seed": seed})[1] for seed in range(3)}
        assert {json.loads(raw)["choices"][0]["text"] for raw in texts.values()} == {greedy}
        sampled = {json.loads(server_cases.http(server.url + "/v1/completions", {
            "prompt": "def f(x):", "max_tokens": 24, "ignore_eos": True, "seed": seed, "top_k": 0})[1])[
            "choices"][0]["text"] for seed in range(3)}
        assert sampled != {greedy}
    finally:
        assert server_cases.stop_server_process(server, 2) == 0, "".join(server.stderr)
    cli = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt", "def f(x):",
                          "--max-tokens", "24", "--max-model-len", "256"], capture_output=True, text=True,
                         cwd=server_cases.REPO, env=server_cases.server_env(), timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == "def f(x):" + greedy_to_eos + "\n"
