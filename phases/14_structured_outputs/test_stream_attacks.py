"""The server's output parsers under attack (issue 57, item 2): a chat answer made of whitespace
tokens. The reasoning and hermes parsers hold whitespace back until what follows it is known (it
may come before a ``<think>`` or ``<tool_call>`` tag); held text that is re-sliced and stripped per
character makes each stream quadratic in its length (960 tokens of 51 spaces took 25 s against
11 s for a letter). Here the whitespace stream takes at most twice the letter stream's time (+1 s)
beside a good streaming client (phase 10's ``Witness``: its text unchanged, its longest wait for a
chunk bounded), it joins into the non-streamed answer, and whole parses of a long whitespace
answer (the Responses / Anthropic ``whole_blocks``, the chat message) finish at once."""
from __future__ import annotations

import http.client
import importlib
import json
import time

import pytest

from agent_cases import TOOLS, TOOLS_TEMPLATE
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.chat_output import ChatParsing
from engine.entrypoints.server.output_blocks import whole_blocks
from stream_cases import finishes

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")

MAX_TOKENS = 960  # the attack: 960 tokens of 51 spaces, about 49,000 characters
MAX_MODEL_LEN = 2048  # the prompt (the tools rendered) and MAX_TOKENS
# the whole parses' text: four times the attack's, so a quadratic parser takes minutes (a linear one milliseconds)
WHOLE_SPACES = 200_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = server_cases.make_text_checkpoint(tmp_path_factory.mktemp("stream-attack-model"), seed=13,
                                              chat_template=TOOLS_TEMPLATE, max_position_embeddings=MAX_MODEL_LEN)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with server_cases.running_server(engine, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture(scope="module")
def witness(served):
    return server_cases.Witness(served.url)


@pytest.fixture(scope="module")
def tokens(served) -> dict[str, int]:
    """The byte-level tokenizer's longest all-space token (51 spaces) and its ``a``."""
    tokenizer = served.engine_client.engine.tokenizer
    texts = {i: tokenizer.decode([i]) for i in range(8192)}
    spaces = max((i for i, t in texts.items() if t and set(t) == {" "}), key=lambda i: len(texts[i]))
    assert len(texts[spaces]) >= 32, texts[spaces]
    return {"spaces": spaces, "letter": next(i for i, t in texts.items() if t == "a")}


def ask(token_id: int, stream: bool, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "allowed_token_ids": [token_id], "stream": stream, **fields}


def chat(url: str, body: dict) -> tuple[dict, float]:
    """POST a chat completion; its message (a stream joined: content, reasoning_content, the calls'
    names and arguments, finish reason) and the seconds the whole answer took."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=server_cases.HANG_GUARD_S * 5)
    start = time.monotonic()
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, (response.status, response.read()[:300])
        if body["stream"]:
            fields, calls, finish = {"content": [], "reasoning_content": []}, {}, None
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    for key, parts in fields.items():
                        if choice["delta"].get(key):
                            parts.append(choice["delta"][key])
                    for call in choice["delta"].get("tool_calls") or []:
                        entry = calls.setdefault(call["index"], {"name": "", "arguments": []})
                        entry["name"] += call["function"].get("name") or ""
                        entry["arguments"].append(call["function"].get("arguments") or "")
                    finish = choice["finish_reason"] or finish
            message = {key: "".join(parts) or None for key, parts in fields.items()}
            message["tool_calls"] = [(c["name"], "".join(c["arguments"])) for _, c in sorted(calls.items())]
        else:
            choice = json.loads(response.read())["choices"][0]
            message, finish = choice["message"], choice["finish_reason"]
            message = {"content": message["content"], "reasoning_content": message.get("reasoning_content"),
                       "tool_calls": [(c["function"]["name"], c["function"]["arguments"])
                                      for c in message.get("tool_calls") or []]}
    finally:
        connection.close()
    return {**message, "finish_reason": finish}, time.monotonic() - start


@pytest.mark.parametrize("path", ["reasoning", "tools"])
def test_a_whitespace_stream_costs_what_a_letter_stream_costs(served, witness, tokens, path):
    """960 tokens of 51 spaces, streamed through the reasoning parser (every chat here) and, with
    ``tools``, the hermes parser too: at most twice the time of 960 ``a`` tokens (+1 s), each
    streamed beside the good client (never stalled), and the stream joins into the non-streamed answer (all of it
    content: no tag ever follows the held whitespace)."""
    fields = {"tools": TOOLS} if path == "tools" else {}
    _, letter_seconds = witness.beside(lambda: chat(served.url, ask(tokens["letter"], stream=True, **fields)))
    streamed, spaces_seconds = witness.beside(lambda: chat(served.url, ask(tokens["spaces"], stream=True, **fields)))
    assert spaces_seconds <= 2 * letter_seconds + 1, (
        f"the whitespace stream took {spaces_seconds:.1f} s, the letter stream {letter_seconds:.1f} s")
    whole, _ = chat(served.url, ask(tokens["spaces"], stream=False, **fields))
    assert streamed == whole
    assert whole["content"] and not whole["content"].strip(" ") and len(whole["content"]) >= 32 * MAX_TOKENS
    assert (whole["reasoning_content"], whole["tool_calls"], whole["finish_reason"]) == (None, [], "length")
    server_cases.wait_idle(served.engine_client)


def test_whole_parses_of_a_long_whitespace_answer_finish_at_once():
    """The Responses and Anthropic routes read a whole answer through the stream (``whole_blocks``),
    the chat route through ``ChatParsing.message``: 200,000 spaces, alone and before a letter or a
    tool call, parse within the hang guard and say what the parse of a short text says."""
    parsing = ChatParsing("hermes", "qwen3", tool_names=frozenset({"get_weather"}))
    spaces = " " * WHOLE_SPACES
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def run():
        return [(whole_blocks(parsing, text, "stop"), parsing.message(text, "stop"))
                for text in (spaces, spaces + "a", spaces + call)]

    (alone, alone_message), (letter, letter_message), (called, called_message) = finishes(run)
    assert [(b.kind, b.text) for b in alone[0]] == [("text", spaces)] and alone_message[0]["content"] == spaces
    assert [(b.kind, b.text) for b in letter[0]] == [("text", spaces + "a")]
    assert letter_message[0]["content"] == spaces + "a"
    assert [(b.kind, b.name, b.text) for b in called[0]] == [("tool_call", "get_weather", '{"city":"Paris"}')]
    assert called[1] == called_message[1] == "tool_calls" and called_message[0]["content"] is None
