"""Shared by the repository's exercise tests: gate runs in a copy of this repository.

``EXERCISE_ALL=1`` (``make exercise-all``) widens them from the CI subset (a few phases,
single-process runs, only the phases a handed-out phase can block) to every phase, every run
mode and every phase of the tree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gates import ownership

ROOT = Path(__file__).resolve().parents[1]
ALL = os.environ.get("EXERCISE_ALL") == "1"
GATES = ownership.all_gates(ROOT)
CLOSURE = ownership.dependency_closure(GATES)
MODE = [] if ALL else ["--mode", "single"]


def in_tree(tree: Path, *argv: str, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    """``python ARGV`` run in ``tree`` with ``tree``'s own engine and gates; Hypothesis does not
    shrink (GATES_AUDIT: a failure is all these runs need)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "GATES_AUDIT": "1"}
    return subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def run_gates(tree: Path, *args: str) -> dict:
    """The JSON report of ``python -m gates run ARGS`` in ``tree``."""
    report = tree / "gate-report.json"
    proc = in_tree(tree, "-m", "gates", "run", "--report", str(report), *args)
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


def statuses(report: dict) -> dict[str, str]:
    return {p["id"]: p["status"] for p in report["phases"]}
