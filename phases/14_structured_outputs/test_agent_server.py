"""The agent surface through the official openai client on a real loopback server over tiny
random-weight checkpoints: tools and a history of tool results rendered and run, outputs read by
the tool-call and reasoning parsers (whole and streamed alike), vLLM's sampling extensions each
against an independent truth (the tokenizer, an oracle engine, the greedy text), bad fields as
400s naming them, and ``python -m engine serve``'s agent flags (API key, parsers, template).

The agent checkpoint has the demo model's byte-level tokenizer (so JSON and tags can be written)
and ``agent_cases.TOOLS_TEMPLATE``; the word checkpoint's tiny vocabulary makes a special token
likely in a sampled output."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
import urllib.request

import pytest

from agent_cases import HISTORY, TOOLS, TOOLS_TEMPLATE
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.core.tokenizer import load_tokenizer
from engine.entrypoints.server.tool_parsers import tool_parser
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")
openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 4
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
KEY = "sk-agent-0123456789"
# TOOLS_TEMPLATE with a thinking model's generation prompt: the assistant turn opens the
# reasoning block unless enable_thinking is false (then it is opened and closed, empty)
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace("</think>\n\n{% endif %}", "</think>\n\n{% else %}<think>\n{% endif %}")
# HISTORY as the template gets it: each call's arguments an object
TEMPLATE_HISTORY = [HISTORY[0], {**HISTORY[1], "tool_calls": [
    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
    for c in HISTORY[1]["tool_calls"]]}, HISTORY[2]]


def make_agent_checkpoint(path, seed: int = 7):
    """A tiny random Qwen3 with the demo tokenizer (vocabulary 8192; its <|endoftext|>, id 0, is
    the EOS of the config and the generation config) and TOOLS_TEMPLATE."""
    make_tiny_checkpoint(path, "Qwen3ForCausalLM", seed, vocab_size=8192)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": 0}))
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    return make_agent_checkpoint(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def tokenizer(agent_model):
    return load_tokenizer(agent_model)


@pytest.fixture(scope="module")
def served(agent_model):
    engine = LLMEngine(agent_model, block_size=BLOCK_SIZE, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    with server_cases.running_server(engine, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    return server_cases.make_word_checkpoint(tmp_path_factory.mktemp("words"), seed=2)


@pytest.fixture(scope="module")
def word_served(word_model):
    engine = LLMEngine(word_model, block_size=BLOCK_SIZE, max_model_len=128)
    with server_cases.running_server(engine) as running:
        yield running


@pytest.fixture
def word_client(word_served):
    with openai_client(word_served.url) as c:
        yield c
    server_cases.wait_idle(word_served.engine_client)


def openai_client(url: str, api_key: str = "none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                         timeout=2 * server_cases.HANG_GUARD_S)


@pytest.fixture
def client(served):
    with openai_client(served.url) as c:
        yield c
    server_cases.wait_idle(served.engine_client)


def completion_text(client, prompt: str | list[int], max_tokens: int, **fields) -> str:
    """The greedy completion of ``prompt`` (the truth a chat's output is read from)."""
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **GREEDY,
                                     **fields).choices[0].text


def assembled(stream) -> tuple[str | None, str | None, list[dict], str | None]:
    """A streamed chat choice joined as the OpenAI SDK joins it: (content, reasoning_content,
    tool calls, finish reason)."""
    content, reasoning, calls, finish = None, None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            extra = (delta.model_extra or {}).get("reasoning_content")
            if extra:
                reasoning = (reasoning or "") + extra
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def whole_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def test_a_history_of_tool_results_renders_and_runs_read_by_the_parser(served, client, tokenizer):
    """Tools and a history with a call and its result render through the template (the prompt
    the tokenizer makes of them); the answer is the hermes parse of the greedy text of that
    prompt, and the stream, joined as the SDK joins it, is the same answer."""
    rendered = tokenizer.apply_chat_template(TEMPLATE_HISTORY, tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)
    text = completion_text(client, rendered, 24)
    content, calls = tool_parser("hermes", names={"get_weather", "add"}).extract(text)
    out = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=24, **GREEDY)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    message = out.choices[0].message
    assert message.content == content
    assert [(c["name"], c["arguments"]) for c in whole_calls(message)] == [(c.name, c.arguments) for c in calls]
    assert out.choices[0].finish_reason == ("tool_calls" if calls else "length")
    streamed = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=24, stream=True,
                                              **GREEDY)
    s_content, s_reasoning, s_calls, s_finish = assembled(streamed)
    assert (s_content or None, s_reasoning, s_finish) == (content, None, out.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in calls]
    # tool_choice none: the same prompt, read as plain content
    plain = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, **GREEDY)
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls


def test_reasoning_is_split_off_whole_and_streamed(agent_model, tokenizer):
    """With --reasoning-parser qwen3 and a template that opens the reasoning block, the whole
    output (the greedy text of the rendered prompt, no closing tag) is reasoning_content, whole
    and streamed; with enable_thinking false the block is closed in the prompt and the output
    is content."""
    engine = LLMEngine(agent_model, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    with server_cases.running_server(engine, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE) as running:
        with openai_client(running.url) as client:
            rendered = tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE,
                                                     add_generation_prompt=True, tokenize=False)
            assert rendered.endswith("<think>\n")
            text = completion_text(client, rendered, 16)
            assert "</think>" not in text
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, **GREEDY)
            message = out.choices[0].message
            assert (message.content, message.model_extra["reasoning_content"]) == (None, text.lstrip() or None)
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True,
                                                    **GREEDY)
            assert assembled(stream) == (None, text.lstrip() or None, [], "length")
            off = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
            rendered = tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, enable_thinking=False,
                                                     add_generation_prompt=True, tokenize=False)
            text = completion_text(client, rendered, 16)
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 extra_body=off)
            assert (out.choices[0].message.content, out.choices[0].message.model_extra.get("reasoning_content")) == (
                text, None)
        server_cases.wait_idle(running.engine_client)


def test_include_stop_str_in_output_ends_the_text_with_it(served, client):
    """A stop string taken from the middle of the greedy text: the answer is the text up to it,
    and with include_stop_str_in_output up to and with it, streamed alike."""
    prompt = "The tool returned"
    text = completion_text(client, prompt, 32)
    at = next(k for k in range(len(text) // 3, len(text) - 3)
              if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    stop = text[at:at + 3]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, stop=[stop], **GREEDY).choices[0]
    assert (cut.text, cut.finish_reason) == (text[:at], "stop")
    kept = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, stop=[stop], temperature=0,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert (kept.text, kept.finish_reason) == (text[:at + 3], "stop") and kept.text.endswith(stop)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, stop=[stop], stream=True,
                                         temperature=0,
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:at + 3]


def test_skip_special_tokens_false_keeps_them_in_the_text(word_model, word_client):
    """A sampled output holding the special token <|endoftext|> (an oracle engine finds a seed
    whose output does): the text is the tokenizer's decode of the oracle's ids, special tokens
    skipped by default and kept with skip_special_tokens false."""
    tokenizer = load_tokenizer(word_model)
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    oracle = LLMEngine(word_model, block_size=BLOCK_SIZE, max_model_len=128)
    prompt = tokenizer.encode("the river", add_special_tokens=False)
    for seed in range(64):
        ids = oracle.generate_tokens([prompt], SamplingParams(max_tokens=24, ignore_eos=True, seed=seed))[0]
        if special in ids:
            break
    assert special in ids, "no seed of 64 samples the special token"

    def text(**fields):
        return word_client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0, top_p=1.0,
                                              seed=seed, extra_body={"ignore_eos": True, **fields}).choices[0].text
    assert text() == tokenizer.decode(ids, skip_special_tokens=True)
    kept = text(skip_special_tokens=False)
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) and "<|endoftext|>" in kept


def test_logit_bias_allowed_token_ids_and_bad_words_shape_the_words(word_model, word_client):
    """On the word model (a token is a word): a +100 bias makes greedy emit only that word;
    allowed_token_ids leave only their words in a sampled output; a bad word never appears
    where the greedy text had it most."""
    tokenizer = load_tokenizer(word_model)

    def words(prompt, **fields) -> list[str]:
        out = word_client.completions.create(model="tiny", prompt=prompt, max_tokens=16, extra_body={
            "ignore_eos": True, **fields}, **({} if "temperature" in fields else {"temperature": 0}))
        assert out.usage.completion_tokens == 16
        return out.choices[0].text.split()

    garden = tokenizer.convert_tokens_to_ids("garden")
    assert words("the quick", logit_bias={str(garden): 100}) == ["garden"] * 16
    allowed = ["river", "city", "light"]
    sampled = words("the quick", allowed_token_ids=tokenizer.convert_tokens_to_ids(allowed), temperature=1.0, seed=5)
    assert len(sampled) == 16 and set(sampled) <= set(allowed)
    greedy = words("over the lazy")
    common = max(set(greedy), key=greedy.count)
    banned = words("over the lazy", bad_words=[common])
    assert common not in banned and len(banned) == 16, (greedy, banned)


def test_usage_counts_the_prompt_tokens_found_cached(served, client):
    """A prompt sent twice: the first finds nothing cached, the second every full block before
    the one holding its last token (usage.prompt_tokens_details.cached_tokens); so does a third
    with max_tokens 1 (its first token finishes it and frees its blocks before its output is read)."""
    prompt = list(range(4000, 4000 + 23))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    third = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, **GREEDY)
    assert third.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


BAD_FIELDS = [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"8192": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "a"}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [8192]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"bad_words": ["ok", 3]}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "word"}, "bad_words"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": "a"}, "min_p"), ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"), ({"priority": 1}, "priority"), ({"echo": True}, "echo"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"), ({"tool_choice": "sometimes", "tools": TOOLS},
                                                                "tool_choice"),
    ({"add_special_tokens": True}, "add_special_tokens"),  # chat: refused
]


def test_each_bad_field_is_a_400_naming_it_and_the_server_serves_on(served, client):
    for fields, param in BAD_FIELDS:
        status, raw = server_cases.http(served.url + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
        assert status == 400, (fields, raw)
        server_cases.assert_error_object(raw, param)
    status, raw = server_cases.http(served.url + "/v1/completions",
                                    {"model": "tiny", "prompt": "hi", "add_special_tokens": "yes"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "add_special_tokens"
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0, extra_body={
        "ignore_eos": True, "add_special_tokens": True, "bad_words": ["zebra"], "min_p": 0.1})
    assert out.choices[0].finish_reason == "length"


def test_serve_flags_key_the_routes_and_read_tools(agent_model, tokenizer, tmp_path):
    """``python -m engine serve --api-key ... --allowed-origins ... --tool-call-parser hermes
    --reasoning-parser qwen3 --chat-template FILE``: every route but /health, /metrics and
    /version answers 401 without the key (or with a wrong one) and serves with it; a browser's
    preflight from the origin named passes without it; the template file renders the tools."""
    template = tmp_path / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    origin = "https://app.example"
    server = server_cases.start_server_process([
        sys.executable, "-m", "engine", "serve", "--model", str(agent_model), "--port", "0", "--max-model-len", "1024",
        "--served-model-name", "tiny", "--api-key", KEY, "--allowed-origins", origin, "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--chat-template", str(template)])
    try:
        preflight = urllib.request.Request(server.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(preflight, timeout=60) as response:
            assert response.status == 204 and response.headers["Access-Control-Allow-Origin"] == origin
        for path in ("/health", "/version", "/metrics"):
            assert server_cases.http(server.url + path, method="GET")[0] == 200, path
        for path, body in (("/v1/models", None), ("/tokenize", {"prompt": "hi"}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            status, raw = server_cases.http(server.url + path, body, method="GET" if body is None else "POST")
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", path
        with openai_client(server.url, "wrong") as client, pytest.raises(openai.AuthenticationError):
            client.models.list()
        with openai_client(server.url, KEY) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            out = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=4, **GREEDY)
            rendered = tokenizer.apply_chat_template(TEMPLATE_HISTORY, tools=TOOLS, chat_template=THINKING_TEMPLATE,
                                                     add_generation_prompt=True, tokenize=False)
            assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
            assert out.choices[0].message.model_extra["reasoning_content"] is not None  # the template opened it
    finally:
        rc = server_cases.stop_server_process(server, 2)
    assert rc == 0, "".join(server.stderr)


WEATHER_REPORT = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "sunny": {"type": "boolean"}}, "required": ["city", "unit", "sunny"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_outputs_validate(served, client, stream):
    """response_format json_schema: the (greedy) answer parses and validates against the schema,
    finished by the grammar ("stop"), the stream joined equal to the whole answer."""
    jsonschema = pytest.importorskip("jsonschema")
    response_format = {"type": "json_schema", "json_schema": {"name": "report", "schema": WEATHER_REPORT}}
    messages = [{"role": "user", "content": "Report the weather in Paris as JSON."}]
    out = client.chat.completions.create(model="tiny", messages=messages, response_format=response_format,
                                         max_tokens=200, temperature=0)
    content, finish = out.choices[0].message.content, out.choices[0].finish_reason
    jsonschema.validate(json.loads(content), WEATHER_REPORT)
    assert finish == "stop"
    if stream:
        chunks = client.chat.completions.create(model="tiny", messages=messages, response_format=response_format,
                                                max_tokens=200, temperature=0, stream=True)
        assert assembled(chunks) == (content, None, [], "stop")
    refused = server_cases.http(served.url + "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object", "properties": {
                "x": {"type": "string", "pattern": "(unclosed"}}}}}})
    assert refused[0] == 400 and json.loads(refused[1])["error"]["param"].startswith("response_format")


def _valid_call(call: dict, names: set[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assert call["name"] in names and call["id"].startswith("call_")
    parameters = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), parameters)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_tool_call_validates_and_streams_the_same(served, client, tool_choice):
    """tool_choice required or a named function: one call whose arguments validate against the
    function's parameters, finish_reason tool_calls; the stream joined as the SDK joins it is the
    same call (name and arguments; a fresh id of the same form)."""
    messages = [{"role": "user", "content": "Add 2 and 3, or tell me the weather."}]
    names = {"add"} if isinstance(tool_choice, dict) else {t["function"]["name"] for t in TOOLS}
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                         max_tokens=120, temperature=0)
    choice = out.choices[0]
    calls = whole_calls(choice.message)
    assert len(calls) == 1 and choice.finish_reason == "tool_calls" and not choice.message.content
    _valid_call(calls[0], names)
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                            max_tokens=120, temperature=0, stream=True)
    content, reasoning, s_calls, finish = assembled(stream)
    assert (content, reasoning, finish) == (None, None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(calls[0]["name"], calls[0]["arguments"])]
    _valid_call(s_calls[0], names)


CALL_BLOCK = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_the_model_writes(served, client, stream):
    """tool_choice auto on a model steered (a regex constraint) into writing a hermes block: the
    block is read into tool_calls, whole and streamed, and the content is empty."""
    steer = {"structured_outputs": {"regex": re.escape(CALL_BLOCK)}}
    messages = [{"role": "user", "content": "Add 1 and 2."}]
    fields = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=80, temperature=0, extra_body=steer)
    if stream:
        content, _, calls, finish = assembled(client.chat.completions.create(stream=True, **fields))
    else:
        out = client.chat.completions.create(**fields)
        content, calls, finish = out.choices[0].message.content, whole_calls(out.choices[0].message), \
            out.choices[0].finish_reason
    assert not content and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0]["id"].startswith("call_")


def test_an_agent_loop_sends_the_call_and_its_result_back(served, client, tokenizer):
    """The loop an agent runs: a forced call, the SDK's own message object appended with a tool
    result answering its id, and the next turn rendered with both (the call's arguments as the
    template writes them, the result in <tool_response>)."""
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    named = {"type": "function", "function": {"name": "add"}}
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=named,
                                           max_tokens=120, temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"sum": 5}'}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4, **GREEDY)
    history = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "add", "arguments": json.loads(call.function.arguments)}}]}, messages[2]]
    rendered = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_response>\n{"sum": 5}\n</tool_response>' in rendered
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
