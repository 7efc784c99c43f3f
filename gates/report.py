"""Console output of a gate run (progress, failures with their failure modes,
the final table) and the JSON report."""
from __future__ import annotations

import datetime
import json
import platform
import socket
import textwrap
from dataclasses import asdict
from pathlib import Path

from gates.execute import run_label

FAILING_SHOWN = 20
TAIL_LINES = 25
MESSAGE_LINES = 3


def _say(text: str = "") -> None:
    print(text, flush=True)


def note(text: str) -> None:
    _say(f"note: {text}")


def phase_header(phase, gate) -> str:
    deps = ", ".join(gate.depends_on) or "none"
    return f"\n== {gate.id} {gate.title}  ({phase.rel}; depends on {deps})"


def run_start_line(run, nproc: int, files: int = 0) -> str:
    """``files``: a single run's test files, each a job of its own (0: not counted)."""
    spread = f" ({files} files)" if files > 1 else ""
    return f"   > {run_label(run.mode, nproc):<18} {' '.join(run.tests)}{spread}"


def _counts(c: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in c.items() if n) or "0 tests"


def run_line(r) -> str:
    detail = _counts(r.counts) if r.command else ""
    extra = "; ".join(x for x in (detail, r.reason) if x)
    return f"   < {r.label:<18} {r.status.upper():<8} {extra}  ({r.duration_s:.1f} s)"


def phase_lines(res) -> list[str]:
    """A finished phase's verdict and, when it failed, its failing tests (messages shortened),
    the last output of a run that failed without a failing test, and the failure modes they match."""
    lines = [f"   {res.id}: {res.status}" + (f" - {res.reason}" if res.reason else "")]
    if res.status != "FAIL":
        return lines
    failing = [(r, t) for r in res.runs for t in r.failing]
    for r, t in failing[:FAILING_SHOWN]:
        ranks = f" (rank {', '.join(map(str, t['ranks']))})" if r.mode == "torchrun" else ""
        lines.append(f"   {t['outcome'].upper()} {t['nodeid']}{ranks} [{r.label}]")
        if t["message"]:
            message = t["message"].strip().splitlines()[:MESSAGE_LINES]
            lines.append(textwrap.indent("\n".join(line[:200] for line in message), "          "))
    if len(failing) > FAILING_SHOWN:
        lines.append(f"   ... and {len(failing) - FAILING_SHOWN} more (see the JSON report)")
    if not failing:
        for r in res.runs:
            if r.status == "failed" and r.output_tail:
                lines.append(f"   last output of {r.label}:")
                lines.append(textwrap.indent("\n".join(r.output_tail.splitlines()[-TAIL_LINES:]), "   | "))
    for fm in res.failure_modes:
        lines += [f"   possible failure mode {fm.id}:", f"      symptom: {fm.symptom}",
                  f"      check:   {fm.check}", f"      fix:     {fm.fix}"]
    return lines


def print_table(phases: list[dict]) -> None:
    """The summary table; ``phases`` are the ``phases`` entries of a JSON report."""
    _say(f"\n{'phase':<6}{'status':<9}{'passed':>7}{'failed':>7}{'skipped':>8}{'errors':>7}{'time':>9}  reason")
    for p in phases:
        c = p["counts"]
        reason = p["reason"] if len(p["reason"]) <= 70 else p["reason"][:67] + "..."
        _say(f"{p['id']:<6}{p['status']:<9}{c['passed']:>7}{c['failed']:>7}{c['skipped']:>8}"
             f"{c['errors']:>7}{p['duration_s']:>8.1f}s  {reason}")


def machine_info() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "hostname": socket.gethostname(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def build_report(results, argv: list[str], exit_code: int) -> dict:
    """The JSON-ready report of a gate run (``results``: PhaseResult list)."""
    phases = []
    for res in results:
        counts = {k: sum(r.counts[k] for r in res.runs) for k in ("passed", "failed", "skipped", "errors")}
        phases.append({
            "id": res.id, "title": res.title, "depends_on": list(res.depends_on),
            "status": res.status, "reason": res.reason, "duration_s": res.duration_s,
            "counts": counts,
            "failing_tests": sorted({t["nodeid"] for r in res.runs for t in r.failing}),
            "failure_modes": [fm.id for fm in res.failure_modes],
            "runs": [asdict(r) for r in res.runs],
        })
    return {"command": " ".join(["python -m gates", *argv]), "exit_code": exit_code,
            "machine": machine_info(), "phases": phases}


def write_report(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    _say(f"report: {path}")


def read_report(path: Path) -> dict:
    """The report at ``path``; a missing or unreadable one is a GateError (one line)."""
    from gates.schema import GateError

    if not path.is_file():
        raise GateError(f"no report at {path} (run `python -m gates run` first)")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise GateError(f"{path}: not valid JSON ({e})") from None
    need = {"id", "status", "counts", "duration_s", "reason"}
    phases = data.get("phases") if isinstance(data, dict) else None
    if not isinstance(phases, list) or not all(isinstance(p, dict) and need <= set(p) for p in phases):
        raise GateError(f"{path}: not a gate report (needs phases with {', '.join(sorted(need))})")
    return data
