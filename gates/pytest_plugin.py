"""pytest plugin (``-p gates.pytest_plugin``) that records per-test outcomes.

When ``GATES_RESULT_DIR`` is set it writes ``rank{RANK or 0}.json`` there at the
end of the session (whole or not at all: written aside, then renamed):
``{"rank", "exitstatus", "tests": [{"nodeid", "outcome", "duration_s", "message"}]}`` with
outcome one of passed / failed / skipped / error (setup, teardown or collection errors),
``"failed_at"`` (wall-clock seconds) on a failure, and ``"properties"`` where a test called
``record_property`` (the performance gate records its benchmark figures so). Without the
variable it records nothing. Under pytest-xdist the controller, which receives every
worker's reports, writes the file; the workers write none.

Under torchrun (WORLD_SIZE > 1) a failing test aborts its rank at once: the
rank writes its file, prints the error and exits, and torchrun stops the other
ranks, which would otherwise wait in a collective until the run's timeout.
``GATES_ABORT_ON_FAILURE=0`` keeps every rank going instead.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_tests: dict[str, dict] = {}
_xdist_worker = False  # set in pytest_configure: this session is a pytest-xdist worker
# the session's rank and whether it is one of a torchrun run, read from its environment when it
# starts (pytest_configure): a test that sets RANK or WORLD_SIZE itself (monkeypatch) changes neither
_rank = 0
_torchrun = False
MESSAGE_CHARS = 2000


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text[-MESSAGE_CHARS:]


def _record(nodeid: str, outcome: str, duration: float, message: str = "", properties=()) -> None:
    entry = _tests.setdefault(nodeid, {"nodeid": nodeid, "outcome": "passed",
                                       "duration_s": 0.0, "message": ""})
    entry["duration_s"] += duration
    if properties:
        entry["properties"] = dict(properties)
    if outcome == "skipped" and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    elif outcome in ("failed", "error") and entry["outcome"] not in ("failed", "error"):
        entry.update(outcome=outcome, message=message, failed_at=time.time())


def _write(exitstatus: int) -> None:
    out_dir = os.environ.get("GATES_RESULT_DIR")
    if not out_dir or _xdist_worker:  # under xdist the controller gets every report
        return
    payload = {"rank": _rank, "exitstatus": int(exitstatus), "tests": list(_tests.values())}
    # written whole or not at all: a session killed while writing (the runner stops the rest of a
    # run once one session fails) leaves no half-written file for the runner to read
    path = Path(out_dir, f"rank{_rank}.json")
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(partial, path)


def _abort_rank(report) -> None:
    """Leave the process group at once: peers blocked in a collective this rank will never
    join get killed by torchrun instead of waiting out the collective timeout."""
    _write(exitstatus=1)
    text = str(report.longrepr)
    sys.stderr.write(f"\n[rank {_rank}] FAILED {report.nodeid}; aborting this rank so the others do not hang\n"
                     f"{text[-MESSAGE_CHARS:]}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def pytest_configure(config) -> None:
    """A worker is known by its config (``workerinput``), never by ``PYTEST_XDIST_WORKER``: a
    gate run started from inside an xdist worker (the gates' own tests under ``make test``)
    inherits that variable while being a session of its own."""
    global _xdist_worker, _rank, _torchrun
    _xdist_worker = hasattr(config, "workerinput")
    _rank = int(os.environ.get("RANK", "0"))
    _torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _record(report.nodeid, "failed" if report.when == "call" else "error",
                report.duration, _message(report), report.user_properties)
        if _torchrun and os.environ.get("GATES_ABORT_ON_FAILURE", "1") != "0":
            _abort_rank(report)
    elif report.skipped:
        _record(report.nodeid, "skipped", report.duration)
    else:
        _record(report.nodeid, "passed", report.duration, properties=report.user_properties)


def pytest_collectreport(report) -> None:
    if report.failed:
        _record(report.nodeid or "<collection>", "error", 0.0, _message(report))


def pytest_sessionfinish(session, exitstatus) -> None:
    _write(int(exitstatus))
