"""python -m engine generate | serve as a user runs them: subprocesses on a tiny checkpoint,
outputs checked against HF transformers' greedy generation."""
import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.__main__ import main as engine_main
from engine.engine_args import EngineArgs
from engine.server.app import add_serve_command
from server_cases import (
    HANG_GUARD_S,
    PROMPTS,
    REPO,
    ServerProcess,
    assert_error_object,
    engine_cases,
    http,
    make_word_checkpoint,
    start_server_process,
    stop_server_process,
)

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU image

MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_word_checkpoint(tmp_path_factory.mktemp("word-model"), seed=5)


@pytest.fixture(scope="module")
def hf_text(model_dir):
    """HF transformers' greedy continuation of a text prompt (stopping at EOS), as text."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))

    def text(prompt: str, max_new_tokens: int = MAX_NEW) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        tokens = engine_cases.hf_greedy(model_dir, [ids], max_new_tokens)[0]
        return tokenizer.decode(tokens, skip_special_tokens=True)
    return text


def _engine(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_generate_matches_hf(model_dir, hf_text):
    """generate prints prompt + HF's greedy text for each --prompt (batched together)."""
    prompts = PROMPTS[:3]
    out = _engine("generate", "--model", str(model_dir), "--max-tokens", str(MAX_NEW),
                  *(arg for p in prompts for arg in ("--prompt", p)))
    assert out.returncode == 0, out.stderr
    blocks = out.stdout.split("-" * 40 + "\n")
    assert [b.rstrip("\n") for b in blocks if b] == [p + hf_text(p) for p in prompts]
    assert all(hf_text(p) for p in prompts), "an empty continuation proves nothing"


def test_cli_with_no_model_completes_python():
    """With no --model the demo model shipped in engine/default_model answers."""
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", "def fibonacci(n):",
                          "--max-tokens", "24", "--seed", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):") and len(out.stdout) > len("def fibonacci(n):") + 10
    assert "Qwen3ForCausalLM" in out.stderr and "default_model" in out.stderr


def test_cli_generate_names_a_rejected_prompt_and_fails(model_dir, hf_text):
    """A prompt longer than --max-model-len is named on stderr with the reason and the exit
    code is 1; the other prompt of the batch still prints its completion."""
    long_prompt = " ".join([PROMPTS[0]] * 40)
    out = _engine("generate", "--model", str(model_dir), "--max-model-len", "64", "--max-tokens", str(MAX_NEW),
                  "--prompt", long_prompt, "--prompt", PROMPTS[1])
    assert out.returncode == 1, out.stderr
    assert "prompt 1 rejected" in out.stderr and "max_model_len (64)" in out.stderr, out.stderr
    assert long_prompt not in out.stdout
    assert out.stdout.split("-" * 40 + "\n")[0].rstrip("\n") == PROMPTS[1] + hf_text(PROMPTS[1])


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def test_cli_help_lists_every_option(capsys):
    """``generate --help`` and ``serve --help`` list every option they accept (the entry point's
    ``main`` in this process: the other tests start ``python -m engine`` itself)."""
    engine_options = argparse.ArgumentParser()
    EngineArgs.add_cli_args(engine_options)
    commands = argparse.ArgumentParser().add_subparsers()
    add_serve_command(commands)
    sampling = ["--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop"]
    for command, options in [("generate", _options(engine_options) + sampling),
                             ("serve", _options(commands.choices["serve"]))]:
        with pytest.raises(SystemExit) as exited:
            engine_main([command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        missing = [o for o in options if o not in out]
        assert not missing, f"{command} --help does not list {missing}"
    assert {"--host", "--port", "--model", "--max-num-seqs"} <= set(_options(commands.choices["serve"]))


def test_cli_serve_answers_and_stops_on_sigint(model_dir, hf_text):
    """``serve --port 0`` binds a free loopback port, answers with HF's greedy text, and exits 0
    on SIGINT."""
    server = start_server_process([sys.executable, "-m", "engine", "serve", "--model", str(model_dir),
                                   "--port", "0", "--max-model-len", "64", "--served-model-name", "word"])
    try:
        assert server.url.startswith("http://127.0.0.1:")
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            out = client.completions.create(model="word", prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
        assert out.choices[0].text == hf_text(PROMPTS[1])
    finally:
        rc = stop_server_process(server, signal.SIGINT)
    assert rc == 0, "".join(server.stderr)


@pytest.mark.slow
def test_cli_serve_under_torchrun_stops_all_ranks(model_dir, hf_text):
    """``torchrun --nproc_per_node 2 -m engine serve``: rank 0 answers with HF's greedy text; a
    SIGTERM to rank 0 stops every rank cleanly (torchrun exits 0)."""
    server = start_server_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node", "2", "-m", "engine", "serve", "--model", str(model_dir),
                                   "--port", "0", "--max-model-len", "64", "--served-model-name", "word"])
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            texts = [client.completions.create(model="word", prompt=p, max_tokens=MAX_NEW, temperature=0)
                     .choices[0].text for p in PROMPTS[:2]]
        assert texts == [hf_text(p) for p in PROMPTS[:2]]
    finally:
        rc = stop_server_process(server, signal.SIGTERM, pid=server.pid)
    assert rc == 0, "".join(server.stderr)


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
