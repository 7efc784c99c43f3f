"""Issue 58: the Claude Code and Codex CLIs against the server. Their captured request bodies
(``cli_requests/``: Claude Code 2.1.197's Messages requests, Codex CLI 0.171.0's Responses
requests, each a first turn and the turn that sends a tool's result back; the README there says
how they were captured and what was replaced) are replayed through a served tiny model: each is a
200 whose stream is well formed, and keep-alives (Anthropic ``ping``, Responses
``response.in_progress``) go out while its ~25,000-token prompt is prefilled. Claude Code's
mid-conversation system turns render where they stand (or fold into a user turn where the
template takes no system turn but a first), Codex's ``namespace`` tools are offered as functions
whose calls come back with their namespace, its hosted tools are dropped (a 400 where
``tool_choice`` forces one), and a prompt the context cannot hold is a 400 in Anthropic's words
with the numbers Claude Code reads.

The replays rewrite ``max_tokens`` / ``max_output_tokens`` (the random model would write until
the context is full) and put a marker before the prompt (so no replay finds another's prompt in
the prefix cache and each prefills it whole); nothing else. The bodies' ``model`` is the
served name (``tiny``, as captured)."""
from __future__ import annotations

import copy
import http.client
import importlib
import json
import re
import uuid
from pathlib import Path

import pytest

from agent_cases import TOOLS_TEMPLATE
from engine.core.llm_engine import LLMEngine
from engine.core.tokenizer import load_tokenizer
from engine.entrypoints.server import anthropic, responses
from engine.entrypoints.server.anthropic_types import MessagesRequest
from engine.entrypoints.server.protocol import OpenAIProtocol
from engine.entrypoints.server.request_body import APIError
from engine.entrypoints.server.request_model import validated
from engine.entrypoints.server.responses_types import ResponsesRequest

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")

CAPTURED = Path(__file__).parent / "cli_requests"
CONTEXT = 32_768        # the demo model's context as the CLIs get it (a ~25k-token prompt fits)
KEEPALIVE_S = 0.02      # the served keep-alive interval: a prefill of ~25k tokens outlasts it many times
SERVED_NAME = "tiny"
# Claude Code 2.1.197's own patterns for the two context errors (its compaction and max_tokens retry)
PROMPT_TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
CONTEXT_LIMIT = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")
# templates that render no system turn but a first: one raises on another (as Mistral's and Gemma's
# do), one drops it
FIRST_SYSTEM_ONLY = ('{%- for m in messages %}{%- if m.role == "system" and not loop.first %}'
                     '{{ raise_exception("system turns must come first") }}{%- endif %}{%- endfor %}' + TOOLS_TEMPLATE)
LATER_SYSTEM_DROPPED = TOOLS_TEMPLATE.replace('{% else %}<|im_start|>{{ m.role }}',
                                              '{% elif m.role != "system" or loop.first %}<|im_start|>{{ m.role }}')


def captured(name: str) -> dict:
    """A captured request: ``path``, ``headers`` (the CLI's, less credentials) and ``body``."""
    request = json.loads((CAPTURED / f"{name}.json").read_text())
    assert request["body"]["model"] == SERVED_NAME
    return request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = server_cases.make_text_checkpoint(tmp_path_factory.mktemp("cli-model"), seed=13,
                                              chat_template=TOOLS_TEMPLATE, max_position_embeddings=CONTEXT)
    # prefill chunks of 1,024 tokens: on CPU a ~25k-token prompt prefills in half the time of 8,192-token ones
    engine = LLMEngine(model, block_size=16, max_num_seqs=2, max_model_len=CONTEXT, max_num_batched_tokens=1024)
    with server_cases.running_server(engine, SERVED_NAME, tool_call_parser="hermes",
                                     keepalive_interval=KEEPALIVE_S) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer():
    from engine.core.engine_config import DEFAULT_MODEL_DIR
    return load_tokenizer(DEFAULT_MODEL_DIR)


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, str, bytes]:
    """POST ``body`` to ``path``: the status, the content type and the raw answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        sent = {"content-type": "application/json", **{k.lower(): v for k, v in (headers or {}).items()}}
        connection.request("POST", path, json.dumps(body).encode(), sent)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def sse(raw: bytes) -> list[tuple[str | None, dict | None]]:
    """The events of an SSE answer, in order: (event name, data as JSON); a comment is (None, None)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name = data = None
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data = json.loads(value)
        events.append((name, data))
    return events


def fresh(body: dict, max_field: str, max_value: int) -> dict:
    """``body`` with ``max_field`` set and a marker of its own where the prompt begins (its first
    tool, its system prompt): no prefix-cache hit, the whole prompt prefills."""
    body = copy.deepcopy(body)
    marker = f"[replay {uuid.uuid4().hex}]\n"
    body["tools"][0]["description"] = marker + body["tools"][0]["description"]
    if "system" in body:
        body["system"][0]["text"] = marker + body["system"][0]["text"]
    else:
        body["input"][0]["content"][0]["text"] = marker + body["input"][0]["content"][0]["text"]
    return {**body, max_field: max_value}


def replay(served, name: str, max_field: str, max_value: int = 8) -> list[tuple[str | None, dict | None]]:
    request = captured(name)
    status, content_type, raw = post(served.url, request["path"], fresh(request["body"], max_field, max_value),
                                     request["headers"])
    assert status == 200, raw[:500]
    assert content_type.startswith("text/event-stream")
    return sse(raw)


def check_anthropic_stream(events: list[tuple[str | None, dict | None]]) -> int:
    """Anthropic's event sequence: message_start, then pings and whole content blocks, then
    message_delta and message_stop, each event's data typed by its name. The pings before the
    first block."""
    assert all(name is not None and data["type"] == name for name, data in events), events[:5]
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "error" not in names
    open_index = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None
    content = [i for i, name in enumerate(names) if name.startswith("content_block")] + [len(names) - 2]
    return names[:content[0]].count("ping")


def check_responses_stream(events: list[tuple[str | None, dict | None]]) -> tuple[int, dict]:
    """The Responses events: response.created, response.in_progress ..., response.completed (or
    .incomplete), each typed by its name, sequence numbers 0, 1, 2 ...; the in_progress events
    before the first output item, and the final response."""
    assert all(name is not None and data["type"] == name for name, data in events), events[:5]
    names = [name for name, _ in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    assert "error" not in names
    first_item = names.index("response.output_item.added") if "response.output_item.added" in names else len(names)
    return names[:first_item].count("response.in_progress"), events[-1][1]["response"]


@pytest.mark.parametrize("name", ["claude_code_first_turn", "claude_code_tool_result_turn"])
def test_claude_code_turns_stream_whole_with_pings_while_the_prompt_prefills(served, name):
    """Each captured turn (a system turn in the middle of ``messages``, ``thinking: adaptive``,
    ``output_config.effort``, ``context_management``, ``metadata``, 24 tools, ~25k tokens): a
    200 whose stream is Anthropic's sequence, with pings beyond the opening one before the first
    content block (sent while the prompt prefilled)."""
    pings = check_anthropic_stream(replay(served, name, "max_tokens"))
    assert pings >= 2, f"only {pings} ping(s) before the content: none while the prompt prefilled"


@pytest.mark.parametrize("name", ["codex_first_turn", "codex_tool_result_turn"])
def test_codex_turns_stream_whole_with_keepalives_while_the_prompt_prefills(served, name):
    """Each captured turn (``client_metadata``, a ``namespace`` tool, a hosted ``web_search``,
    developer messages, ``reasoning.summary``, ``include``): a 200 whose stream is the Responses
    sequence, with ``response.in_progress`` again before the first output item (sent while the
    prompt prefilled)."""
    keepalives, final = check_responses_stream(replay(served, name, "max_output_tokens"))
    assert keepalives >= 2, f"only {keepalives} response.in_progress before the output: none while it prefilled"
    assert final["usage"]["input_tokens"] > 10_000


def test_a_call_of_a_namespace_function_names_it_and_its_namespace(served):
    """Codex routes a call by ``name`` and ``namespace`` (a flat name is "unsupported call"): a
    forced call of the namespace's function comes back so, whole and streamed."""
    body = captured("codex_first_turn")["body"]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    close = next(f for f in namespace["tools"] if f["name"] == "close_agent")
    asked = {**body, "tools": [{**namespace, "tools": [close]}], "tool_choice": "required",
             "max_output_tokens": 64, "stream": False, "input": [{"role": "user", "content": "close agent 7"}]}
    status, _, raw = post(served.url, "/v1/responses", asked)
    assert status == 200, raw[:300]
    calls = [item for item in json.loads(raw)["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["namespace"]) for c in calls] == [("close_agent", namespace["name"])]
    events = sse(post(served.url, "/v1/responses", {**asked, "stream": True})[2])
    _, final = check_responses_stream(events)
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    for item in added + final["output"]:
        assert (item["name"], item["namespace"]) == ("close_agent", namespace["name"]), item


def test_a_forced_hosted_tool_is_a_400_naming_tool_choice(served):
    body = {**captured("codex_first_turn")["body"], "tool_choice": {"type": "web_search"}}
    status, _, raw = post(served.url, "/v1/responses", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tool_choice" and "web_search" in error["message"], error


def test_the_context_errors_are_anthropics_with_their_numbers(served, tokenizer):
    """As captured (max_tokens 32000), the first turn exceeds the context with its output: Claude
    Code's "input length and `max_tokens` exceed context limit: N + 32000 > 32768" (N: the
    prompt's tokens, as count_tokens counts them); a prompt of more tokens than fit, or of more
    characters than any tokens that fit can hold: "prompt is too long: N tokens > 32767 maximum"
    (N: its tokens, at least). Each an invalid_request_error; the chat route's code stays
    OpenAI's context_length_exceeded."""
    request = captured("claude_code_first_turn")
    body = request["body"]
    status, _, raw = post(served.url, request["path"], body, request["headers"])
    error = json.loads(raw)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    prompt, max_tokens, limit = map(int, CONTEXT_LIMIT.search(error["error"]["message"]).groups())
    status, _, raw = post(served.url, "/v1/messages/count_tokens", {k: v for k, v in body.items()
                                                                     if k not in ("max_tokens", "stream")})
    assert status == 200 and (prompt, max_tokens, limit) == (json.loads(raw)["input_tokens"], 32_000, CONTEXT)

    def too_long(text: str) -> tuple[int, int]:
        long = copy.deepcopy(body)
        long["messages"][0]["content"].append({"type": "text", "text": text})
        status, _, raw = post(served.url, request["path"], {**long, "max_tokens": 1}, request["headers"])
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "invalid_request_error", error
        found = PROMPT_TOO_LONG.search(error["message"])
        assert found, error["message"][:200]
        return int(found.group(1)), int(found.group(2))

    tokens, most = too_long(" word" * 10_000)
    assert most == CONTEXT - 1 and tokens > most
    huge = "x" * (CONTEXT * max(map(len, tokenizer.get_vocab())) + 1)  # more than any CONTEXT tokens can hold
    tokens, most = too_long(huge)
    assert most == CONTEXT - 1 and tokens > most
    status, _, raw = post(served.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"


def rendered(tokenizer, gen) -> str:
    return tokenizer.decode(gen.choices[0].prompt_token_ids)


def messages_protocol(tokenizer, template: str) -> OpenAIProtocol:
    return OpenAIProtocol(tokenizer, SERVED_NAME, CONTEXT, 8192, tool_call_parser="hermes", chat_template=template)


@pytest.mark.parametrize("refusing", [FIRST_SYSTEM_ONLY, LATER_SYSTEM_DROPPED], ids=["raises", "drops"])
def test_a_mid_conversation_system_turn_renders_where_it_stands_or_folds_into_a_user_turn(tokenizer, refusing):
    """Claude Code's system turn after its first user turn: a system turn of its own right there
    where the template renders one anywhere; where the template renders no system turn but a
    first (it raises on another, or drops it), its text inside the user turn (the last one before
    it: no user turn follows), the system prompt still first."""
    body = captured("claude_code_tool_result_turn")["body"]
    system = next(m["content"] for m in body["messages"] if m["role"] == "system")
    asked = {**body, "max_tokens": 8}
    anywhere = messages_protocol(tokenizer, TOOLS_TEMPLATE)
    prompt = rendered(tokenizer, anthropic.parse(anywhere, validated(MessagesRequest, asked,
                                                                                anywhere.limits)))
    user_turn = prompt.index("run pwd with Bash, then say hi<|im_end|>")
    assert prompt.index(f"<|im_start|>system\n{system}<|im_end|>") > user_turn
    assert anthropic.renders_system_anywhere(tokenizer, TOOLS_TEMPLATE)
    assert not anthropic.renders_system_anywhere(tokenizer, refusing)
    first_only = messages_protocol(tokenizer, refusing)
    prompt = rendered(tokenizer, anthropic.parse(first_only, validated(MessagesRequest, asked, first_only.limits)))
    assert f"<|im_start|>system\n{system}" not in prompt
    assert f"run pwd with Bash, then say hi\n\n{system}<|im_end|>" in prompt
    assert prompt.index("<|im_start|>assistant\n<tool_call>") > prompt.index(system)


def test_codex_tools_reach_the_template_flattened_and_hosted_ones_dropped(tokenizer):
    """The namespace's functions are offered under ``<namespace>__<name>`` (its description first),
    ``web_search`` is not offered at all, and a call sent back with its namespace (as Codex sends
    one) renders under the flat name."""
    request = captured("codex_tool_result_turn")["body"]
    call = next(item for item in request["input"] if item["type"] == "function_call")
    call.update(name="close_agent", namespace="multi_agent_v1")  # the shape Codex 0.171.0 sends back
    protocol = OpenAIProtocol(tokenizer, SERVED_NAME, CONTEXT, 8192, tool_call_parser="hermes",
                              chat_template=TOOLS_TEMPLATE)
    gen, _, names = responses.parse(protocol, validated(ResponsesRequest, request, protocol.limits))
    prompt = rendered(tokenizer, gen)
    assert names["multi_agent_v1__close_agent"] == ("multi_agent_v1", "close_agent")
    assert '"name": "multi_agent_v1__spawn_agent", "description": "Tools for spawning and managing sub-agents.' \
        in prompt
    assert '"type": "web_search"' not in prompt and '"name": "exec_command"' in prompt
    assert '<tool_call>\n{"name": "multi_agent_v1__close_agent"' in prompt
    with pytest.raises(APIError) as refused:
        hosted = {**request, "tool_choice": {"type": "web_search_preview"}}
        responses.parse(protocol, validated(ResponsesRequest, hosted, protocol.limits))
    assert refused.value.param == "tool_choice"
