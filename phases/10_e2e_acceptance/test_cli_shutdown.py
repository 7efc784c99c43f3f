"""How ``python -m engine serve`` stops, as a user runs it (subprocesses on a tiny checkpoint):
SIGTERM drains the requests in flight, and a rank failing mid-step under torchrun stops every
rank. Apart from test_cli.py so that xdist runs the two files' subprocesses side by side."""
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server_cases import (
    HANG_GUARD_S,
    PROMPTS,
    REPO,
    ServerProcess,
    assert_error_object,
    http,
    make_word_checkpoint,
    server_env,
    start_server_process,
    stop_server_process,
)

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU image


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_word_checkpoint(tmp_path_factory.mktemp("word-model"), seed=5)


def _stream_request(url: str, max_tokens: int, first_chunk: threading.Event, prompt: str = PROMPTS[0]):
    """A streaming completion: sets ``first_chunk`` when one arrives; (text, finish reason, error)."""
    texts, finish = [], None
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            for chunk in client.completions.create(model="word", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True}):
                first_chunk.set()
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        return "".join(texts), finish, None
    except Exception as e:  # an error chunk, or the connection closing
        first_chunk.set()
        return "".join(texts), finish, e


def _held_server(model_dir, hold: Path, shutdown_timeout: str) -> ServerProcess:
    """``serve`` whose engine stops stepping while ``hold`` exists and each request in it has an
    output token (``held_serve.py``): requests stay in flight until the test removes ``hold``,
    however fast the machine generates."""
    hold.touch()
    return start_server_process([sys.executable, str(REPO / "phases" / "10_e2e_acceptance" / "held_serve.py"),
                                 str(hold), "--model", str(model_dir), "--port", "0", "--max-model-len", "512",
                                 "--served-model-name", "word", "--shutdown-timeout", shutdown_timeout])


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(model_dir, tmp_path):
    """SIGTERM: /health turns 503 and new requests get 503 at once, the streams in flight finish
    (their whole max_tokens), and the server exits 0; with a short --shutdown-timeout a request
    still running then ends with an error chunk naming the shutdown. The engine is held after
    each request's first token until the test has seen the drain, so the requests are in flight
    at the signal whatever the machine's speed (they could otherwise finish, and the server exit,
    before /health is asked)."""
    hold = tmp_path / "hold"
    server = _held_server(model_dir, hold, "60")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = [threading.Event() for _ in range(3)]
            futures = [pool.submit(_stream_request, server.url, 40, started[i], PROMPTS[i]) for i in range(3)]
            assert all(event.wait(HANG_GUARD_S) for event in started)
            os.kill(server.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + HANG_GUARD_S
            while http(server.url + "/health")[0] != 503:
                assert time.monotonic() < deadline, "/health never said the server is draining"
                time.sleep(0.05)
            status, raw = http(server.url + "/v1/completions", {"model": "word", "prompt": "the", "max_tokens": 2})
            assert status == 503 and "shutting down" in assert_error_object(raw)["message"]
            hold.unlink()
            for future in futures:
                text, finish, error = future.result(120)
                assert error is None and finish == "length" and text, (text, finish, error)
        assert server.process.wait(60) == 0, "".join(server.stderr)
    finally:
        if server.process.poll() is None:
            stop_server_process(server, signal.SIGKILL)

    server = _held_server(model_dir, hold, "0.5")  # held: the request is still running at the timeout
    try:
        started = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream_request, server.url, 480, started)
            assert started.wait(HANG_GUARD_S)
            os.kill(server.process.pid, signal.SIGTERM)
            text, finish, error = future.result(120)
        assert error is not None and "shutting down" in str(error), (text, finish, error)
        assert server.process.wait(60) == 0, "".join(server.stderr)
    finally:
        if server.process.poll() is None:
            stop_server_process(server, signal.SIGKILL)


STOPPED_WITHIN_S = 120  # a hang guard: a rank left waiting for its failed peer waits 300 s (the collective timeout)


@pytest.mark.slow
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_failing_mid_step_stops_every_rank(model_dir, failing_rank):
    """TP = 2 under torchrun (gloo): a rank that raises in the middle of serving a request stops
    both ranks, the client gets an error instead of a hang, and the log names it. Stopping is
    told from hanging by a bound far from both: a rank left waiting for its peer would sit in
    its collective for the engine's 300 s timeout; stopping takes seconds (more under load)."""
    script = REPO / "phases" / "10_e2e_acceptance" / "faulty_serve.py"
    server = start_server_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                   "2", str(script), str(failing_rank), "4", "--model", str(model_dir), "--port", "0",
                                   "--max-model-len", "64", "--served-model-name", "word"])
    try:
        started = time.monotonic()
        text, finish, error = _stream_request(server.url, 30, threading.Event())
        assert error is not None or finish == "error", (text, finish)
        rc = server.process.wait(STOPPED_WITHIN_S - (time.monotonic() - started))
        assert rc != 0
        assert f"injected failure on rank {failing_rank}" in "".join(server.stderr)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the ranks were still running {STOPPED_WITHIN_S} s after the failure:\n"
                             + "".join(server.stderr)) from None
    finally:
        if server.process.poll() is None:
            stop_server_process(server, signal.SIGKILL)


def test_an_engine_failing_every_step_ends_the_server(model_dir):
    """An engine whose steps keep failing (a device error that stays: every step launch from the
    second on raises) ends the server, exit status 1, the cause in the log, every client answered
    with the error, rather than serving 500s forever half-alive (a step that fails once fails
    only its requests: test_server.py)."""
    script = REPO / "phases" / "10_e2e_acceptance" / "faulty_serve.py"
    server = start_server_process([sys.executable, str(script), "0", "2+", "--model", str(model_dir), "--port", "0",
                                   "--max-model-len", "64", "--served-model-name", "word"])
    try:
        body = {"model": "word", "prompt": PROMPTS[0], "max_tokens": 8}
        statuses = []
        while server.process.poll() is None and len(statuses) < 20:
            try:
                status, raw = http(server.url + "/v1/completions", body)
            except OSError:  # the server has closed its socket
                break
            statuses.append(status)
            if status != 503:
                assert status == 500 and "injected failure" in assert_error_object(raw)["message"], raw
        assert 500 in statuses
        rc = server.process.wait(HANG_GUARD_S)
    finally:
        if server.process.poll() is None:
            stop_server_process(server, signal.SIGKILL)
    assert rc == 1, "".join(server.stderr)
    assert "3 engine steps failed in a row" in "".join(server.stderr)


@pytest.mark.slow
def test_rank0_failing_before_it_serves_stops_every_rank(model_dir):
    """``torchrun --nproc_per_node 2 -m engine serve`` on a port already taken: rank 0's server
    cannot bind, its engine core (rank 0 of the TP group, a process of its own) sends the other
    rank its stop, and every process exits, non-zero (no rank left waiting in a collective)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                   "engine", "serve", "--model", str(model_dir), "--port", str(taken.getsockname()[1]),
                   "--max-model-len", "64"]
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=STOPPED_WITHIN_S,
                                  env=server_env(), start_new_session=True)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the ranks were still running {STOPPED_WITHIN_S} s after rank 0 failed to bind:\n"
                                 f"{e.stderr}") from None
    assert done.returncode != 0 and "address already in use" in done.stderr.lower(), done.stderr[-2000:]
