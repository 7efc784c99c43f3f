"""Claude Code and the Codex CLI, unmodified, against ``python -m engine serve`` (issue 58): install
both from npm into a temporary prefix, serve a model, run ``claude -p "say hi" --output-format
json`` and ``codex exec "say hi"`` headless in a scratch directory with the settings
docs/agents.md gives (a temporary HOME / CODEX_HOME: no user configuration is read or written),
and report for each whether it completed with exit code 0 and no API error. Not CI: it needs
npm and the registry.

    python scripts/agent_clis.py                                  # the demo model, 32,768-token context
    python scripts/agent_clis.py --model DIR --cli codex -- --tool-call-parser hermes --chat-template T.jinja
    python scripts/agent_clis.py --env CLAUDE_CODE_MAX_OUTPUT_TOKENS=64 -- --max-num-batched-tokens 1024

Without ``--model`` it serves a temporary copy of the shipped demo model whose config.json allows
a 32,768-token context (``max_position_embeddings``, YaRN over the 1,024 positions it was trained
on: Claude Code's first prompt is ~25k tokens, Codex's ~12k), with ``--reasoning-parser qwen3``
unless the flags name one. Everything after ``--`` goes to ``serve`` as it is
(``--served-model-name`` and ``--port`` are the script's). Exit code 0 when every CLI run completed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "engine" / "default_model"
CONTEXT = 32_768
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
VERSIONS = {"claude": "2.1.197", "codex": "0.171.0"}  # the versions phase 14's captured requests came from
PROMPT = "say hi"
API_KEY = "agent-clis-key"  # the server is started with it: the CLIs send it as they would a real one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_copy(into: Path) -> Path:
    """A copy of the demo model whose config (and tokenizer) allow a ``CONTEXT``-token context,
    extended by YaRN as Qwen3's own configs are: the model trained on 1,024 positions, and on the
    CLIs' prompts (12k-25k tokens) without it, it writes until the context is full, where Codex
    fails the turn ("Incomplete response"); with it, it answers and ends its turn."""
    model = into / "demo-model"
    shutil.copytree(DEMO_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    trained = config["max_position_embeddings"]
    rope = {**config["rope_parameters"], "rope_type": "yarn", "factor": CONTEXT / trained,
            "original_max_position_embeddings": trained}
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT,
                                                   "rope_parameters": rope}, indent=2))
    tokenizer = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": CONTEXT}, indent=2))
    return model


def install(prefix: Path, versions: dict[str, str]) -> dict[str, Path]:
    """Both CLIs installed under ``prefix`` (npm's ordinary client); their executables."""
    specs = [f"{PACKAGES[cli]}@{version}" for cli, version in versions.items()]
    subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", *specs], check=True)
    return {cli: prefix / "node_modules" / ".bin" / cli for cli in versions}


def serve(model: Path, name: str, port: int, flags: list[str], log: Path) -> subprocess.Popen:
    """``python -m engine serve`` on ``port``, its output in ``log``, once /health answers."""
    command = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--served-model-name", name,
               "--port", str(port), "--api-key", API_KEY, *flags]
    print("serving:", " ".join(command), flush=True)
    server = subprocess.Popen(command, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"the server did not answer /health within 600 s:\n{log.read_text()[-3000:]}")


def served_context(port: int) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)["data"][0]["max_model_len"]


def claude_env(home: Path, port: int, name: str) -> dict[str, str]:
    """Claude Code's settings for this server (docs/agents.md, "Claude Code")."""
    return {"HOME": str(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_AUTH_TOKEN": API_KEY,
            **{var: name for var in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                                     "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                                     "ANTHROPIC_SMALL_FAST_MODEL")},
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "300000", "API_TIMEOUT_MS": "3600000", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def codex_config(port: int, name: str, context: int) -> str:
    """Codex's config.toml for this server (docs/agents.md, "Codex")."""
    return f'''model = "{name}"
model_provider = "agent-infer"
model_context_window = {context}

[model_providers.agent-infer]
name = "agent-infer"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "AGENT_INFER_API_KEY"
'''


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str, str]:
    """``command``'s exit code (124: timed out), stdout and stderr."""
    print("running:", " ".join(command), flush=True)
    try:
        done = subprocess.run(command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    return done.returncode, done.stdout, done.stderr


def claude_outcome(rc: int, out: str) -> tuple[bool, str]:
    """Claude Code's ``--output-format json`` result: completed with no API error, and why not."""
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"rc {rc}, no JSON result: {out[-500:]!r}"
    ok = rc == 0 and not result.get("is_error") and result.get("api_error_status") is None
    return ok, (f"rc {rc}, is_error {result.get('is_error')}, api_error_status {result.get('api_error_status')}, "
                f"result {str(result.get('result'))[:200]!r}")


def codex_outcome(rc: int, out: str) -> tuple[bool, str]:
    """``codex exec --json``'s events: a completed turn, no failed one and no error event."""
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    kinds = [e.get("type") for e in events]
    errors = [e for e in events if e.get("type") in ("error", "turn.failed")]
    said = [e["item"].get("text", "") for e in events if e.get("type") == "item.completed"
            and e.get("item", {}).get("type") == "agent_message"]
    ok = rc == 0 and "turn.completed" in kinds and not errors
    return ok, f"rc {rc}, events {kinds}, errors {json.dumps(errors)[:500]}, said {said[-1][:200] if said else None!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="the model directory to serve (default: a copy of the demo model, 32,768-token context)")
    parser.add_argument("--name", default="agent-infer-demo", help="the served model name the CLIs ask for")
    parser.add_argument("--cli", choices=["claude", "codex", "both"], default="both")
    parser.add_argument("--claude-version", default=VERSIONS["claude"])
    parser.add_argument("--codex-version", default=VERSIONS["codex"])
    parser.add_argument("--npm-prefix", type=Path, default=None,
                        help="where the CLIs are (or get) installed (default: a temporary directory)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for both CLIs (e.g. CLAUDE_CODE_MAX_OUTPUT_TOKENS=64)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each CLI run may take (default 1800)")
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for serve")
    args = parser.parse_args()
    flags = args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags
    extra = dict(item.split("=", 1) for item in args.env)
    clis = ["claude", "codex"] if args.cli == "both" else [args.cli]
    work = Path(tempfile.mkdtemp(prefix="agent-clis-"))
    try:
        prefix = args.npm_prefix or work / "npm"
        versions = {"claude": args.claude_version, "codex": args.codex_version}
        executables = install(prefix, {cli: versions[cli] for cli in clis})
        model = args.model or demo_copy(work)
        if args.model is None and "--reasoning-parser" not in flags:
            flags = ["--reasoning-parser", "qwen3", *flags]  # the demo model thinks first (docs/agents.md)
        port, log = free_port(), work / "server.log"
        server = serve(model, args.name, port, flags, log)
        outcomes = {}
        try:
            context = served_context(port)
            for cli in clis:
                home, scratch = work / f"{cli}-home", work / f"{cli}-scratch"
                home.mkdir()
                scratch.mkdir()
                if cli == "claude":
                    rc, out, err = run([str(executables["claude"]), "-p", PROMPT, "--output-format", "json"],
                                       {**claude_env(home, port, args.name), **extra}, scratch, args.timeout)
                    outcomes[cli] = claude_outcome(rc, out)
                else:
                    (home / "config.toml").write_text(codex_config(port, args.name, context))
                    rc, out, err = run([str(executables["codex"]), "exec", "--json", "--skip-git-repo-check", PROMPT],
                                       {"HOME": str(home), "CODEX_HOME": str(home), "AGENT_INFER_API_KEY": API_KEY,
                                        **extra}, scratch, args.timeout)
                    outcomes[cli] = codex_outcome(rc, out)
                print(f"{cli}: {'completed' if outcomes[cli][0] else 'FAILED'} ({outcomes[cli][1]})", flush=True)
                if not outcomes[cli][0]:
                    print(f"{cli} stderr (last 2,000 characters):\n{err[-2000:]}", flush=True)
        finally:
            server.terminate()
            server.wait(60)
        print("server log (last 20 lines):", *log.read_text(errors="replace").splitlines()[-20:], sep="\n  ")
        return 0 if all(ok for ok, _ in outcomes.values()) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
