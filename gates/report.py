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


def phase_started(phase, gate) -> None:
    deps = ", ".join(gate.depends_on) or "none"
    _say(f"\n== {gate.id} {gate.title}  ({phase.rel}; depends on {deps})")


def run_started(run, nproc: int) -> None:
    _say(f"   > {run_label(run.mode, nproc):<18} {' '.join(run.tests)}")


def _counts(c: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in c.items() if n) or "0 tests"


def run_finished(r) -> None:
    detail = _counts(r.counts) if r.command else ""
    extra = "; ".join(x for x in (detail, r.reason) if x)
    _say(f"   < {r.label:<18} {r.status.upper():<8} {extra}  ({r.duration_s:.1f} s)")


def phase_finished(res) -> None:
    _say(f"   {res.id}: {res.status}" + (f" - {res.reason}" if res.reason else ""))
    if res.status != "FAIL":
        return
    failing = [(r, t) for r in res.runs for t in r.failing]
    for r, t in failing[:FAILING_SHOWN]:
        ranks = f" (rank {', '.join(map(str, t['ranks']))})" if r.mode == "torchrun" else ""
        _say(f"   {t['outcome'].upper()} {t['nodeid']}{ranks} [{r.label}]")
        if t["message"]:
            lines = t["message"].strip().splitlines()[:MESSAGE_LINES]
            _say(textwrap.indent("\n".join(line[:200] for line in lines), "          "))
    if len(failing) > FAILING_SHOWN:
        _say(f"   ... and {len(failing) - FAILING_SHOWN} more (see the JSON report)")
    if not failing:
        for r in res.runs:
            if r.status == "failed" and r.output_tail:
                _say(f"   last output of {r.label}:")
                _say(textwrap.indent("\n".join(r.output_tail.splitlines()[-TAIL_LINES:]), "   | "))
    for fm in res.failure_modes:
        _say(f"   possible failure mode {fm.id}:")
        _say(f"      symptom: {fm.symptom}")
        _say(f"      check:   {fm.check}")
        _say(f"      fix:     {fm.fix}")


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
