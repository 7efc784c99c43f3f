"""No request can stall, starve or crash the server: each attack found against it (issue 46), sent
beside a good streaming client whose greedy text must not change and which must never wait long
for its next chunk (``Witness``: its longest wait against its whole quiet stream, measured in the
same run); each bad input a 4xx error object that never
echoes the input back; the server idle afterwards (every block free, /metrics at rest).

The server runs a tiny random model with the demo model's byte-level tokenizer and a long
max_model_len, so a text prompt can be long enough for its tokenizing to take seconds: where that
runs (a request worker thread, never the event loop) is what the witness sees."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.request_body import MAX_JSON_DEPTH, RequestLimits
from server_cases import (
    CHAT_TEMPLATE,
    HANG_GUARD_S,
    Witness,
    assert_error_object,
    assert_malformed_refused,
    costly_tools,
    http,
    make_text_checkpoint,
    metrics,
    post_reading_early,
    running_server,
    send_and_leave,
    wait_idle,
)

MAX_MODEL_LEN = 32768
SMALL_ERROR = 1024  # bytes: an error object names the field and the cap, never the input
TOOLS_FIRST = "{% if tools %}tools {{ tools | tojson }} . {% endif %}" + CHAT_TEMPLATE  # writes tools as agents' do


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_text_checkpoint(tmp_path_factory.mktemp("text-model"), seed=11, chat_template=TOOLS_FIRST,
                                 max_position_embeddings=MAX_MODEL_LEN)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, limits=RequestLimits(prompts=8)) as running:
        yield running


@pytest.fixture(scope="module")
def witness(served):
    return Witness(served.url)


def post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def refused(served, path: str, body: dict | bytes, param: str | None, status: int = 400,
            headers: dict | None = None) -> dict:
    """``body`` sent to ``path`` is refused with ``status`` naming ``param``, in a small error object."""
    got, raw = post(served.url + path, body, headers)
    assert got == status, (got, raw[:300])
    assert len(raw) < SMALL_ERROR, f"the error echoes the input back ({len(raw)} bytes)"
    return assert_error_object(raw, param)


def test_list_attacks_are_refused_at_their_caps_beside_a_good_stream(served, witness):
    """40,000 bad words, 10,000 prompts, 100,000 logit_bias entries and stop token ids, 1,000 stop
    strings, 8 prompts x n=16 sequences, 5,000 messages of 2,000 parts: each a 400 naming the field
    and its cap, at once."""
    url = "/v1/completions"
    attacks = [  # (path, body, the field named, what the message says)
        (url, {"prompt": "x", "bad_words": [f"word{i}" for i in range(40_000)]}, "bad_words", "at most 64 strings"),
        (url, {"prompt": ["x"] * 10_000}, "prompt", "takes at most 8"),
        (url, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias", "takes at most 1024"),
        (url, {"prompt": "x", "stop_token_ids": list(range(100_000))}, "stop_token_ids", "at most 64 token ids"),
        (url, {"prompt": "x", "stop": ["s"] * 1000}, "stop", "at most 16 stop strings"),
        (url, {"prompt": ["x"] * 8, "n": 16}, "n", "128 sequences (8 prompts x n=16); this server takes at most 32"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 5000}, "messages",
         "takes at most 4096"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2000}]},
         "messages[0].content", "takes at most 1024"),
    ]
    for path, body, param, message in attacks:
        raw = json.dumps(body).encode()  # before the witness runs (see Witness.beside)
        error = witness.beside(lambda: refused(served, path, raw, param))
        assert message in error["message"], error
    assert refused(served, url, {"prompt": ["x"] * 9}, "prompt")["message"].endswith("(serve --max-prompts)")
    assert http(served.url + url, {"prompt": ["x"] * 8, "max_tokens": 1})[0] == 200  # at the cap: served
    assert refused(served, url, {"prompt": ["x"] * 3, "n": 11}, "n")["message"].endswith(
        "(serve --max-sequences-per-request)")  # 4 x max_num_seqs by default
    assert http(served.url + url, {"prompt": ["x"] * 2, "n": 16, "max_tokens": 1})[0] == 200
    wait_idle(served.engine_client)


def test_a_huge_prompt_is_read_off_the_event_loop(served, witness):
    """A 31 MB body is a 413 before it is decoded; a 7 MB prompt (more characters than
    max_model_len tokens can hold) is a 400 before it is tokenised; a prompt just under that bound
    is tokenised on a request worker while the witness streams on, then refused naming
    max_model_len."""
    huge = "the quick brown fox " * ((31 << 20) // 20)
    raw = json.dumps({"prompt": huge}).encode()  # each body built before the witness runs
    status, answer = witness.beside(lambda: post_reading_early(served.url, "/v1/completions", raw))
    assert status == 413 and len(answer) < SMALL_ERROR, (status, answer[:300])
    assert_error_object(answer)
    raw = json.dumps({"prompt": huge[:7 << 20]}).encode()
    error = witness.beside(lambda: refused(served, "/v1/completions", raw, "prompt"))
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"], error
    bound = served.server.protocol.max_prompt_chars
    raw = json.dumps({"prompt": ("def f(x):\n    return x + 1\n" * (bound // 27 + 1))[:bound]}).encode()
    error = witness.beside(lambda: refused(served, "/v1/completions", raw, "prompt"))
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"], error
    wait_idle(served.engine_client)


def test_malformed_bodies_are_400s_never_500s(served, witness):
    """Bodies nested past the depth limit, lone surrogates in a prompt, a message and /tokenize, a
    body that is not JSON by its content type: each a 4xx error object beside the witness."""
    deep = b'{"prompt": "x", "metadata": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    witness.beside(lambda: refused(served, "/v1/completions", deep, None))
    just = b'{"prompt": "x", "max_tokens": 1, "metadata": {"k": ' + b"[" * (MAX_JSON_DEPTH - 3) + \
        b"]" * (MAX_JSON_DEPTH - 3) + b"}}"
    assert post(served.url + "/v1/completions", just)[0] == 200  # within the limit: served
    for path, raw in [("/v1/completions", b'{"prompt": "a\\ud800b"}'),
                      ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
                      ("/tokenize", b'{"prompt": "\\ud83d"}')]:
        assert "surrogate" in refused(served, path, raw, None)["message"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        refused(served, "/v1/completions", {"prompt": "x"}, None, status=415, headers={"Content-Type": content_type})
    assert post(served.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    wait_idle(served.engine_client)


MALFORMED_CASES = [  # (route, a good body, the fields a client may have left out)
    ("/v1/completions", {"model": "tiny", "prompt": ["def f(", "x = "], "max_tokens": 2, "temperature": 0,
                         "stop": ["\n\n"], "logit_bias": {"5": 1}, "logprobs": 1, "seed": 3, "bad_words": ["zz"],
                         "stop_token_ids": [0], "stream_options": {"include_usage": True}, "user": "u"},
     {"prompt"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "response_format": {"type": "text"}, "stop": "x", "n": 2}, {"messages", "role", "content", "type", "text"}),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, {"role", "prompt"}),
    ("/tokenize", {"prompt": "def f(x):", "add_special_tokens": True}, {"prompt"}),
    ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}, {"tokens"}),
]


def test_every_malformed_value_is_a_4xx_naming_the_clients_field(served, witness):
    """Each value of a completions, chat, /tokenize and /detokenize body replaced by an array, an
    object, a number, a string, a boolean or null (a list or an object where a string belongs was a
    500): answered, or a 4xx error object naming the field the client sent (never one the server
    made of it), never a 500, beside a good stream."""
    refused = witness.beside(lambda: [assert_malformed_refused(served.url, route, body, required)
                                      for route, body, required in MALFORMED_CASES])
    assert all(refused), refused
    wait_idle(served.engine_client)


def test_costly_requests_stop_when_their_clients_go(served, witness):
    """Four chat requests of 128 tools of 150 properties (2.6 MiB each, under every cap; under this
    server's long context they pass the length bound, so their tools are checked, rendered and
    tokenised) from clients that leave at once: their work stops with them (one not yet taken by
    a worker costs nothing), so a 1-token completion right after is answered within 3 s, and a
    good stream beside them keeps its bound. One such request whose client stays is a 400 naming
    max_model_len (its rendered tools are some 700,000 tokens)."""
    raw = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "tools": costly_tools()}).encode()

    def attack() -> float:
        for _ in range(4):
            send_and_leave(served.url, "/v1/chat/completions", raw)
        start = time.monotonic()
        status, _ = http(served.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert status == 200
        return time.monotonic() - start

    assert witness.beside(attack) <= 3.0
    error = refused(served, "/v1/chat/completions", raw, "messages")
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"], error
    wait_idle(served.engine_client)


def test_the_reading_of_a_request_stops_once_its_client_has_gone(served, monkeypatch):
    """A chat request whose client leaves while a request worker reads it is never tokenised: the
    worker stops at its next stage. (The client leaves once the worker has begun; the template then
    waits, in the worker, until the server has seen the client go, for at most 10 s: guards, never
    sleeps, so the order is the same on any host.)"""
    from engine.entrypoints.server.request_body import client_gone

    protocol, tokenizer = served.server.protocol, served.server.protocol.tokenizer
    read, render, encode = protocol.chat, tokenizer.apply_chat_template, tokenizer.encode
    encoded, started, ended = [], threading.Event(), threading.Event()

    def render_once_gone(*args, **kwargs):
        gone, deadline = client_gone.get(), time.monotonic() + 10
        while not gone.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return render(*args, **kwargs)

    def read_to_its_end(request):
        started.set()
        try:
            return read(request)
        finally:
            ended.set()

    monkeypatch.setattr(protocol, "chat", read_to_its_end)
    monkeypatch.setattr(tokenizer, "apply_chat_template", render_once_gone)
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(text) or encode(text, **kw))
    raw = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "nobody waits"}],
                      "max_tokens": 1}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        assert started.wait(HANG_GUARD_S), "the request was never read"
    assert ended.wait(HANG_GUARD_S), "the request's reading never ended"
    assert not any("nobody waits" in text for text in encoded), "the request of a client that had gone was tokenised"


def test_a_chat_that_cannot_fit_is_refused_before_it_is_rendered(served, monkeypatch):
    """Tools whose JSON alone is more characters than the context's length bound (128 tools of 230
    properties, 4 MiB, under the body cap) are a 400 naming tools (context_length_exceeded) before
    the template renders anything."""
    tokenizer = served.server.protocol.tokenizer
    rendered = []
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **kw: rendered.append(a) or "")
    tools = costly_tools(properties=230)
    assert len(json.dumps(tools)) > served.server.protocol.max_prompt_chars
    error = refused(served, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode(), "tools")
    assert error["code"] == "context_length_exceeded" and not rendered, error


def test_the_server_is_idle_after_the_attacks(served, witness):
    """After every attack of the module: the witness still gets its text without a stall,
    /health answers, the engine holds no request, /metrics shows nothing running or waiting."""
    witness.beside(lambda: http(served.url + "/health")[0])
    wait_idle(served.engine_client)
    values = metrics(served.url)
    assert values["agent_infer:num_requests_running"] == 0 and values["agent_infer:num_requests_waiting"] == 0
