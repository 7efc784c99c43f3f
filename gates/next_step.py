"""``python -m gates next``: what to do next, read from the last gate report.

``advise(root, report)`` names the first phase of the report that neither passed nor was
skipped, with its failing tests and their first error lines, the failure modes they match
(symptom, check, fix from its gate.yaml), the functions it owns that still raise
``NotImplementedError`` (skeletons from ``gates exercise``; leaves first: a module after the
handed-out modules it imports), the contract section to read and
the command that checks it again. When every phase of the tree passed (or was skipped) it
says so; phases the report did not run are the next thing to do.
"""
from __future__ import annotations

from pathlib import Path

from gates import ownership
from gates.exercise import anchor, contract_title
from gates.phases import discover
from gates.skeleton import raising

MESSAGE_LINES = 3


def _leaves_first(root: Path, own: ownership.Ownership, paths: list[str]) -> list[str]:
    """``paths`` ordered so that a module comes after the modules of ``paths`` it imports at its top
    level (what a stubbed module still shows; the ones to build first: what they define is used by
    the others); ties, and circles, in path order."""
    imports = {p: ownership.module_imports(root, own, p) & set(paths) - {p} for p in paths}
    ordered: list[str] = []
    while len(ordered) < len(paths):
        ready = [p for p in sorted(paths) if p not in ordered and imports[p] <= set(ordered)]
        ordered.append(ready[0] if ready else min(p for p in paths if p not in ordered))
    return ordered


def _unimplemented(root: Path, phase: str) -> list[dict]:
    """The functions ``phase`` owns that still raise NotImplementedError, in an order to build them:
    leaves first (a module after the handed-out modules it imports), then by line."""
    gates = ownership.all_gates(root)
    own = ownership.load(root, gates)
    todo = own.functions_of({phase})
    found = []
    for path in _leaves_first(root, own, sorted(todo)):
        skeletons = raising((root / path).read_text())
        found += sorted(({"symbol": f"{path}::{q}", "line": skeletons[q][0]} for q in todo[path] if q in skeletons),
                        key=lambda u: u["line"])
    return found


def advise(root: Path, report: dict) -> dict:
    """The advice as a JSON-ready dict: ``status`` "pass", "not-run" (every phase of the report
    passed but some of the tree's were not run) or "work" (``phase`` needs work)."""
    phases = {p.id: p for p in discover(root)}
    seen = {p["id"]: p for p in report["phases"]}
    todo = [p for p in report["phases"] if p["status"] not in ("PASS", "SKIP")]
    skipped = {p["id"]: p["reason"] for p in report["phases"] if p["status"] == "SKIP"}
    if not todo:
        missing = sorted(set(phases) - set(seen))
        if missing:  # the phases after the ones run, or (some came before them) every phase
            command = "python -m gates run" + (f" --from {missing[0]}" if missing[0] > max(seen) else "")
            return {"status": "not-run", "phase": missing[0], "not_run": missing, "skipped": skipped,
                    "command": command}
        return {"status": "pass", "phase": None, "skipped": skipped, "command": None}
    failing = next((p for p in todo if p["status"] == "FAIL"), todo[0])
    pid = failing["id"]
    gate = phases[pid].load_gate()
    modes = {fm.id: fm for fm in gate.failure_modes}
    tests = []
    for run in failing["runs"]:
        for t in run["failing"]:
            lines = (t["message"] or "").strip().splitlines()[:MESSAGE_LINES]
            tests.append({"nodeid": t["nodeid"], "run": run["mode"] if run["mode"] == "single"
                          else f"torchrun nproc={run['nproc']}", "error": "\n".join(lines),
                          "failure_modes": [fm.id for fm in gate.failure_modes if fm.matches(t["nodeid"])]})
    return {
        "status": "work", "phase": pid, "title": gate.title, "phase_status": failing["status"],
        "reason": failing["reason"], "failing_tests": tests,
        "failure_modes": [{"id": i, "symptom": modes[i].symptom, "check": modes[i].check, "fix": modes[i].fix}
                          for i in failing["failure_modes"] if i in modes],
        "unimplemented": _unimplemented(root, pid),
        "contract": {"anchor": anchor(pid), "title": contract_title(root, pid)},
        "command": f"python -m gates run --upto {pid}",
    }


def render(advice: dict, shown: int = 10) -> str:
    """The advice as text for a person."""
    skipped = "".join(f"\n  SKIP {i}: {why}" for i, why in advice["skipped"].items()) if "skipped" in advice else ""
    if advice["status"] == "pass":
        return "every phase passed: nothing left to do" + skipped
    if advice["status"] == "not-run":
        return (f"every phase in the report passed; not run yet: {', '.join(advice['not_run'])}{skipped}\n"
                f"next: {advice['command']}")
    out = [f"next: phase {advice['phase']} — {advice['title']} ({advice['phase_status']}: {advice['reason']})"]
    tests = advice["failing_tests"]
    if tests:
        out.append(f"failing tests ({min(shown, len(tests))} of {len(tests)} shown):")
        for t in tests[:shown]:
            hint = f"  -> {', '.join(t['failure_modes'])}" if t["failure_modes"] else ""
            out.append(f"  {t['nodeid']} [{t['run']}]{hint}")
            out += [f"      {line[:200]}" for line in t["error"].splitlines()]
    for fm in advice["failure_modes"]:
        out.append(f"failure mode {fm['id']}:\n  symptom: {fm['symptom']}\n  check:   {fm['check']}\n"
                   f"  fix:     {fm['fix']}")
    todo = advice["unimplemented"]
    if todo:
        out.append(f"still raising NotImplementedError ({len(todo)} owned by phase {advice['phase']}, "
                   "in an order to build them, leaves first):")
        out += [f"  {u['symbol']}  (line {u['line']})" for u in todo]
    title = advice["contract"]["title"]
    out.append(f"read: {advice['contract']['anchor']}" + (f" ({title})" if title else ""))
    out.append(f"then: {advice['command']}")
    return "\n".join(out)
