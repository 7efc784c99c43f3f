"""Shared by the phase-10 server tests: a tiny checkpoint whose every token is a word, a chat
template, the server run in a background thread, checks on the engine once it is idle, and ways
to make the engine wait for a client (so no assertion depends on how the threads are scheduled)."""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Callable

from engine.core.engine_client import InProcessClient
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.lockstep import mirror_rank0
from engine.entrypoints.server.app import OpenAIServer
from engine.entrypoints.server.metrics import ServerMetrics
from phases.checkpoints import WORDS, make_tiny_checkpoint

engine_cases = importlib.import_module("phases.09_engine_integration.engine_cases")

# How long a test waits for a condition before it fails on it: a guard against a hang, never
# what a test asserts (every wait polls its condition and ends as soon as it holds).
HANG_GUARD_S = 60.0

# Every id of this vocabulary is a word or a special token, so generated text is never empty by accident.
VOCAB = 2 + len(WORDS)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} said {{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}assistant said{% endif %}")
PROMPTS = ["the quick brown fox", "a garden of light", "river city mountain dark and lazy dog", "it is",
           "the", "over the lazy dog was a fox", "this light is from the city", "by the river"]


def make_word_checkpoint(path: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A tiny random Qwen3 checkpoint whose vocabulary is exactly the tokenizer's words, with
    ``chat_template`` written into tokenizer_config.json (None: no template)."""
    make_tiny_checkpoint(path, "Qwen3ForCausalLM", seed, vocab_size=VOCAB)
    if chat_template is not None:
        config_file = path / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": chat_template}))
    return path


def make_text_checkpoint(path: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
                         **overrides) -> Path:
    """A tiny random Qwen3 with the demo model's byte-level tokenizer (vocabulary 8192; its
    <|endoftext|>, id 0, is the EOS), so any text encodes as it would for a real checkpoint, and
    ``chat_template``; ``overrides`` replace entries of the tiny config."""
    make_tiny_checkpoint(path, "Qwen3ForCausalLM", seed, vocab_size=8192, **overrides)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": 0}))
    (path / "tokenizer.json").write_bytes((DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes())
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return path


@dataclass
class Running:
    server: OpenAIServer
    url: str  # http://127.0.0.1:PORT

    @property
    def engine_client(self) -> InProcessClient:
        return self.server.engine_client


@contextlib.contextmanager
def running_server(engine, model_name: str = "tiny", metrics: ServerMetrics | None = None, **options):
    """Serve ``engine`` on a free loopback port from a background event loop; stopped on exit
    (which, under torchrun, sends the worker ranks their stop command). ``options`` go to
    ``OpenAIServer`` (parsers, chat template, API key ...)."""
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, name="http", daemon=True)
    thread.start()

    def run(coroutine, timeout=60):
        return asyncio.run_coroutine_threadsafe(coroutine, event_loop).result(timeout)

    async def make():
        return OpenAIServer(InProcessClient(engine, metrics or ServerMetrics()), model_name, **options)

    server = run(make())
    try:
        port = run(server.start("127.0.0.1", 0))
        yield Running(server, f"http://127.0.0.1:{port}")
    finally:
        run(server.stop())
        server.engine_client.stop()  # also when start failed
        event_loop.call_soon_threadsafe(event_loop.stop)
        thread.join(10)
        event_loop.close()


# a TP worker waits this long for rank 0's stop (on a fresh GPU host the first requests also compile
# float32 kernels: 44 s seen)
TP_STOP_TIMEOUT_S = 120


def mirror_until_stopped(engine) -> None:
    """``mirror_rank0`` on a thread: fails when rank 0's stop has not come within TP_STOP_TIMEOUT_S."""
    errors = []

    def run():
        try:
            mirror_rank0(engine)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TP_STOP_TIMEOUT_S)
    assert not thread.is_alive(), f"rank {engine.tp.rank} is still mirroring: rank 0's stop never came"
    assert not errors, errors


def wait_idle(engine_client: InProcessClient, timeout: float = HANG_GUARD_S) -> None:
    """Wait until the engine has no unfinished request, then check that every KV block is free
    and every request was forgotten (popped). Requests submitted before the call count: a call
    runs while the engine thread takes its commands, before it adds the requests taken with it,
    so a first call only lets them reach the engine."""
    engine_client.call(lambda e: None)
    deadline = time.monotonic() + timeout
    while engine_client.call(lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.05)
    engine_client.call(engine_cases.assert_no_block_leaks)
    held = engine_client.call(lambda e: sorted(e.request_ids()))
    assert not held, f"the server left requests {held} in the engine"


@contextlib.contextmanager
def held_steps(engine_client: InProcessClient, hold: Callable[[], bool], timeout: float = HANG_GUARD_S):
    """Inside, the engine takes no step while ``hold()`` is true: it is polled on the engine
    thread before each step, and a held step does nothing (adds, aborts and calls still run
    between them; a step with no unfinished request, which only reads back the step in flight
    of what was aborted, is never held). A test thereby makes the engine wait for its client,
    however the threads are scheduled. Yields a list that gets a message when one hold outlasts
    ``timeout`` seconds (a hang guard: the engine then steps freely); a test asserts it empty."""
    engine = engine_client.engine
    real_step, gave_up, since = engine.step, [], [None]

    def step():
        if not gave_up and engine.has_unfinished_requests() and hold():
            since[0] = since[0] or time.monotonic()
            if time.monotonic() - since[0] < timeout:
                time.sleep(0.001)
                return []
            gave_up.append(f"the engine waited {timeout:g} s for its client and went on without it")
        since[0] = None
        return real_step()

    engine.step = step
    try:
        yield gave_up
    finally:
        del engine.step


def posted_text(engine_client: InProcessClient) -> int:
    """(Engine thread.) Characters of text the engine has posted to the streams still running."""
    return sum(stream.text_length for stream in engine_client._streams.values())


@contextlib.contextmanager
def paused_until(engine_client: InProcessClient, condition: Callable[[], bool], timeout: float = HANG_GUARD_S):
    """Inside, the engine thread stops before it takes its next commands until ``condition()``
    holds (polled): requests submitted meanwhile queue, and start together once it does, however
    the HTTP thread is scheduled. Yields a list that gets a message if ``timeout`` seconds pass
    first (a hang guard: the engine then goes on); a test asserts it empty. Under TP the other
    ranks wait in their broadcast meanwhile, so ``timeout`` must stay below the collective timeout."""
    paused, gave_up = threading.Event(), []

    def pause(engine):
        paused.set()
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                gave_up.append(f"the engine waited {timeout:g} s for its clients and went on without them")
                return
            time.sleep(0.005)

    waiter = threading.Thread(target=engine_client.call, args=(pause, 2 * timeout), daemon=True)
    waiter.start()
    assert paused.wait(timeout), "the engine loop never ran the pause"
    try:
        yield gave_up
    finally:
        waiter.join(2 * timeout)


def metrics(url: str) -> dict[str, float]:
    """``GET /metrics`` parsed: every sample's name (with its labels, if any) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, raw = http(url + "/metrics")
    assert status == 200, raw
    values = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def http(url: str, body: bytes | dict | None = None, method: str | None = None) -> tuple[int, bytes]:
    """Raw HTTP (the openai client cannot send malformed requests): status and body."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def names_field(named: str | None, param: str) -> bool:
    """An error's ``named`` path is the field ``param`` or a part of it (``stop[0]`` of ``stop``)."""
    return named is not None and (named == param or named.startswith((param + ".", param + "[")))


def assert_error_object(raw: bytes, param: str | None = None, code: str | None = None) -> dict:
    """``raw`` is an OpenAI error object (naming this param, or a part of it, and with this code
    when given); returns its error."""
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert param is None or names_field(error["param"], param), error
    assert code is None or error["code"] == code, error
    return error


# What a malformed client puts where a value belongs: each kind of JSON value, the unhashable ones first
# (a list or an object where a string belongs was a 500 on five routes: a membership test raised TypeError).
MALFORMED = ([], {}, -3, 1.5, "x", True, None)


def malformed_bodies(body: dict):
    """``(path, body with the value at path replaced)`` for every value inside ``body`` (objects'
    values and arrays' items, at any depth) and each of ``MALFORMED``: the fuzz of issue 57."""
    def paths(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from paths(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from paths(item, f"{path}[{i}]")
        if path:
            yield path

    for path in list(paths(body, "")):
        for bad in MALFORMED:
            changed = json.loads(json.dumps(body))
            parent, key = _parent(changed, path)
            parent[key] = bad
            yield path, changed


def _parent(body, path: str):
    steps = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    value = body
    for step in steps[:-1]:
        value = value[int(step[1:-1])] if step.startswith("[") else value[step]
    last = steps[-1]
    return value, int(last[1:-1]) if last.startswith("[") else last


def path_in(body, path: str, required: frozenset[str] = frozenset()) -> bool:
    """``path`` names a value of ``body``, or a field named in ``required`` missing from one of its
    objects: the client's own field, never one the server made from it."""
    value = body
    steps = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    for i, step in enumerate(steps):
        if step.startswith("[") and isinstance(value, list) and int(step[1:-1]) < len(value):
            value = value[int(step[1:-1])]
        elif isinstance(value, dict) and step in value:
            value = value[step]
        else:
            return i == len(steps) - 1 and isinstance(value, dict) and step in required
    return True


def assert_malformed_refused(url: str, route: str, body: dict, required: set[str], anthropic: bool = False) -> int:
    """Every malformed value of ``body`` (``malformed_bodies``) posted to ``route`` is answered 200
    or a 4xx error object in the route's shape (Anthropic's with ``anthropic``) naming a path of
    what the client sent (or a ``required`` field it left out), never a 500; returns how many were
    refused."""
    refused, required = 0, frozenset(required)
    for path, changed in malformed_bodies(body):
        status, raw = http(url + route, changed)
        assert status == 200 or 400 <= status < 500, (route, path, changed, status, raw[:300])
        if status == 200:
            continue
        refused += 1
        answer = json.loads(raw)
        if anthropic:
            assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, (path, answer)
            named = re.match(r"'([^']+)'", answer["error"]["message"])
            named = named and named.group(1)
        else:
            named = assert_error_object(raw)["param"]
        assert named is None or path_in(changed, named, required), (route, path, named, answer)
    return refused


def costly_tools(count: int = 128, properties: int = 150) -> list[dict]:
    """``count`` distinct function tools of ``properties`` described properties each: 128 x 150 is
    about 2.6 MiB of JSON, under every cap, whose schema checks and rendering cost 40-77 s of pure
    Python per request before issue 57."""
    def field(t: int, i: int) -> dict:
        return {"type": "string", "description": f"the field {i} of tool {t}, one of three",
                "enum": [f"v{t}-{i}-{j}" for j in range(3)]}

    return [{"type": "function", "function": {"name": f"tool_{t}", "description": f"tool number {t}", "parameters": {
        "type": "object", "properties": {f"field_{t}_{i}": field(t, i) for i in range(properties)}}}}
            for t in range(count)]


def post_reading_early(url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    """POST ``raw`` as the SDKs and curl do: reading an answer that comes while the body is still
    being sent (a 413 before the rest is read, the connection then closed). The status and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode())
        try:
            for i in range(0, len(raw), 1 << 20):
                sock.sendall(raw[i:i + (1 << 20)])
        except OSError:  # the server answered and closed: the answer is still there to read
            pass
        response = HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def send_and_leave(url: str, path: str, raw: bytes) -> None:
    """POST ``raw`` to ``path`` and close the connection at once, answer unread: a client that goes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)


# An attack may slow a good client (it takes a core off-loop) but never stall it: the longest wait for
# any of its chunks, the first included, is at most max(STALL_FLOOR_S, ATTACK_STALL x the longest wait of
# its quiet stream measured in the same run) -- a bound per chunk, the one a user feels. A stall is what
# work holding the interpreter lock or the event loop gives (seconds with nothing sent); an attack that
# takes a core only slows every chunk a little, which the bound allows.
ATTACK_STALL = 10.0
STALL_FLOOR_S = 0.5


@dataclass
class Witness:
    """A good client beside attacks: one streamed greedy completion of ``prompt`` (``max_tokens``,
    EOS ignored) whose text must not change and whose longest wait for a chunk (the first
    included) stays within ``max(STALL_FLOOR_S, ATTACK_STALL x`` the same wait of its quiet stream,
    measured alone right before``)``, so a machine busy with other work moves both alike.
    ``source`` is the loopback address it connects from (the server tells clients apart by it)."""
    url: str
    prompt: str = "def fibonacci(n):"
    max_tokens: int = 192
    source: str = "127.0.0.1"
    text: str | None = None

    def run(self, during: Callable[[], object] | None = None, first: bool = False
            ) -> tuple[str, float, float, object]:
        """Stream the completion; ``during()`` (an attack) runs on a thread once the first chunk
        has come (``first``: before the witness sends its request, so the attack is in the server
        first), overlapping the stream. Returns the text, the stream's seconds, the longest wait
        for a chunk (the first's counted from the request) and what ``during`` returned (waited
        for; what it raised is raised here)."""
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        result: list = []
        thread = None

        def attack():
            try:
                result.append(during())
            except BaseException as e:  # raised here, once the stream has been measured
                result.append(e)

        def start_attack():
            nonlocal thread
            thread = threading.Thread(target=attack, daemon=True)
            thread.start()

        if during is not None and first:
            start_attack()
        host, port = self.url.removeprefix("http://").split(":")
        connection = HTTPConnection(host, int(port), timeout=HANG_GUARD_S,
                                                source_address=(self.source, 0))
        start, parts, longest_wait = time.monotonic(), [], 0.0
        try:
            connection.request("POST", "/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200, (response.status, response.read()[:300])
            last = start  # the request's start: the first chunk's wait is its time to first token
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                longest_wait, last = max(longest_wait, now - last), now
                parts.append(json.loads(line[6:])["choices"][0]["text"])
                if thread is None and during is not None:
                    start_attack()
        finally:
            connection.close()
        seconds = time.monotonic() - start
        if thread is not None:
            thread.join(HANG_GUARD_S)
            assert not thread.is_alive(), "the attack never finished"
        if result and isinstance(result[0], BaseException):
            raise result[0]
        text = "".join(parts)
        assert self.text is None or text == self.text, "a good client's greedy output changed"
        self.text = text
        return text, seconds, longest_wait, result[0] if result else None

    def beside(self, attack: Callable[[], object], first: bool = False) -> object:
        """Run the witness alone, then beside ``attack`` (``first``: the attack starts before the
        witness's request): its text is unchanged and its longest wait for a chunk, the first
        included, within ``max(STALL_FLOOR_S, ATTACK_STALL x`` the quiet stream's``)``; returns
        what the attack returned. Build the attack's body before: encoding megabytes of JSON in
        this process holds the interpreter lock that the in-process server needs too."""
        _, _, quiet, _ = self.run()
        _, _, waited, outcome = self.run(attack, first)
        bound = max(STALL_FLOOR_S, ATTACK_STALL * quiet)
        assert waited <= bound, (
            f"a good client waited {waited:.2f} s for a chunk beside the attack; its quiet stream's longest "
            f"wait was {quiet:.3f} s (the bound: max({STALL_FLOOR_S:g} s, {ATTACK_STALL:g} x that) = {bound:.2f} s)")
        return outcome


REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    pid: int  # the serving process (rank 0 under torchrun)
    stderr: list[str]  # every line so far


def server_env() -> dict[str, str]:
    """The environment of a server subprocess: this tree first on its path (a script run by path,
    such as ``faulty_serve.py`` under torchrun, would otherwise import whatever ``engine`` the
    virtual environment's editable install points at), one OpenMP thread per process."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def start_server_process(command: list[str], timeout: float = 120.0) -> ServerProcess:
    """Run ``command`` (a ``... -m engine serve --port 0 ...``) from the repository root and wait
    for its "serving ... on http://HOST:PORT (pid N)" line on stderr."""
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env=server_env(), start_new_session=True)
    lines: list[str] = []
    banner: queue.Queue = queue.Queue()

    def read():
        for line in process.stderr:
            lines.append(line)
            if match := re.search(r"serving .* on (http://\S+) \(pid (\d+)\)", line):
                banner.put(match)
        banner.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        match = banner.get(timeout=timeout)
    except queue.Empty:
        match = None
    if match is None:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the server never started:\n" + "".join(lines))
    return ServerProcess(process, match[1], int(match[2]), lines)


def stop_server_process(server: ServerProcess, sig: int, pid: int | None = None, timeout: float = 60.0) -> int:
    """Send ``sig`` to ``pid`` (default: the process started) and return the exit code; kill the
    whole process group and fail when it does not exit within ``timeout``. A process that has
    already exited gets no signal: its exit code is returned."""
    if server.process.poll() is not None:
        return server.process.returncode
    os.kill(server.process.pid if pid is None else pid, sig)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        raise AssertionError(f"still running {timeout:g} s after signal {sig}:\n" + "".join(server.stderr)) from None
