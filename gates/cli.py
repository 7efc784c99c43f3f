"""``python -m gates list | show NN | run [...] | status``; see ``--help``."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

from gates import report
from gates.execute import pytest_command
from gates.phases import discover, has_tests, test_files, topological_order
from gates.runner import Options, exit_code, run_gates
from gates.schema import GateError

REPO_ROOT = Path(__file__).resolve().parent.parent
ERROR_EXIT = 2


def _phase_id(text: str) -> str:
    if not text.isdigit() or len(text) > 2:
        raise argparse.ArgumentTypeError(f"not a phase id: {text!r}")
    return text.zfill(2)


def _phase_ids(text: str) -> list[str]:
    return [_phase_id(t.strip()) for t in text.split(",") if t.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gates", description="Run and inspect the phase gates.")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root holding phases/ (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="phases in dependency order with the state of their gate and tests")
    show = sub.add_parser("show", help="one gate in readable form")
    show.add_argument("phase", type=_phase_id)
    run = sub.add_parser("run", help="run the gates in dependency order")
    run.add_argument("--upto", type=_phase_id, help="phases with id <= N")
    run.add_argument("--from", dest="start", type=_phase_id, help="phases with id >= NN")
    run.add_argument("--only", type=_phase_ids, help="exactly these phases, e.g. 02,03")
    run.add_argument("--keep-going", action="store_true", help="run dependents of failed phases too")
    run.add_argument("--mode", choices=("single", "torchrun", "all"), default="all")
    run.add_argument("--skip-empty", action="store_true", help="a phase with no tests yet is SKIP, not FAIL")
    run.add_argument("--report", type=Path, help="JSON report path (default: ROOT/gate-report.json)")
    status = sub.add_parser("status", help="the table of the last report")
    status.add_argument("--report", type=Path, help="JSON report path (default: ROOT/gate-report.json)")
    return p


def cmd_list(root: Path) -> int:
    rows, deps = {}, {}
    for phase in discover(root):
        try:
            gate = phase.load_gate()
        except GateError as e:
            problem = str(e).removeprefix(f"{phase.rel}/gate.yaml: ")
            rows[phase.id] = f"{phase.id}  {phase.rel:<54} gate.yaml {problem}"
            deps[phase.id] = ()
            continue
        n = len(test_files(phase))
        tests = f"{n} test file{'s' * (n != 1)}" if n else "no tests yet"
        rows[phase.id] = f"{phase.id}  {gate.title:<54} <- {', '.join(gate.depends_on) or 'none':<8} {tests}"
        deps[phase.id] = gate.depends_on
    try:
        order = topological_order(deps)
    except GateError as e:
        print(f"warning: {e}; listing by id")
        order = sorted(rows)
    for i in order:
        print(rows[i])
    return 0


def _library_ids(root: Path) -> set[str]:
    path = root / "blueprint" / "failure_modes.yaml"
    return {fm["id"] for fm in yaml.safe_load(path.read_text())} if path.is_file() else set()


def cmd_show(root: Path, phase_id: str) -> int:
    phases = {p.id: p for p in discover(root)}
    if phase_id not in phases:
        raise GateError(f"no phase {phase_id} (known: {', '.join(sorted(phases))})")
    phase = phases[phase_id]
    gate = phase.load_gate()
    print(f"{gate.id}  {gate.title}\n    {phase.rel}/gate.yaml")
    print(f"depends on: {', '.join(gate.depends_on) or 'none'}")
    print(f"unlocks:    {', '.join(gate.unlocks) or '-'}")
    print("runs:")
    for run in gate.runs:
        needs = f" [requires {', '.join(run.requires)}]" if run.requires else ""
        for nproc in run.nproc or (1,):
            cmd = ["python", *pytest_command(run, nproc, root)[1:]]
            print(f"  - {run.mode}{needs}, timeout {run.timeout_s:g} s:\n      {shlex.join(cmd)}")
    print("eager gate:")
    for rule in gate.eager_gate:
        mark = "" if has_tests(root, rule.test) else "  [test file missing]"
        print(f"  - {rule.rule}\n      enforced by {rule.test}{mark}")
    print("done when:")
    for c in gate.done_criteria:
        print(f"  - {c}")
    print("failure modes:")
    library = _library_ids(root)
    for fm in gate.failure_modes:
        local = "" if fm.id in library else " (local to this gate)"
        print(f"  {fm.id}{local}\n    symptom: {fm.symptom}\n    check:   {fm.check}\n"
              f"    fix:     {fm.fix}\n    tests:   {', '.join(fm.tests)}")
    return 0


def cmd_run(root: Path, args, argv: list[str]) -> int:
    options = Options(upto=args.upto, only=args.only, start=args.start, keep_going=args.keep_going,
                      mode=args.mode, skip_empty=args.skip_empty)
    results = run_gates(root, options)
    code = exit_code(results)
    data = report.build_report(results, argv, code)
    report.print_table(data["phases"])
    report.write_report(data, args.report or root / "gate-report.json")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 all passed or skipped, 1 a phase
    failed or was blocked, 2 a bad tree, gate file or selection)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    root = args.root.resolve()
    try:
        if args.command == "list":
            return cmd_list(root)
        if args.command == "show":
            return cmd_show(root, args.phase)
        if args.command == "status":
            report.print_table(report.read_report(args.report or root / "gate-report.json")["phases"])
            return 0
        return cmd_run(root, args, argv)
    except GateError as e:
        print(f"error: {e}", file=sys.stderr)
        return ERROR_EXIT
