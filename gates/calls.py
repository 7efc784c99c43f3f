"""pytest plugin (``-p gates.calls``, or ``PYTEST_PLUGINS=gates.calls``): which engine functions a
session called.

With ``GATES_CALLS_DIR`` set, every Python function called under ``engine/`` of the session's
root, in any thread, is recorded as ``(module path, qualname)``; a nested function, lambda or
comprehension counts as the function it is defined in (``Class.method.<locals>.inner`` ->
``Class.method``). At the session's end ``calls-<pid>.json`` is written there:
``{"args": [pytest's arguments], "rank": RANK or 0, "calls": [[path, qualname], ...]}``. A
global trace function sees only calls (it turns line tracing off for every frame), so a
session runs about as fast as without it; processes a test starts are not followed.
``gates.contracts`` uses it to run a mutant of a function only against the test files that
call that function.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

_seen: set[tuple[str, str]] = set()
_codes: dict[object, tuple[str, str] | None] = {}
_prefix = ""
_args: list[str] = []


def _unit(code) -> tuple[str, str] | None:
    found = _codes.get(code, False)
    if found is False:
        found = None
        if code.co_filename.startswith(_prefix):
            qualname = code.co_qualname.split(".<locals>")[0]
            found = (code.co_filename[len(_prefix) - len("engine/"):], qualname)
        _codes[code] = found
    return found


def _trace(frame, event, arg):
    if event == "call":
        unit = _unit(frame.f_code)
        if unit is not None:
            _seen.add(unit)
    return None


def pytest_configure(config) -> None:
    global _prefix, _args
    if not os.environ.get("GATES_CALLS_DIR"):
        return
    _prefix = str(Path(config.rootpath, "engine")) + os.sep
    _args = [str(a) for a in config.args]
    threading.settrace(_trace)
    sys.settrace(_trace)


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("GATES_CALLS_DIR")
    if not out:
        return
    sys.settrace(None)
    threading.settrace(None)
    payload = {"args": _args, "rank": int(os.environ.get("RANK", "0")), "calls": sorted(_seen)}
    path = Path(out, f"calls-{os.getpid()}.json")
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(payload))
    os.replace(partial, path)
