"""python -m engine generate | serve as a user runs them: subprocesses on a tiny checkpoint,
outputs checked against HF transformers' greedy generation. How a server stops (draining on
SIGTERM, a failing rank) is test_cli_shutdown.py's: a file of its own, so that xdist runs the two
files' subprocesses side by side."""
import argparse
import signal
import subprocess
import sys

import pytest

from engine.__main__ import main as engine_main
from engine.core.engine_args import EngineArgs
from engine.entrypoints.server.app import add_serve_command
from server_cases import (
    PROMPTS,
    REPO,
    engine_cases,
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
