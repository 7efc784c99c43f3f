"""Start pytest sessions as processes forked from one server that has imported the heavy modules.

A gate run starts ~90 pytest sessions (one per test file of a single run, one per rank of a
torchrun run). Each fresh interpreter imported torch (~2.7 CPU-s) and, for the transformers
oracles, transformers' models (~3.5 CPU-s more): about 40 % of a 2-core machine's gate run.
Here every session is forked from one server (``multiprocessing``'s forkserver) that imported
those modules once, so a session starts in milliseconds with them in memory.

The server imports only what the tree names in its ``pyproject.toml``::

    [tool.gates]
    preload = ["torch", "transformers"]

never the tree's own packages: a mutated copy of the tree (``gates audit``) must run its own
code, which each session imports fresh from its root (put first on ``sys.path``). A module
that fails to import is left out silently (``multiprocessing``'s rule). A module that reads a
variable when it is imported reads it in the server: ``cpu-env`` names variables set in the
server and in every session on a machine without CUDA (Triton picks its interpreter when
``triton.language`` is imported, which ``torch._dynamo`` does)::

    cpu-env = {TRITON_INTERPRET = "1"}

On a machine with CUDA the server imports nothing: some of these modules initialise CUDA when
imported (on the H200 every forked session's first CUDA call then failed with "initialization
error"), and a forked process cannot use a CUDA its parent initialised. Sessions there import what
they need themselves, as fresh interpreters did (a GPU host has the cores for it).

One server serves a runner process; the first tree that starts a session chooses its modules
and variables (a later tree's list changes what is imported ahead, never what a session runs).
"""
from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
SERVER_RESTART_S = 10.0   # how long a start waits for a dead server to be replaced

_context: multiprocessing.context.BaseContext | None = None
_context_lock = threading.Lock()   # runs start sessions from the runner's threads


@dataclass(frozen=True)
class Session:
    """One pytest session: its command-line arguments (after ``pytest``), its whole environment,
    the file its stdout and stderr go to, the OpenMP threads torch may use (None: as the server
    was started) and the file its results go to at its end (``gates.pytest_plugin``; None: none)."""
    args: tuple[str, ...]
    env: dict[str, str]
    log: Path
    threads: int | None = None
    results: Path | None = None


def gates_config(root: Path) -> dict:
    """``[tool.gates]`` of ``root``'s ``pyproject.toml`` (empty without one)."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        return tomllib.load(f).get("tool", {}).get("gates", {})


@functools.cache
def has_cuda() -> bool:
    """Whether this machine has a CUDA device torch can use (imports torch in the runner, once)."""
    import torch

    return torch.cuda.is_available()


def session_variables(root: Path) -> dict[str, str]:
    """The variables every session of ``root`` gets beside the runner's: ``cpu-env`` on a machine
    without CUDA, else none."""
    wanted = gates_config(root).get("cpu-env", {})
    return {k: str(v) for k, v in wanted.items()} if wanted and not has_cuda() else {}


def _server(root: Path) -> multiprocessing.context.BaseContext:
    """The forkserver context, started on first use with ``root``'s modules and variables."""
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([] if has_cuda() else list(gates_config(root).get("preload", [])))
            saved = dict(os.environ)
            os.environ.update(session_variables(root))   # the server inherits them when it starts
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _context = context
        return _context


def start(root: Path, session: Session) -> multiprocessing.Process:
    """Fork ``session`` from the server and return its process (started; in a process group of its
    own whose id is its pid, working directory ``root``); it exits with pytest's exit code. A
    server that has died (multiprocessing starts a new one once the old one has exited) may have
    closed its socket a moment before it exits: the start is tried again until a new server forks
    the session, for at most ``SERVER_RESTART_S``."""
    deadline = time.monotonic() + SERVER_RESTART_S
    while True:
        process = _server(root).Process(target=_run_session, args=(str(root), session), daemon=False)
        try:
            process.start()
            return process
        except (ConnectionRefusedError, FileNotFoundError, EOFError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _run_session(root: str, session: Session) -> None:
    """The forked process: detach, redirect, take the session's environment, run pytest, exit with its code."""
    os.setsid()   # its own process group: a kill of the group reaches what its tests start
    log = os.open(session.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(root)
    os.environ.clear()
    os.environ.update(session.env)
    sys.path.insert(0, root)
    if session.threads is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(session.threads)
    import pytest

    # SystemExit, not os._exit: multiprocessing then runs its finalizers (semaphores a test made
    # are unregistered, not reported leaked at the runner's exit) and flushes the streams
    raise SystemExit(int(pytest.main(list(session.args))))


def rank_environments(world_size: int):
    """What torchrun would give ``world_size`` ranks on this host, without torchrun: a TCP store
    bound to a port the system chose (no port picked first and bound later, which another process
    can take in between) and each rank's variables, pointing at it as torchrun's agent store.
    Returns ``(store, envs)``; keep ``store`` alive until the ranks have finished."""
    from torch.distributed import TCPStore

    store = TCPStore(LOOPBACK, 0, world_size, True, wait_for_workers=False)
    common = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "ROLE_WORLD_SIZE": str(world_size),
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port),
              "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    return store, [{**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(world_size)]
