"""``python -m gates run --repeat N [--load]``: find tests whose outcome depends on more than the code.

The selected phases run N times, each time the same way (optionally beside a CPU load of the
runner's own: one busy process per core, each ending by itself when the gate run ends or after
``LOAD_LIMIT_S``); a test whose outcome (passed, failed, skipped, error) differs between the
runs, in the same run of the same phase, is flaky: it asserts on timing, load or order rather
than behaviour (FM-069, the timing-dependent assertion, in blueprint/failure_modes.yaml).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

LOAD_LIMIT_S = 4 * 3600  # a busy process never outlives this, whatever happens to the runner

# Spins until its parent (the gate runner, whose pid it is given: one that dies before this starts
# must not be missed) is gone or the limit has passed.
_BUSY = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def cpu_load(processes: int, limit_s: float = LOAD_LIMIT_S) -> Iterator[None]:
    """``processes`` busy processes for the duration of the block (each stops by itself if the
    block is never left: parent gone, or ``limit_s`` passed)."""
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY, str(os.getpid()), str(limit_s)]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def outcomes(results) -> dict[str, str]:
    """``"phase | run label | test node id"`` -> outcome, for every test of one gate run
    (``results``: the runner's PhaseResult list); a phase that did not run (blocked) has none."""
    return {f"{res.id} | {run.label} | {t['nodeid']}": t["outcome"]
            for res in results for run in res.runs for t in run.test_results}


def differing(repeats: list[dict[str, str]]) -> dict[str, list[str]]:
    """Tests whose outcome was not the same in every repeat (absent from a repeat: ``"not run"``),
    each with its outcome per repeat."""
    names = sorted(set().union(*repeats))
    seen = {name: [r.get(name, "not run") for r in repeats] for name in names}
    return {name: got for name, got in seen.items() if len(set(got)) > 1}


def default_load() -> int:
    """One busy process per core the runner may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
