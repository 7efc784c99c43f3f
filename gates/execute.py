"""Execute one run of a gate as pytest sessions and collect its per-test results.

``single``: one session, ``pytest -m "not torchrun" <tests>``; the runner gives each test file a
job of its own (the isolation of ``pytest -n W --dist loadfile``), so a phase's files spread over
whatever CPU slots are free, and ``combine`` merges them.
``torchrun``: N ranks, each ``pytest -m torchrun <tests>`` with torchrun's variables, its
rendezvous on a store bound to a port the system chose.
Sessions are forked from a server that imported the heavy modules once (``gates.forks``); the
report's command is the plain equivalent (pytest-xdist, torchrun) that reproduces a run by hand.
Results come from ``gates.pytest_plugin`` (one JSON file per session); a test that
fails in any rank fails the run.
"""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import gates
from gates.forks import Session, rank_environments, session_variables, start
from gates.schema import Run

COUNT_KEY = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors"}
SEVERITY = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}
OUTPUT_TAIL_CHARS = 4000
PYTEST_NO_TESTS = 5
STATUS_LOST = 255  # multiprocessing's exit code for a forked process whose status its forkserver could not report
FAILING = ("failed", "error")  # the outcomes that fail a run


def run_label(mode: str, nproc: int | None) -> str:
    """How reports name a run: "single" or "torchrun nproc=N"."""
    return "single" if mode == "single" else f"torchrun nproc={nproc}"


@dataclass
class RunResult:
    """The outcome of one run. ``status``: passed | failed | empty (no
    test ran) | skipped (a requirement is absent; ``reason`` says which). ``test_results``:
    every test's nodeid, outcome, duration_s (and properties it recorded)."""
    mode: str
    nproc: int
    tests: tuple[str, ...]
    status: str
    reason: str = ""
    files: int = 1       # pytest sessions (test files) of a single run
    command: str = ""
    returncode: int | None = None
    duration_s: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_KEY.values(), 0))
    failing: list[dict] = field(default_factory=list)
    test_results: list[dict] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    output_tail: str = ""

    @property
    def label(self) -> str:
        return run_label(self.mode, self.nproc)


def pytest_command(run: Run, nproc: int, root: Path) -> list[str]:
    """The plain command line of ``run`` (with ``nproc`` ranks when it is a torchrun run): what a
    person runs to reproduce it without the runner."""
    pytest_args = ["-m", "pytest", "-p", "gates.pytest_plugin", "-p", "no:cacheprovider",
                   "--rootdir", str(root), "-q", "-rfE"]
    if run.mode == "single":
        return [sys.executable, *pytest_args, "-m", "not torchrun", *run.tests]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), *pytest_args, "-m", "torchrun", *run.tests]


def missing_requirements(run: Run, nproc: int = 1) -> list[str]:
    """Requirements of ``run`` at ``nproc`` ranks this machine lacks (only ``cuda`` is known: a
    torchrun run needs a GPU per rank)."""
    if "cuda" in run.requires:
        import torch

        if not torch.cuda.is_available():
            return ["cuda (torch.cuda.is_available() is False)"]
        gpus = torch.cuda.device_count()
        if run.mode == "torchrun" and gpus < nproc:
            return [f"cuda on {nproc} GPUs, one per rank ({gpus} here)"]
    return []


def _child_env(result_dir: str, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None:  # runs side by side: torch's intra-op threads of each process kept to its slots
        env.setdefault("OMP_NUM_THREADS", str(threads))
    package_parent = str(Path(gates.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env["GATES_RESULT_DIR"] = result_dir
    # a gate run is a session of its own: nothing of a torchrun group or a pytest(-xdist) session
    # it was started from (the gates' own tests under ``make test``) leaks into it
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST",
                "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        env.pop(var, None)
    return env


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


_running: set[int] = set()   # the process ids of the sessions under way (runs execute in threads)
_running_lock = threading.Lock()


def kill_running() -> None:
    """Kill every run under way and all it started (an interrupted gate run leaves no process behind)."""
    with _running_lock:
        pids = list(_running)
    for pid in pids:
        _kill_tree(pid)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant: a test may start processes in a
    session of their own (a server, a torchrun), which a kill of the group alone would miss."""
    for victim in [pid, *_descendants(pid)]:
        for kill in (lambda v: os.killpg(v, signal.SIGKILL), lambda v: os.kill(v, signal.SIGKILL)):
            try:
                kill(victim)
            except (ProcessLookupError, PermissionError):
                pass


def merge_ranks(rank_files: list[dict]) -> tuple[dict[str, dict], list[dict]]:
    """Merge per-rank test lists: the worst outcome wins; remember failing ranks. When several
    ranks fail a test, its message is the one of the rank that failed first by the wall clock
    (``failed_at``; the cause: the others typically fail after it, on the aborted collective)."""
    merged: dict[str, dict] = {}
    ranks = []
    for data in sorted(rank_files, key=lambda d: d["rank"]):
        counts = dict.fromkeys(COUNT_KEY.values(), 0)
        for t in data["tests"]:
            counts[COUNT_KEY[t["outcome"]]] += 1
            failing = t["outcome"] in FAILING
            m = merged.setdefault(t["nodeid"], {**t, "ranks": []})
            if failing:
                m["ranks"].append(data["rank"])
            earlier = failing and t["outcome"] == m["outcome"] and t.get("failed_at", 0) < m.get("failed_at", 0)
            if SEVERITY[t["outcome"]] > SEVERITY[m["outcome"]] or earlier:
                m.update(outcome=t["outcome"], message=t["message"], failed_at=t.get("failed_at"))
            m["duration_s"] = max(m["duration_s"], t["duration_s"])
        ranks.append({"rank": data["rank"], "exitstatus": data["exitstatus"], "counts": counts})
    return merged, ranks


def execute(run: Run, nproc: int, root: Path, threads: int | None = None) -> RunResult:
    """Run ``run`` under ``root``: a single run as one pytest session (the runner gives each test
    file a job of its own and merges them with ``combine``); a torchrun run as ``nproc`` ranks side
    by side. Sessions are forked from the pre-importing
    server (``gates.forks``), each at ``threads`` OpenMP threads (None: torch's default; ranks 1,
    as torchrun gives them). Stops every rank once one fails; kills everything after
    ``run.timeout_s``. ``result.command`` is the plain command line that reproduces the run."""
    result = RunResult(run.mode, nproc, run.tests, status="failed")
    result.command = shlex.join(pytest_command(run, nproc, root))
    store = None
    with tempfile.TemporaryDirectory(prefix="gates-") as tmp:
        base = {**_child_env(tmp, threads), **session_variables(root)}
        args = ("-p", "gates.pytest_plugin", "-p", "no:cacheprovider", "--rootdir", str(root), "-q", "-rfE")
        if run.mode == "single":
            sessions = [Session((*args, "-m", "not torchrun", *run.tests), base, Path(tmp, "session.log"), threads,
                                Path(tmp, "rank0.json"))]
            at_once, fail_fast = 1, False
        else:
            store, ranks = rank_environments(nproc)
            sessions = [Session((*args, "-m", "torchrun", *run.tests), {**base, **rank},
                                Path(tmp, f"rank{r}.log"), threads or 1, Path(tmp, f"rank{r}.json"))
                        for r, rank in enumerate(ranks)]
            at_once, fail_fast = nproc, True
        start = time.monotonic()
        codes, result.reason = _supervise(root, sessions, at_once, run.timeout_s, fail_fast)
        result.duration_s = round(time.monotonic() - start, 2)
        del store
        logs = [(code, s.log.read_text(errors="replace") if s.log.exists() else "") for code, s in zip(codes, sessions)]
        result.output_tail = "".join(text for _, text in sorted(logs, key=lambda x: x[0] not in (0, PYTEST_NO_TESTS)))[
            -OUTPUT_TAIL_CHARS:]
        if run.mode == "single":
            result.returncode = -1 if codes[0] is None else codes[0]
            rank_files = [_session_results(Path(tmp), " ".join(run.tests), result.returncode)]
        else:
            result.returncode = next((c for c in codes if c not in (0, None)), 0)
            rank_files = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
    _take_ranks(result, rank_files, expected_ranks=nproc)
    return result


def combine(run: Run, parts: list[RunResult], command: str, duration_s: float) -> RunResult:
    """One result for single run ``run`` from its files' results (each file ran as a job of its
    own): every file's tests; skipped (a requirement absent) or empty only when every file was;
    a file's verdict other than its failing tests (a timeout, an exit code) stays in the reason."""
    result = RunResult(run.mode, 1, run.tests, status="failed", files=len(parts), command=command,
                       duration_s=round(duration_s, 2))
    for status in ("skipped", "empty"):
        if all(p.status == status for p in parts):
            result.status, result.reason = status, parts[0].reason
            result.command = command if status == "empty" else ""   # skipped: nothing ran
            return result
    ran = [p for p in parts if p.status not in ("skipped", "empty")] or parts
    # a file's own verdict (a timeout, an exit code) stands; its failing tests are counted again below
    result.reason = "; ".join(sorted({p.reason for p in ran if p.status == "failed"
                                      and p.reason != f"{len(p.failing)} failing test(s)"}))
    result.returncode = _single_code([p.returncode for p in ran])
    result.output_tail = "".join(p.output_tail for p in sorted(ran, key=lambda p: p.status == "failed"))[
        -OUTPUT_TAIL_CHARS:]
    messages = {f["nodeid"]: f["message"] for p in ran for f in p.failing}
    tests = [{**t, "message": messages.get(t["nodeid"], "")} for p in ran for t in p.test_results]
    _take_ranks(result, [{"rank": 0, "exitstatus": result.returncode, "tests": tests}], expected_ranks=1)
    return result


def _take_ranks(result: RunResult, rank_files: list[dict], expected_ranks: int) -> None:
    """Fill ``result``'s tests, counts, failing tests and ranks from the sessions' result files and
    judge it (a reason already set, a timeout, stands)."""
    merged, result.ranks = merge_ranks(rank_files)
    for t in merged.values():
        result.counts[COUNT_KEY[t["outcome"]]] += 1
    result.test_results = [{k: t[k] for k in ("nodeid", "outcome", "duration_s", "properties") if k in t}
                           for t in merged.values()]
    result.failing = [{"nodeid": t["nodeid"], "outcome": t["outcome"], "ranks": t["ranks"],
                       "message": t["message"]}
                      for t in merged.values() if t["outcome"] in FAILING]
    result.status, reason = _judge(result, expected_ranks)
    result.reason = result.reason or reason


def _session_results(result_dir: Path, target: str, code: int) -> dict:
    """The results a single run's session wrote, or, when it wrote none (it crashed or was killed),
    an error that names its target and exit code."""
    written = result_dir / "rank0.json"
    if written.exists():
        return json.loads(written.read_text())
    message = f"the pytest session of {target} ended with exit code {code} and wrote no results (see the output)"
    return {"rank": 0, "exitstatus": code, "tests": [{"nodeid": target, "outcome": "error", "duration_s": 0.0,
                                                      "message": message, "failed_at": time.time()}]}


def _single_code(codes: list[int | None]) -> int:
    """One exit code for a single run's sessions: the first that is neither 0 nor pytest's "no
    tests" (5); else 5 when no session ran a test; else 0."""
    bad = [c for c in codes if c not in (0, PYTEST_NO_TESTS)]
    if bad:
        return -1 if bad[0] is None else bad[0]
    return PYTEST_NO_TESTS if codes and all(c == PYTEST_NO_TESTS for c in codes) else 0


def _exit_code(code: int | None, session: Session) -> int | None:
    """The exit code of ``session``: its process's, or, where multiprocessing lost that
    (``STATUS_LOST``: the forkserver that forked it died or could not report it), the exit status
    the session recorded with its results at its end, when it did (said on stderr). A session
    that crashed or was killed wrote no results, or its code is a signal's (negative)."""
    if code != STATUS_LOST or session.results is None or not session.results.exists():
        return code
    recorded = json.loads(session.results.read_text())["exitstatus"]
    print(f"gates: the exit status of pytest {shlex.join(session.args)} was lost (multiprocessing reported "
          f"{STATUS_LOST}: its forkserver could not tell it); the session recorded {recorded} at its end",
          file=sys.stderr)
    return recorded


def _await_exit(pid: int, deadline: float) -> None:
    """Wait until process ``pid`` has exited (gone, or a zombie left to init), at most until
    ``deadline``. multiprocessing reports ``STATUS_LOST`` the moment the forkserver that forked a
    session dies, while the session, no child of the runner, may still be running and has not yet
    written its results: reading them then would call a passing session lost."""
    stat = Path(f"/proc/{pid}/stat")
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.02)


def _supervise(root: Path, sessions: list[Session], at_once: int, timeout_s: float,
               fail_fast: bool) -> tuple[list[int | None], str]:
    """Run ``sessions`` in order, at most ``at_once`` at a time, until all have exited; with
    ``fail_fast`` kill the rest once one exits non-zero. After ``timeout_s`` kill everything left.
    Returns each session's exit code (negative: killed by that signal; None: never started) and
    "timeout after N s" when the time ran out ("" otherwise)."""
    codes: list[int | None] = [None] * len(sessions)
    running: dict[object, tuple[int, multiprocessing.Process]] = {}   # by sentinel
    pending = list(range(len(sessions)))
    deadline = time.monotonic() + timeout_s
    try:
        while pending or running:
            while pending and len(running) < at_once:
                i = pending.pop(0)
                process = start(root, sessions[i])
                with _running_lock:
                    _running.add(process.pid)
                running[process.sentinel] = (i, process)
            ready = multiprocessing.connection.wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return codes, f"timeout after {timeout_s:g} s"
            for sentinel in ready:
                i, process = running.pop(sentinel)
                process.join()
                if process.exitcode == STATUS_LOST:
                    _await_exit(process.pid, deadline)
                codes[i] = _exit_code(process.exitcode, sessions[i])
                with _running_lock:
                    _running.discard(process.pid)
                if fail_fast and codes[i] != 0:
                    pending.clear()
                    for _, other in running.values():
                        _kill_tree(other.pid)
        return codes, ""
    finally:   # a timeout, or an exception in the runner: nothing started here outlives it
        for _, process in running.values():
            _kill_tree(process.pid)
            process.join()
            with _running_lock:
                _running.discard(process.pid)


def _judge(r: RunResult, expected_ranks: int) -> tuple[str, str]:
    if r.reason:  # timeout
        return "failed", r.reason
    if r.failing:
        return "failed", f"{len(r.failing)} failing test(s)"
    if len(r.ranks) < expected_ranks:
        seen = sorted(x["rank"] for x in r.ranks)
        return "failed", f"only ranks {seen} of {expected_ranks} reported results (exit code {r.returncode})"
    if r.returncode not in (0, PYTEST_NO_TESTS):  # usage or collection errors (a misspelled test id) fail
        return "failed", f"exit code {r.returncode}"
    if r.returncode == PYTEST_NO_TESTS or r.counts["passed"] == 0:
        total = sum(r.counts.values())
        return "empty", "no tests collected" if total == 0 else f"no test ran (all {total} skipped)"
    return "passed", ""
