"""``python -m gates audit``: prove what each gate catches by planting known faults.

A mutation is a small named change that reproduces a failure mode
(``gates/mutations/NN.yaml``): in each patch, ``find`` replaced by ``replace`` in the
canonical text of one symbol (``gates.anchor``: ``ast.unparse`` of a class or function,
``python -m gates canonical SYMBOL`` prints it), so a formatter run, a module moved with its
references or an edit elsewhere leaves it applicable. The audit copies the tree to a temporary
directory (never touching the working tree), applies one mutation, runs the owning phase's gate
there (``--all-phases``: every phase, ``--keep-going``) and reads the gate report.

Verdicts: ``caught`` (the owning phase FAILs), ``caught-later`` (only a later
phase FAILs: the owning phase misses it), ``escaped`` (no phase FAILs),
``stale`` (the patch no longer applies: its symbol is gone or its text is not there once; the
message names the symbol) and
``error`` (the gate run itself broke: bad tree, no report). ``hint ok`` says
whether the failing phase's report named every failure mode the mutation
lists. The exit code is 0 only when every mutation is caught by its owning
phase with the right hint.

Catalogue entry::

    - id: M01-rms-eps              # unique
      phase: "01"                  # the phase that owns the fault
      failure_modes: [FM-047]      # the report of that phase must name these
      description: rms_norm drops + eps
      patches:
        - symbol: engine/model/kernels/reference.py::rms_norm
          find: "keepdim=True) + eps)"
          replace: "keepdim=True))"
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gates import anchor
from gates.flaky import default_load
from gates.schema import GateError

COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info",
                                     "build", "out", "gate-report*.json", "audit-report*.json")
CAUGHT, LATER, ESCAPED, STALE, ERROR = "caught", "caught-later", "escaped", "stale", "error"
MUTATION_ID = re.compile(r"^M\d\d-[\w-]+$")


@dataclass(frozen=True)
class Patch:
    symbol: str      # path::Qualified.name, or a module's path for its own code
    find: str        # in the symbol's canonical text (gates.anchor)
    replace: str

    @property
    def file(self) -> str:
        return anchor.split_symbol(self.symbol)[0]


@dataclass(frozen=True)
class Mutation:
    id: str
    phase: str
    failure_modes: tuple[str, ...]
    description: str
    patches: tuple[Patch, ...]


@dataclass
class Outcome:
    """What one mutation's gate run showed."""
    id: str
    phase: str
    failure_modes: list[str]
    description: str
    verdict: str = ERROR
    caught_by: list[str] = field(default_factory=list)   # phases that FAILed, in run order
    named: list[str] = field(default_factory=list)       # failure modes the owning (or first failing) phase named
    hint_ok: bool = False
    failing_tests: list[str] = field(default_factory=list)
    detail: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict == CAUGHT and self.hint_ok


def load_catalogue(directory: Path) -> list[Mutation]:
    """Every mutation in ``directory/*.yaml``, validated (GateError names the file and entry)."""
    if not directory.is_dir():
        raise GateError(f"{directory}: no mutation catalogue")
    mutations: dict[str, Mutation] = {}
    for path in sorted(directory.glob("*.yaml")):
        try:
            entries = yaml.safe_load(path.read_text()) or []
        except yaml.YAMLError as e:
            raise GateError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(entries, list):
            raise GateError(f"{path}: must be a list of mutations")
        for i, e in enumerate(entries):
            where = f"{path.name}[{i}]"
            if not isinstance(e, dict) or set(e) != {"id", "phase", "failure_modes", "description", "patches"}:
                raise GateError(f"{where}: needs exactly id, phase, failure_modes, description, patches")
            if not isinstance(e["id"], str) or not MUTATION_ID.match(e["id"]):
                raise GateError(f"{where}: id must look like M01-name, got {e['id']!r}")
            if e["id"] in mutations:
                raise GateError(f"{where}: duplicate id {e['id']}")
            if not isinstance(e["phase"], str) or not re.match(r"^\d\d$", e["phase"]):
                raise GateError(f"{where}: phase must be a two-digit string, got {e['phase']!r}")
            if not e["failure_modes"] or not all(isinstance(f, str) for f in e["failure_modes"]):
                raise GateError(f"{where}: failure_modes must be a non-empty list of ids")
            patches = []
            for j, p in enumerate(e["patches"] or []):
                if not isinstance(p, dict) or set(p) != {"symbol", "find", "replace"} or p["find"] == p["replace"]:
                    raise GateError(f"{where}.patches[{j}]: needs symbol, find, replace (find != replace)")
                patches.append(Patch(str(p["symbol"]), str(p["find"]), str(p["replace"])))
            if not patches:
                raise GateError(f"{where}: patches must not be empty")
            mutations[e["id"]] = Mutation(e["id"], e["phase"], tuple(e["failure_modes"]), str(e["description"]),
                                          tuple(patches))
    return list(mutations.values())


def parse_phases(text: str) -> set[str]:
    """``05``, ``01,03`` or ``01..08`` -> phase ids."""
    ids: set[str] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("..")
        if not lo.isdigit() or (hi and not hi.isdigit()) or len(lo) > 2 or len(hi) > 2:
            raise GateError(f"--phase: not a phase id or range: {part!r}")
        ids.update(f"{n:02d}" for n in range(int(lo), int(hi or lo) + 1))
    return ids


def select(mutations: list[Mutation], phases: set[str] | None, only: list[str] | None) -> list[Mutation]:
    """Mutations of ``phases`` whose failure modes or id include one of ``only``."""
    chosen = [m for m in mutations if phases is None or m.phase in phases]
    if only:
        chosen = [m for m in chosen if set(only) & ({m.id} | set(m.failure_modes))]
    if not chosen:
        raise GateError("the selection matches no mutation")
    return chosen


def apply(tree: Path, mutation: Mutation) -> str:
    """Patch the copy at ``tree``; returns a problem naming the symbol ('' when every patch applied)."""
    for p in mutation.patches:
        path = tree / p.file
        if not path.is_file():
            return f"{p.symbol}: no such file {p.file} (moved? rewrite the symbol with its references)"
        try:
            path.write_text(anchor.replace_in(path.read_text(), p.symbol, p.find, p.replace))
        except anchor.AnchorError as e:
            return str(e)
    return ""


def _gate_command(tree: Path, mutation: Mutation, all_phases: bool, report: Path, slots: int) -> list[str]:
    cmd = [sys.executable, "-m", "gates", "--root", str(tree), "run", "--report", str(report), "--jobs", str(slots)]
    return cmd + (["--keep-going", "--skip-empty"] if all_phases else ["--only", mutation.phase])


def _judge(out: Outcome, mutation: Mutation, phases: list[dict]) -> None:
    failed = [p for p in phases if p["status"] == "FAIL"]
    out.caught_by = [p["id"] for p in failed]
    own = next((p for p in phases if p["id"] == mutation.phase), None)
    if own is None:
        out.verdict, out.detail = ERROR, f"phase {mutation.phase} is not in the report"
        return
    reporter = own if own["status"] == "FAIL" else (failed[0] if failed else None)
    if own["status"] == "FAIL":
        out.verdict = CAUGHT
    elif failed:
        out.verdict = LATER
    else:
        out.verdict = ESCAPED
        out.detail = f"phase {mutation.phase} {own['status']}"
    if reporter is not None:
        out.named = list(reporter["failure_modes"])
        out.failing_tests = list(reporter["failing_tests"])
        out.hint_ok = set(mutation.failure_modes) <= set(out.named)
        out.detail = out.detail or reporter["reason"]


def run_mutation(root: Path, mutation: Mutation, all_phases: bool = False, timeout_s: float = 3600,
                 slots: int = 1, threads: int | None = None) -> Outcome:
    """Apply ``mutation`` to a temporary copy of ``root`` and judge its gate run (``slots``: the
    gate run's ``--jobs``; ``threads``: the OpenMP threads of each of its processes, None: the
    gate run's own choice, one thread per core for a lone session)."""
    out = Outcome(mutation.id, mutation.phase, list(mutation.failure_modes), mutation.description)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"audit-{mutation.id}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(root, tree, ignore=COPY_IGNORE, symlinks=True)
        problem = apply(tree, mutation)
        if problem:
            out.verdict, out.detail = STALE, problem
            return out
        report = Path(tmp) / "report.json"
        env = dict(os.environ)
        gates_parent = str(Path(__file__).resolve().parent.parent)
        # the copy first; what the caller's path held after it (packages installed beside the tree, as
        # the GPU host's carried wheels are: without them phases 10 and 14 failed every file)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), gates_parent, *filter(None, [env.get("PYTHONPATH")])])
        env["GATES_AUDIT"] = "1"  # conftest.py: Hypothesis does not shrink (a failure is all the audit needs)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        try:
            proc = subprocess.run(_gate_command(tree, mutation, all_phases, report, slots), cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out.detail = f"gate run exceeded {timeout_s:g} s"
            return out
        finally:
            out.duration_s = round(time.monotonic() - start, 1)
        if not report.is_file():
            out.detail = f"no report (exit code {proc.returncode}): {proc.stderr.strip()[-300:]}"
            return out
        _judge(out, mutation, json.loads(report.read_text())["phases"])
    return out


def run_audit(root: Path, mutations: list[Mutation], all_phases: bool = False, jobs: int = 1,
              progress=print) -> list[Outcome]:
    """Run every mutation (``jobs`` at a time, the cores shared among their gate runs); ``progress``
    gets one line per finished mutation."""
    slots = max(1, default_load() // max(1, jobs))
    # gate runs side by side keep one OpenMP thread a process, as a gate run's own sessions side by side
    # do: a gate run of one slot runs its sessions one at a time at torch's default of a thread per
    # core, and two such runs on two cores spun on each other's cores (phase 09: 465 s a mutation, 80 s now)
    threads = 1 if jobs > 1 else None

    def one(m: Mutation) -> Outcome:
        o = run_mutation(root, m, all_phases, slots=slots, threads=threads)
        progress(f"{o.id:<28} {o.verdict:<13} hint {'ok' if o.hint_ok else 'MISSING':<8} ({o.duration_s:.0f} s)")
        return o

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, mutations))


def table(outcomes: list[Outcome]) -> str:
    """The summary table (Markdown), one row per mutation."""
    rows = ["| mutation | phase | failure modes | verdict | caught by | hint ok |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| {o.id} | {o.phase} | {', '.join(o.failure_modes)} | {o.verdict} | "
                    f"{', '.join(o.caught_by) or '-'} | {'yes' if o.hint_ok else 'no'} |")
    return "\n".join(rows)


def build_report(outcomes: list[Outcome], argv: list[str], code: int) -> dict:
    return {"command": " ".join(["python -m gates", *argv]), "exit_code": code,
            "summary": {v: sum(o.verdict == v for o in outcomes) for v in (CAUGHT, LATER, ESCAPED, STALE, ERROR)}
            | {"hint_missing": sum(o.verdict in (CAUGHT, LATER) and not o.hint_ok for o in outcomes)},
            "mutations": [asdict(o) | {"ok": o.ok} for o in outcomes]}


def exit_code(outcomes: list[Outcome]) -> int:
    """0 when every mutation is caught by its owning phase and the report named its failure modes."""
    return 0 if all(o.ok for o in outcomes) else 1
