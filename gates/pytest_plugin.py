"""pytest plugin (``-p gates.pytest_plugin``) that records per-test outcomes.

When ``GATES_RESULT_DIR`` is set it writes ``rank{RANK or 0}.json`` there at the
end of the session: ``{"rank", "exitstatus", "tests": [{"nodeid", "outcome",
"duration_s", "message"}]}`` with outcome one of passed / failed / skipped /
error (setup, teardown or collection errors). Without the variable it does nothing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

_tests: dict[str, dict] = {}
MESSAGE_CHARS = 2000


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text[-MESSAGE_CHARS:]


def _record(nodeid: str, outcome: str, duration: float, message: str = "") -> None:
    entry = _tests.setdefault(nodeid, {"nodeid": nodeid, "outcome": "passed",
                                       "duration_s": 0.0, "message": ""})
    entry["duration_s"] += duration
    if outcome == "skipped" and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    elif outcome in ("failed", "error") and entry["outcome"] not in ("failed", "error"):
        entry["outcome"] = outcome
        entry["message"] = message


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _record(report.nodeid, "failed" if report.when == "call" else "error",
                report.duration, _message(report))
    elif report.skipped:
        _record(report.nodeid, "skipped", report.duration)
    else:
        _record(report.nodeid, "passed", report.duration)


def pytest_collectreport(report) -> None:
    if report.failed:
        _record(report.nodeid or "<collection>", "error", 0.0, _message(report))


def pytest_sessionfinish(session, exitstatus) -> None:
    out_dir = os.environ.get("GATES_RESULT_DIR")
    if not out_dir:
        return
    rank = int(os.environ.get("RANK", "0"))
    payload = {"rank": rank, "exitstatus": int(exitstatus), "tests": list(_tests.values())}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(payload, indent=1))
