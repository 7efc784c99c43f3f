"""``serve`` runs its engine in processes of its own (``engine.core.core_processes``): the step
never waits for the front's Python work, data-parallel cores give one core's greedy text, and a
core or a front that dies takes the server down cleanly. Each test runs ``python -m engine serve``
on the demo model as a user does (a subprocess), or the front in this process over real core
processes where a test must look inside."""
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from http.client import HTTPConnection

from engine.core.core_processes import CoreProcesses
from engine.core.engine_args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.app import LARGE_BODY_BYTES, OpenAIServer
from engine.entrypoints.server.metrics import ServerMetrics
from server_cases import (
    HANG_GUARD_S,
    http,
    metrics,
    running_server,
    start_server_process,
    stop_server_process,
)

DEMO = [sys.executable, "-m", "engine", "serve", "--port", "0", "--served-model-name", "tiny"]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def read_lines(path):", "for i in range(",
           "# sort a list\n", "with open(", "def main():"]


def core_pids(url: str) -> list[int]:
    status, raw = http(url + "/health")
    assert status == 200, raw
    return json.loads(raw)["engine_core_pids"]


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(condition, what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.05)


def complete(url: str, prompt: str, max_tokens: int = 24) -> dict:
    status, raw = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True})
    assert status == 200, raw
    return json.loads(raw)


def test_serve_steps_in_a_process_other_than_the_http_servers():
    """``serve`` answers from an engine core in another process (its pid in /health), the core
    ends with the server (SIGTERM drains both, exit 0)."""
    server = start_server_process(DEMO)
    try:
        pids = core_pids(server.url)
        assert len(pids) == 1 and pids[0] != server.pid and not gone(pids[0]), (pids, server.pid)
        assert complete(server.url, PROMPTS[0])["choices"][0]["text"]
    finally:
        rc = stop_server_process(server, signal.SIGTERM)
    assert rc == 0, "".join(server.stderr)
    wait_for(lambda: gone(pids[0]), "the engine core exits with the server")


def sse_events(response) -> list[bytes]:
    """The ``data:`` payloads of a Server-Sent Events response, read to its end."""
    return [line[6:].strip() for line in response if line.startswith(b"data: ")]


def test_data_parallel_cores_give_one_cores_greedy_text_and_both_serve():
    """``--data-parallel-size 2``: concurrent greedy completions equal the engine's own (one core's)
    text; both cores serve them (/metrics per core, and their sum); a prompt sent again goes back to
    the core that holds its first blocks (a prefix-cache hit). Then kill -9 of the front: both
    cores exit."""
    engine = LLMEngine(EngineArgs(serving=True).create_engine_config())
    expected = engine.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    block_size = engine.engine_config.cache.block_size
    del engine
    server, pids = start_server_process(DEMO + ["--data-parallel-size", "2"]), []
    try:
        pids = core_pids(server.url)
        assert len(pids) == 2 and server.pid not in pids, pids
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            answers[i] = complete(server.url, PROMPTS[i])["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD_S)
        assert [answers.get(i) for i in range(len(PROMPTS))] == expected
        served = metrics(server.url)
        per_core = [served[f"agent_infer:generation_tokens_total{{core={core}}}"] for core in (0, 1)]
        assert all(per_core) and sum(per_core) == served["agent_infer:generation_tokens_total"] == 24 * len(PROMPTS)

        long_prompt = "def add(a, b):\n    return a + b\n" * 8
        before = metrics(server.url)["agent_infer:prefix_cache_hits_total"]
        complete(server.url, long_prompt, max_tokens=2)
        complete(server.url, long_prompt, max_tokens=2)
        hits = metrics(server.url)["agent_infer:prefix_cache_hits_total"] - before
        assert hits >= 2 * block_size, f"the prompt sent again found {hits:g} tokens cached on its core"

        server.process.kill()
        server.process.wait(HANG_GUARD_S)
        for pid in pids:
            wait_for(lambda: gone(pid), f"engine core {pid} exits once the front is killed")
    finally:
        stop_server_process(server, signal.SIGTERM)
        for pid in pids:  # none is left behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_core_killed_mid_stream_ends_the_stream_with_an_error_and_the_server_with_status_1():
    """kill -9 of the engine core while a stream runs: the stream ends with an error event (no
    [DONE]) and ``serve`` exits with status 1 (for its supervisor)."""
    server = start_server_process(DEMO)
    try:
        pid = core_pids(server.url)[0]
        host, port = server.url.removeprefix("http://").split(":")
        connection = HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: {"), first
        os.kill(pid, signal.SIGKILL)
        events = sse_events(response)
        connection.close()
        assert events and b"[DONE]" not in events, events[-3:]
        error = json.loads(events[-1])["error"]
        assert error["code"] == 500 or "died" in error["message"], error
        assert server.process.wait(HANG_GUARD_S) == 1, "".join(server.stderr)
    finally:
        stop_server_process(server, signal.SIGTERM)


def test_after_its_core_died_the_front_answers_503():
    """The front in this process over a real core process: once kill -9 has ended the core,
    /health and new requests are 503 error objects naming the core's death, and the client's
    ``on_exit`` has run (``serve`` then exits non-zero)."""
    client = CoreProcesses(EngineArgs(serving=True).create_engine_config(), ServerMetrics())
    client.start()
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, event_loop).result(HANG_GUARD_S)

    async def make():
        return OpenAIServer(client, "tiny")

    server = run(make())
    try:
        url = f"http://127.0.0.1:{run(server.start('127.0.0.1', 0))}"
        assert complete(url, PROMPTS[1], max_tokens=4)["choices"][0]["text"]
        os.kill(client.pids[0], signal.SIGKILL)
        wait_for(lambda: client.failure is not None, "the front notices the core's death")
        for status, raw in (http(url + "/health"), http(url + "/v1/completions", {"model": "tiny", "prompt": "x"})):
            assert status == 503 and "died" in json.loads(raw)["error"]["message"], raw
        assert server.done.is_set()
    finally:
        run(server.stop())
        client.stop()
        event_loop.call_soon_threadsafe(event_loop.stop)
        thread.join(10)


def test_a_large_body_is_read_in_a_worker_process_as_a_thread_reads_it():
    """A small body is read on a thread (no worker process starts); a body of LARGE_BODY_BYTES or
    more in a request worker process with its own protocol, answered as the front would: /tokenize
    of a 100 KB prompt gives the tokenizer's own ids; the worker process ends with its server."""
    engine = LLMEngine(EngineArgs(serving=True).create_engine_config())
    with running_server(engine) as running:
        processes = running.server.large_requests
        small = http(running.url + "/tokenize", {"model": "tiny", "prompt": "def f(x):"})
        assert small[0] == 200 and processes.pids() == [], small
        prompt = "def add(a, b):\n    return a + b\n" * 3000
        assert len(prompt) > LARGE_BODY_BYTES
        status, raw = http(running.url + "/tokenize", {"model": "tiny", "prompt": prompt})
        assert status == 200 and json.loads(raw)["tokens"] == engine.tokenizer.encode(prompt), raw[:300]
        workers = processes.pids()
        assert workers and os.getpid() not in workers, workers
    for pid in workers:
        wait_for(lambda: gone(pid), f"request worker process {pid} ends with its server")
