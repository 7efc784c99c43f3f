"""Run the selected phases in dependency order and decide each phase's status.

PASS: every run that ran passed (runs skipped for a missing requirement are
reported). FAIL: a run failed, timed out, or ran no test (a phase with no tests
is never PASS). BLOCKED: a selected dependency did not pass; its tests are not
run (without ``keep_going``). SKIP: every run was skipped for a missing
requirement, for ``mode`` filtering, or (``skip_empty``) for having no tests yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from gates import report
from gates.execute import RunResult, execute, missing_requirements
from gates.phases import Phase, defines_test, discover, has_tests, select, topological_order
from gates.schema import FailureMode, Gate, GateError, Run

PASS, FAIL, BLOCKED, SKIP = "PASS", "FAIL", "BLOCKED", "SKIP"


@dataclass
class Options:
    upto: str | None = None
    only: list[str] | None = None
    start: str | None = None
    keep_going: bool = False
    mode: str = "all"          # single | torchrun | all
    skip_empty: bool = False
    nproc: tuple[int, ...] | None = None   # torchrun only at these rank counts (None: every count a gate names)


@dataclass
class PhaseResult:
    id: str
    title: str
    depends_on: tuple[str, ...]
    status: str = PASS
    reason: str = ""
    runs: list[RunResult] = field(default_factory=list)
    failure_modes: list[FailureMode] = field(default_factory=list)
    duration_s: float = 0.0


def plan(root: Path, options: Options) -> tuple[list[tuple[Phase, Gate]], list[str]]:
    """Load and order the selected phases. Returns (phase, gate) pairs in run order
    and notes about dependencies left out of the selection."""
    phases = {p.id: p for p in discover(root)}
    chosen = select(sorted(phases), options.upto, options.only, options.start)
    if not chosen:
        raise GateError("the selection matches no phase")
    read = validate(phases, chosen)
    gates = {i: read[i] for i in chosen}
    notes = []
    for i, gate in gates.items():
        outside = [d for d in gate.depends_on if d not in gates]
        if outside:
            notes.append(f"{i} depends on {', '.join(outside)}, outside the selection: not enforced")
    order = topological_order({i: g.depends_on for i, g in gates.items()})
    return [(phases[i], gates[i]) for i in order], notes


def validate(phases: dict[str, Phase], chosen: list[str]) -> dict[str, Gate]:
    """Load the gates of ``chosen`` and of everything they depend on, transitively;
    every dependency must exist and the graph must have no cycle. Nothing runs
    before this passes, so ``--only 05`` cannot go green over a broken 03."""
    gates: dict[str, Gate] = {}
    pending = list(chosen)
    while pending:
        i = pending.pop()
        if i in gates:
            continue
        gates[i] = phases[i].load_gate()
        unknown = [d for d in gates[i].depends_on if d not in phases]
        if unknown:
            raise GateError(f"{phases[i].rel}/gate.yaml: depends_on: unknown phase {', '.join(unknown)}")
        pending.extend(gates[i].depends_on)
    topological_order({i: g.depends_on for i, g in gates.items()})
    return gates


def missing_rule_tests(root: Path, gate: Gate) -> list[str]:
    """Eager-gate rules whose test id names no test (file missing, or no such function)."""
    return [r.test for r in gate.eager_gate if not defines_test(root, r.test)]


def _attempt(root: Path, run: Run, nproc: int) -> RunResult:
    """Execute ``run`` at ``nproc`` ranks, or say why it cannot run here."""
    missing = missing_requirements(run)
    if missing:
        return RunResult(run.mode, nproc, run.tests, "skipped", f"requires {', '.join(missing)}")
    absent = [t for t in run.tests if not has_tests(root, t)]
    if len(absent) == len(run.tests):
        return RunResult(run.mode, nproc, run.tests, "empty", "no test files yet")
    if absent:
        return RunResult(run.mode, nproc, run.tests, "failed", f"missing test path(s): {', '.join(absent)}")
    report.run_started(run, nproc)
    return execute(run, nproc, root)


def _run_phase(root: Path, gate: Gate, options: Options) -> PhaseResult:
    result = PhaseResult(gate.id, gate.title, gate.depends_on)
    runs = [r for r in gate.runs if options.mode in ("all", r.mode)]
    if not runs:
        result.status, result.reason = SKIP, f"no {options.mode} runs"
        return result
    missing = missing_rule_tests(root, gate)
    if missing and any(has_tests(root, t) for r in gate.runs for t in r.tests):
        result.status = FAIL
        result.reason = "eager-gate rule names no test: " + ", ".join(missing)
        return result
    left_out = []  # torchrun sizes --nproc left out: said in the reason, never a silent PASS
    for run in runs:
        sizes = run.nproc or (1,)
        if run.mode == "torchrun" and options.nproc is not None:
            left_out += [n for n in sizes if n not in options.nproc]
            sizes = tuple(n for n in sizes if n in options.nproc)
        for nproc in sizes:
            result.runs.append(_attempt(root, run, nproc))
            report.run_finished(result.runs[-1])
    if not result.runs:
        result.status, result.reason = SKIP, f"no runs at nproc {', '.join(map(str, options.nproc or ()))}"
        return result
    skipped = [r for r in result.runs if r.status == "skipped"]
    empty = [r for r in result.runs if r.status == "empty"]
    failed = [r for r in result.runs if r.status == "failed"]
    if failed:
        result.status = FAIL
        result.reason = "; ".join(f"{r.label}: {r.reason}" for r in failed)
        failing = [t["nodeid"] for r in failed for t in r.failing]
        result.failure_modes = [fm for fm in gate.failure_modes if any(fm.matches(n) for n in failing)]
    elif empty and not options.skip_empty:
        result.status = FAIL
        result.reason = "no tests: " + "; ".join(f"{r.label}: {r.reason}" for r in empty)
    elif len(skipped) + len(empty) == len(result.runs):
        result.status = SKIP
        result.reason = "; ".join(sorted({r.reason for r in skipped + empty}))
    elif skipped or empty:
        result.reason = "skipped: " + "; ".join(f"{r.label}: {r.reason}" for r in skipped + empty)
    if left_out and result.status == PASS:
        note = f"torchrun nproc={','.join(map(str, sorted(set(left_out))))} not run (--nproc)"
        result.reason = f"{result.reason}; {note}" if result.reason else note
    return result


def run_gates(root: Path, options: Options) -> list[PhaseResult]:
    """Run the selected phases of the tree at ``root``; print progress and
    failures as they happen. Raises GateError for a bad tree or selection."""
    ordered, notes = plan(root, options)
    for note in notes:
        report.note(note)
    results: dict[str, PhaseResult] = {}
    for phase, gate in ordered:
        bad = [d for d in gate.depends_on if d in results and results[d].status in (FAIL, BLOCKED)]
        report.phase_started(phase, gate)
        if bad and not options.keep_going:
            res = PhaseResult(gate.id, gate.title, gate.depends_on, BLOCKED,
                              "dependency " + ", ".join(f"{d} {results[d].status}" for d in bad))
        else:
            start = time.monotonic()
            res = _run_phase(root, gate, options)
            res.duration_s = round(time.monotonic() - start, 2)
            if bad:
                res.reason = "; ".join(x for x in (res.reason, "ran although dependency "
                                       + ", ".join(f"{d} {results[d].status}" for d in bad)) if x)
        report.phase_finished(res)
        results[gate.id] = res
    return list(results.values())


def exit_code(results: list[PhaseResult]) -> int:
    """0 if every phase passed or was skipped, else 1."""
    return 0 if all(r.status in (PASS, SKIP) for r in results) else 1
