"""Execute one run of a gate as a subprocess and collect its per-test results.

``single``: ``python -m pytest -m "not torchrun" <tests>`` (``-n W --dist loadfile`` with W
pytest-xdist workers, each test file on one worker).
``torchrun``: ``python -m torch.distributed.run --standalone --nproc_per_node N
-m pytest -m torchrun <tests>`` (standalone rendezvous picks a free port).
Results come from ``gates.pytest_plugin`` (one JSON file per rank); a test that
fails in any rank fails the run.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import gates
from gates.schema import Run

COUNT_KEY = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors"}
SEVERITY = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}
OUTPUT_TAIL_CHARS = 4000
PYTEST_NO_TESTS = 5
FAILING = ("failed", "error")  # the outcomes that fail a run


def run_label(mode: str, nproc: int | None) -> str:
    """How reports name a run: "single" or "torchrun nproc=N"."""
    return "single" if mode == "single" else f"torchrun nproc={nproc}"


@dataclass
class RunResult:
    """The outcome of one subprocess. ``status``: passed | failed | empty (no
    test ran) | skipped (a requirement is absent; ``reason`` says which). ``test_results``:
    every test's nodeid, outcome, duration_s (and properties it recorded)."""
    mode: str
    nproc: int
    tests: tuple[str, ...]
    status: str
    reason: str = ""
    workers: int = 1     # xdist processes of a single run
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


def pytest_command(run: Run, nproc: int, root: Path, workers: int = 1) -> list[str]:
    """The command line for ``run`` (with ``nproc`` ranks when it is a torchrun run, ``workers``
    xdist processes when it is a single run and ``workers`` > 1)."""
    pytest_args = ["-m", "pytest", "-p", "gates.pytest_plugin", "-p", "no:cacheprovider",
                   "--rootdir", str(root), "-q", "-rfE"]
    if run.mode == "single":
        spread = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
        return [sys.executable, *pytest_args, *spread, "-m", "not torchrun", *run.tests]
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


_running: set[int] = set()   # the process ids of the runs under way (runs execute in threads)
_running_lock = threading.Lock()


def kill_running() -> None:
    """Kill every run under way and all it started (an interrupted gate run leaves no process behind)."""
    with _running_lock:
        pids = list(_running)
    for pid in pids:
        _kill_tree(pid)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant: torchrun starts each
    worker in a session of its own, which a kill of the group alone would miss (the
    orphaned ranks would keep the output pipe open and the run would never end)."""
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


def execute(run: Run, nproc: int, root: Path, workers: int = 1, threads: int | None = None) -> RunResult:
    """Run ``run`` (at ``nproc`` ranks for torchrun, over ``workers`` xdist processes for a
    single run) under ``root``, each process at ``threads`` OpenMP threads unless the
    environment says (None: torch's default); kill it and every process it started after
    ``run.timeout_s``."""
    result = RunResult(run.mode, nproc, run.tests, status="failed", workers=workers)
    cmd = pytest_command(run, nproc, root, workers)
    result.command = shlex.join(cmd)
    with tempfile.TemporaryDirectory(prefix="gates-") as result_dir:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, env=_child_env(result_dir, threads), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        with _running_lock:
            _running.add(proc.pid)
        try:
            output, _ = proc.communicate(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            output, _ = proc.communicate()
            result.reason = f"timeout after {run.timeout_s:g} s"
        finally:
            with _running_lock:
                _running.discard(proc.pid)
        result.duration_s = round(time.monotonic() - start, 2)
        result.returncode = proc.returncode
        result.output_tail = output[-OUTPUT_TAIL_CHARS:]
        rank_files = [json.loads(p.read_text()) for p in Path(result_dir).glob("rank*.json")]
    merged, result.ranks = merge_ranks(rank_files)
    for t in merged.values():
        result.counts[COUNT_KEY[t["outcome"]]] += 1
    result.test_results = [{k: t[k] for k in ("nodeid", "outcome", "duration_s", "properties") if k in t}
                           for t in merged.values()]
    result.failing = [{"nodeid": t["nodeid"], "outcome": t["outcome"], "ranks": t["ranks"],
                       "message": t["message"]}
                      for t in merged.values() if t["outcome"] in FAILING]
    result.status, reason = _judge(result, expected_ranks=nproc)
    result.reason = result.reason or reason
    return result


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
