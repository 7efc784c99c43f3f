"""``python -m gates list | show NN | run [...] | status | next | exercise | audit | diff OLD NEW``;
see ``--help``."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml

from gates import anchor, audit, contracts, diff, flaky, next_step, report
from gates.execute import pytest_command
from gates.exercise import exercise, select
from gates.phases import defines_test, discover, has_tests, test_files, topological_order
from gates.runner import Options, default_jobs, exit_code, run_gates
from gates.schema import GateError

REPO_ROOT = Path(__file__).resolve().parent.parent
ERROR_EXIT = 2


def _phase_id(text: str) -> str:
    if not text.isdigit() or len(text) > 2:
        raise argparse.ArgumentTypeError(f"not a phase id: {text!r}")
    return text.zfill(2)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _phase_ids(text: str) -> list[str]:
    return [_phase_id(t.strip()) for t in text.split(",") if t.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gates", description="Run and inspect the phase gates.")
    p.add_argument("--root", type=Path, default=REPO_ROOT,
                   help="repository root holding phases/ (default: %(default)s)")
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
    run.add_argument("--nproc", type=lambda t: tuple(int(x) for x in t.split(",") if x.strip()),
                     help="torchrun runs only at these rank counts, e.g. 2 on a two-GPU host (default: every "
                          "count a gate names)")
    run.add_argument("--report", type=Path, help="JSON report path (default: ROOT/gate-report.json)")
    run.add_argument("--jobs", type=_positive, default=default_jobs(),
                     help="CPU slots the runs share: phases whose dependencies passed run side by side, a torchrun "
                          "run takes a slot per rank, a single run a slot per test file (a pytest session each); "
                          "1 runs one thing at a time (default: the cores here plus one, "
                          "%(default)s)")
    run.add_argument("--repeat", type=_positive, default=1,
                     help="run the selection N times and list every test whose outcome differed (flaky tests)")
    run.add_argument("--load", action="store_true",
                     help="beside the runs, one busy process per core (they stop by themselves when the run ends)")
    status = sub.add_parser("status", help="the table of the last report")
    status.add_argument("--report", type=Path, help="JSON report path (default: ROOT/gate-report.json)")
    nxt = sub.add_parser("next", help="from the last report: the first phase to work on, its failing tests, the "
                                      "failure modes they match, its functions still to write, the contract to "
                                      "read (exit 0 when every phase passed)")
    nxt.add_argument("--report", type=Path, help="JSON report path (default: ROOT/gate-report.json)")
    nxt.add_argument("--json", action="store_true", help="the same as one JSON object (for agents)")
    ex = sub.add_parser("exercise", help="copy the repository to OUT with the code of some phases replaced by "
                                         "skeletons (signature, docstring, raise NotImplementedError), to build "
                                         "them again")
    which = ex.add_mutually_exclusive_group(required=True)
    which.add_argument("--only", type=_phase_ids, help="these phases, e.g. 05 or 05,06")
    which.add_argument("--from", dest="start", type=_phase_id, help="this phase and every later one")
    ex.add_argument("--out", type=Path, required=True, help="the copy's directory (absent or empty)")
    c = sub.add_parser("contracts", help="the cross-phase contract matrix: generated mutants of a phase's code run "
                                         "against its tests and, where they survive, the later phases'; lists "
                                         "what only a later phase catches (exit 1 when anything is)")
    c.add_argument("--phase", type=audit.parse_phases, help="these phases: 08, 01,03 or 01..09 (default: every one)")
    c.add_argument("--budget", type=_positive, default=40, help="mutants run per phase (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="the sample's seed (default: %(default)s)")
    c.add_argument("--jobs", type=_positive, default=2, help="mutants run at once (default: %(default)s)")
    c.add_argument("--later-seconds", type=_positive, help="stop running a mutant's later phases after this long "
                                                            "(verdict unresolved; default: no limit)")
    c.add_argument("--report", type=Path, help="JSON report (default: ROOT/build/contracts-report.json)")
    cn = sub.add_parser("canonical", help="the canonical text of a symbol (path::Qualified.name), which a "
                                          "mutation's find and replace are written against")
    cn.add_argument("symbol")
    a = sub.add_parser("audit", help="plant each catalogued fault (gates/mutations) in a copy of the tree and "
                                     "check that the owning phase catches it with the right failure-mode hint")
    a.add_argument("--phase", type=audit.parse_phases, help="mutations owned by these phases: 05, 01,03 or 01..08")
    a.add_argument("--only", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   help="mutations citing these failure modes or ids, e.g. FM-022 or M04-vocab-mask")
    a.add_argument("--jobs", type=int, default=1, help="mutations run at once (default: %(default)s)")
    a.add_argument("--all-phases", action="store_true",
                   help="run every phase, not only the owning one (says which later phase catches an escape)")
    a.add_argument("--catalogue", type=Path, help="mutation directory (default: ROOT/gates/mutations)")
    a.add_argument("--report", type=Path, help="JSON report path (default: ROOT/build/audit-report.json)")
    a.add_argument("--list", action="store_true", help="list the selected mutations, run nothing")
    d = sub.add_parser("diff", help="what changed between two gate reports: phase statuses, flipped tests, "
                                    "slower runs, benchmark figures (exit 1 if something regressed)")
    d.add_argument("old", type=Path, help="the earlier report (JSON)")
    d.add_argument("new", type=Path, help="the later report (JSON)")
    d.add_argument("--tolerance", type=float, default=None,
                   help="benchmark figures: relative worsening allowed (default: the one recorded in NEW, "
                        f"else {diff.DEFAULT_TOLERANCE})")
    d.add_argument("--slower", type=float, default=diff.DEFAULT_SLOWER,
                   help=f"a run slower by more than this fraction (and {diff.MIN_SLOWER_S:g} s) regressed "
                        "(default: %(default)s)")
    return p


def cmd_list(root: Path) -> int:
    """Exit code 1 if a gate file is broken or a dependency is unknown or part of a cycle."""
    rows, deps, code = {}, {}, 0
    for phase in discover(root):
        try:
            gate = phase.load_gate()
        except GateError as e:
            problem = str(e).removeprefix(f"{phase.rel}/gate.yaml: ")
            rows[phase.id] = f"{phase.id}  {phase.rel:<54} BROKEN gate.yaml {problem}"
            deps[phase.id] = ()
            code = 1
            continue
        n = len(test_files(phase))
        tests = f"{n} test file{'s' * (n != 1)}" if n else "no tests yet"
        rows[phase.id] = f"{phase.id}  {gate.title:<54} <- {', '.join(gate.depends_on) or 'none':<8} {tests}"
        deps[phase.id] = gate.depends_on
    try:
        order = topological_order(deps)
    except GateError as e:
        print(f"error: {e}; listing by id")
        order, code = sorted(rows), 1
    unknown = sorted({d for ds in deps.values() for d in ds} - set(rows))
    if unknown:
        print(f"error: depends_on names unknown phase(s) {', '.join(unknown)}")
        code = 1
    for i in order:
        print(rows[i])
    return code


def _library_ids(root: Path) -> set[str]:
    path = root / "blueprint" / "failure_modes.yaml"
    return {fm["id"] for fm in yaml.safe_load(path.read_text())} if path.is_file() else set()


def cmd_show(root: Path, phase_id: str) -> int:
    """Exit code 1 if a rule names a test that does not exist (in a phase with tests)."""
    phases = {p.id: p for p in discover(root)}
    if phase_id not in phases:
        raise GateError(f"no phase {phase_id} (known: {', '.join(sorted(phases))})")
    phase = phases[phase_id]
    gate = phase.load_gate()
    print(f"{gate.id}  {gate.title}\n    {phase.rel}/gate.yaml")
    print(f"depends on: {', '.join(gate.depends_on) or 'none'}")
    print("unlocks:" + "".join(f"\n  - {u}" for u in gate.unlocks) if gate.unlocks else "unlocks:    -")
    for note in gate.notes:
        print(f"  note: {note}")
    print("runs:")
    for run in gate.runs:
        needs = f" [requires {', '.join(run.requires)}]" if run.requires else ""
        needs += " [alone: nothing runs beside it]" if run.alone else ""
        for nproc in run.nproc or (1,):
            cmd = ["python", *pytest_command(run, nproc, root)[1:]]
            print(f"  - {run.mode}{needs}, timeout {run.timeout_s:g} s:\n      {shlex.join(cmd)}")
    print("eager gate:")
    missing = 0
    for rule in gate.eager_gate:
        mark = ""
        if not has_tests(root, rule.test):
            mark = "  [test file missing]"
        elif not defines_test(root, rule.test):
            mark = "  [no such test]"
        missing += bool(mark)
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
    if missing and test_files(phase):
        print(f"error: {missing} eager-gate rule(s) name a test that does not exist", file=sys.stderr)
        return 1
    return 0


def cmd_run(root: Path, args, argv: list[str]) -> int:
    """Exit code 1 if a phase failed or was blocked in any repeat, or a test's outcome differed
    between repeats."""
    options = Options(upto=args.upto, only=args.only, start=args.start, keep_going=args.keep_going,
                      mode=args.mode, skip_empty=args.skip_empty, nproc=args.nproc, jobs=args.jobs)
    load = flaky.default_load() if args.load else 0
    repeats = []
    with flaky.cpu_load(load):
        for i in range(args.repeat):
            if args.repeat > 1:
                print(f"\n#### repeat {i + 1} of {args.repeat}{f' beside {load} busy processes' if load else ''}",
                      flush=True)
            results = run_gates(root, options)
            repeats.append((results, exit_code(results)))
    code = max(c for _, c in repeats)
    data = report.build_report(results, argv, code)
    report.print_table(data["phases"])
    if args.repeat > 1:
        differ = flaky.differing([flaky.outcomes(r) for r, _ in repeats])
        code = max(code, int(bool(differ)))
        data["exit_code"] = code
        data["repeats"] = {"count": args.repeat, "busy_processes": load, "differing_tests": differ,
                           "statuses": [{r.id: r.status for r in results} for results, _ in repeats]}
        print(f"\n{args.repeat} repeats{f' beside {load} busy processes' if load else ''}: "
              f"{len(flaky.outcomes(results))} test outcomes compared, {len(differ)} differed")
        for name, got in differ.items():
            print(f"  FLAKY {name}: {', '.join(got)}")
    report.write_report(data, args.report or root / "gate-report.json")
    return code


def cmd_audit(root: Path, args, argv: list[str]) -> int:
    mutations = audit.select(audit.load_catalogue(args.catalogue or root / "gates" / "mutations"),
                             args.phase, args.only)
    if args.list:
        for m in mutations:
            print(f"{m.id:<28} {m.phase}  {', '.join(m.failure_modes):<16} {m.description}")
        return 0
    print(f"auditing {len(mutations)} mutation(s), {args.jobs} at a time"
          f"{' (every phase)' if args.all_phases else ''}", flush=True)
    outcomes = audit.run_audit(root, mutations, args.all_phases, args.jobs,
                               progress=lambda line: print(line, flush=True))
    code = audit.exit_code(outcomes)
    print("\n" + audit.table(outcomes))
    for o in outcomes:
        if not o.ok:
            print(f"\n{o.id} ({o.verdict}, hint {'ok' if o.hint_ok else 'missing'}): {o.description}\n"
                  f"    expected {', '.join(o.failure_modes)} from phase {o.phase}; named: "
                  f"{', '.join(o.named) or 'none'}\n    {o.detail}")
    path = args.report or root / "build" / "audit-report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(audit.build_report(outcomes, argv, code), indent=1) + "\n")
    print(f"report: {path}")
    return code


def cmd_contracts(root: Path, args, argv: list[str]) -> int:
    ids = [p.id for p in discover(root)]
    chosen = sorted(args.phase & set(ids)) if args.phase else ids
    matrices = contracts.compute(root, chosen, args.budget, args.seed, args.jobs,
                                 progress=lambda line: print(line, flush=True), later_seconds=args.later_seconds)
    print("\n" + contracts.summary(matrices))
    path = args.report or root / "build" / "contracts-report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(contracts.report(matrices, argv), indent=1) + "\n")
    print(f"report: {path}")
    return contracts.exit_code(matrices)


def cmd_canonical(root: Path, symbol: str) -> int:
    path, qualname = anchor.split_symbol(symbol)
    if not (root / path).is_file():
        raise GateError(f"{symbol}: no such file {path}")
    try:
        print(anchor.canonical((root / path).read_text(), qualname, symbol))
    except anchor.AnchorError as e:
        raise GateError(str(e)) from None
    return 0


def cmd_next(root: Path, args) -> int:
    """Exit code 0 when every phase of the tree passed or was skipped, else 1."""
    advice = next_step.advise(root, report.read_report(args.report or root / "gate-report.json"))
    print(json.dumps(advice, indent=1, ensure_ascii=False) if args.json else next_step.render(advice))
    return 0 if advice["status"] == "pass" else 1


def cmd_exercise(root: Path, args) -> int:
    phases = select([p.id for p in discover(root)], args.only, args.start)
    replaced = exercise(root, args.out, phases)
    out = args.out.resolve()
    count = sum(map(len, replaced.values()))
    print(f"phase(s) {', '.join(sorted(phases))} handed out in {out}: {count} functions in {len(replaced)} "
          "modules now raise NotImplementedError")
    for path, names in replaced.items():
        print(f"  {path}: {len(names)}")
    python = ".venv/bin/python" if (out / ".venv").exists() else shlex.quote(sys.executable)
    print(f"next:\n  cd {shlex.quote(str(out))}\n  {python} -m gates run --upto {min(phases)}\n  "
          f"{python} -m gates next")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 all passed or skipped, 1 a phase
    failed or was blocked, 2 a bad tree, gate file or selection). ``next``: 0 every phase
    passed, 1 there is work left. ``diff``: 0 nothing
    regressed, 1 something did (``gates.diff``), 2 a missing or unreadable report."""
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
        if args.command == "next":
            return cmd_next(root, args)
        if args.command == "exercise":
            return cmd_exercise(root, args)
        if args.command == "audit":
            return cmd_audit(root, args, argv)
        if args.command == "contracts":
            return cmd_contracts(root, args, argv)
        if args.command == "canonical":
            return cmd_canonical(root, args.symbol)
        if args.command == "diff":
            text, regressed = diff.diff(report.read_report(args.old), report.read_report(args.new),
                                        args.tolerance, args.slower)
            print(text)
            return int(regressed)
        return cmd_run(root, args, argv)
    except GateError as e:
        print(f"error: {e}", file=sys.stderr)
        return ERROR_EXIT
