"""``python -m gates contracts``: the cross-phase contract matrix, computed from generated mutants.

For a phase, every function and method it owns (``gates.ownership``) yields mutants
(``gates.mutants``). A seeded sample of them, ``budget`` per phase, runs against the test files
of the owning phase that call the mutated function and, where it survives them, against the
later phases' (those that depend on it), phase by phase in dependency order, until one fails.
Which test files call which function comes from one run of every test file first, under
``gates.calls`` (the same run shows that the unmutated tree passes them), saved in ``build/contracts-calls.json``
with a digest of engine/ and phases/: a later run on the same code and tests reuses it.

A mutant is then
- ``owner``: the owning phase's tests fail;
- ``later``: only a later phase's tests fail: **a contract the owner does not test** (its
  failing test names the contract) -- unless the owner's gate names the function under
  ``contracts_tested_later:`` with that phase and why (an ``exception``);
- ``none``: no phase fails (an equivalent mutant, or a change nothing tests);
- ``unresolved``: the owner's tests pass and the later phases' ran out of ``later_seconds``
  before any failed (a budget for the slowest case, a mutant no phase kills, which runs every
  later test file that calls its function);
- ``unexercised``: no test file of the owner or a later phase calls the function (counted over
  every mutant, never sampled: running them cannot fail anything).

Each run is a pytest session with ``-x`` forked from the gate runner's server in a copy of the
tree that holds one mutant at a time (``jobs`` copies side by side); a run past its time limit
(five times the file's unmutated time, at least a minute) counts as failing, as the gate would.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from queue import Queue

from gates import anchor, ownership
from gates.audit import COPY_IGNORE
from gates.execute import execute, missing_requirements
from gates.mutants import Mutant, mutants
from gates.phases import test_targets, topological_order
from gates.schema import Gate, Run

MIN_TIMEOUT_S = 60.0
TIMEOUT_FACTOR = 5.0


@dataclass(frozen=True)
class Target:
    """One pytest run of a phase: a single run's test file, or a torchrun run at its smallest size."""
    phase: str
    run: Run
    nproc: int

    @property
    def label(self) -> str:
        return " ".join(self.run.tests) + (f" (torchrun {self.nproc})" if self.run.mode == "torchrun" else "")


@dataclass
class Verdict:
    """What one mutant's runs showed."""
    id: str
    symbol: str
    operator: str
    line: int
    before: str
    after: str
    verdict: str = "none"            # owner, later, exception, none, unresolved
    killed_by: str = ""              # the phase whose run failed first
    failing_test: str = ""
    why: str = ""                    # an exception's reason
    duration_s: float = 0.0


@dataclass
class PhaseMatrix:
    phase: str
    pool: int = 0                    # every mutant of the phase's functions
    unexercised: int = 0             # of them, in functions no test calls
    verdicts: list[Verdict] = field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(v.verdict == verdict for v in self.verdicts)


def targets(root: Path, phase: str, gate: Gate) -> list[Target]:
    """The phase's runs that can run here: each single run's files, each torchrun run at its
    smallest size."""
    found = []
    for run in gate.runs:
        nproc = min(run.nproc) if run.nproc else 1
        if missing_requirements(run, nproc):
            continue
        if run.mode == "single":
            found += [Target(phase, replace(run, tests=(f,)), 1) for f in test_targets(root, run.tests)]
        else:
            found.append(Target(phase, run, nproc))
    return found


def _calls(directory: Path) -> dict[tuple[str, ...], set[tuple[str, str]]]:
    found: dict[tuple[str, ...], set[tuple[str, str]]] = {}
    for f in directory.glob("calls-*.json"):
        data = json.loads(f.read_text())
        found.setdefault(tuple(data["args"]), set()).update(map(tuple, data["calls"]))
    return found


def _run(tree: Path, target: Target, timeout_s: float) -> tuple[bool, str, float]:
    """Run ``target`` in ``tree``: (passed, the first failing test or reason, seconds)."""
    run = replace(target.run, timeout_s=timeout_s)
    result = execute(run, target.nproc, tree, threads=1)
    failing = result.failing[0]["nodeid"] if result.failing else result.reason
    return result.status in ("passed", "empty", "skipped"), failing, result.duration_s


@dataclass
class _Plan:
    """What the map run found: each target's functions called, time and baseline verdict."""
    calls: dict[Target, set[tuple[str, str]]] = field(default_factory=dict)
    seconds: dict[Target, float] = field(default_factory=dict)
    broken: dict[Target, str] = field(default_factory=dict)   # targets failing unmutated


def tree_digest(root: Path) -> str:
    """A digest of the code and tests a map run reads (every file under engine/ and phases/)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for d in ("engine", "phases") for p in (root / d).rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cached(cache: Path, digest: str, chosen: list[Target]) -> _Plan | None:
    """The map run saved in ``cache`` for this tree's digest, when it covered every target."""
    if not cache.is_file():
        return None
    data = json.loads(cache.read_text())
    if data.get("digest") != digest:
        return None
    runs = {r["label"]: r for r in data["targets"]}
    if any(t.label not in runs for t in chosen):
        return None
    plan = _Plan()
    for t in chosen:
        r = runs[t.label]
        plan.calls[t], plan.seconds[t] = {tuple(c) for c in r["calls"]}, r["seconds"]
        if r["broken"]:
            plan.broken[t] = r["broken"]
    return plan


def _save(cache: Path, digest: str, plan: _Plan) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"digest": digest, "targets": [
        {"label": t.label, "seconds": plan.seconds[t], "broken": plan.broken.get(t, ""), "calls": sorted(plan.calls[t])}
        for t in plan.calls]}))


def map_calls(tree: Path, chosen: list[Target], jobs: int, progress) -> _Plan:
    """Run every target once, unmutated, under ``gates.calls``."""
    plan = _Plan()
    with tempfile.TemporaryDirectory(prefix="gates-calls-") as out:
        os.environ["GATES_CALLS_DIR"] = out
        os.environ["PYTEST_PLUGINS"] = "gates.calls"
        try:
            def one(t: Target):
                ok, failing, seconds = _run(tree, t, t.run.timeout_s)
                plan.seconds[t] = seconds
                if not ok:
                    plan.broken[t] = failing
                progress(f"  mapped {t.label} ({seconds:.0f} s){'' if ok else ' FAILS unmutated: ' + failing}")
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(one, chosen))
        finally:
            del os.environ["GATES_CALLS_DIR"], os.environ["PYTEST_PLUGINS"]
        by_args = _calls(Path(out))
    for t in chosen:
        plan.calls[t] = by_args.get(tuple(t.run.tests), set())
    return plan


def _pyc_gone(path: Path) -> None:
    """Drop ``path``'s cached bytecode: a rewrite of the same size within a second would reuse it."""
    for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _judge(tree: Path, m: Mutant, owner: str, later: list[str], by_phase: dict[str, list[Target]],
           plan: _Plan, exceptions: dict[str, tuple[str, str]], later_seconds: float | None) -> Verdict:
    path, qualname = anchor.split_symbol(m.symbol)
    v = Verdict(m.id, m.symbol, m.operator, m.line, m.before, m.after)
    file = tree / path
    original = file.read_text()
    start = time.monotonic()
    try:
        file.write_text(anchor.splice(original, qualname, m.text))
        _pyc_gone(file)
        later_start = None
        for phase in [owner, *later]:
            for t in sorted(by_phase.get(phase, []), key=lambda t: plan.seconds[t]):   # quick kills first
                if t in plan.broken or (path, qualname) not in plan.calls[t]:
                    continue
                if phase != owner:
                    later_start = later_start or time.monotonic()
                    if later_seconds is not None and time.monotonic() - later_start > later_seconds:
                        v.verdict = "unresolved"
                        return v
                ok, failing, _ = _run(tree, t, max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * plan.seconds[t]))
                if not ok:
                    v.killed_by, v.failing_test = phase, failing
                    if phase == owner:
                        v.verdict = "owner"
                    elif exceptions.get(m.symbol, ("", ""))[0] == phase:
                        v.verdict, v.why = "exception", exceptions[m.symbol][1]
                    else:
                        v.verdict = "later"
                    return v
        return v
    finally:
        file.write_text(original)
        _pyc_gone(file)
        v.duration_s = round(time.monotonic() - start, 1)


def phase_mutants(root: Path, own: ownership.Ownership, phase: str) -> list[Mutant]:
    """Every mutant of every function ``phase`` owns, in a fixed order."""
    found = []
    for path, names in own.functions_of({phase}).items():
        tree = ast.parse((root / path).read_text())
        for qualname in names:
            found += mutants(f"{path}::{qualname}", anchor.locate(tree, qualname))
    return found


@dataclass
class _Session:
    """What judging a phase's mutants needs: the gates, ownership, each phase's later phases and
    targets, the map run, the tree copies (a queue) and how to run and report."""
    root: Path
    gates: dict[str, Gate]
    own: ownership.Ownership
    later: dict[str, list[str]]
    by_phase: dict[str, list[Target]]
    plan: _Plan
    trees: Queue
    jobs: int
    progress: object
    later_seconds: float | None

    def matrix(self, phase: str, budget: int, seed: int) -> PhaseMatrix:
        """The phase's pool, what no test reaches, and its seeded sample of ``budget`` judged."""
        reach = [t for q in [phase, *self.later[phase]] for t in self.by_phase[q] if t not in self.plan.broken]
        called = set().union(*(self.plan.calls[t] for t in reach)) if reach else set()
        pool = phase_mutants(self.root, self.own, phase)
        matrix = PhaseMatrix(phase, pool=len(pool))
        exercised = sorted((m for m in pool if anchor.split_symbol(m.symbol) in called), key=lambda m: m.id)
        matrix.unexercised = len(pool) - len(exercised)
        random.Random(f"{seed}:{phase}").shuffle(exercised)
        exceptions = {e.symbol: (e.phase, e.why) for e in self.gates[phase].contracts_tested_later}
        self.progress(f"phase {phase}: {len(pool)} mutants, {matrix.unexercised} in functions no test calls; "
                      f"running {min(budget, len(exercised))}")

        def one(m: Mutant) -> Verdict:
            tree = self.trees.get()
            try:
                v = _judge(tree, m, phase, self.later[phase], self.by_phase, self.plan, exceptions, self.later_seconds)
            finally:
                self.trees.put(tree)
            where = f" by {v.killed_by}: {v.failing_test}" if v.killed_by else ""
            self.progress(f"  {v.verdict:<10} {m.id} line {m.line}: {m.before!r} -> {m.after!r}{where} "
                          f"({v.duration_s:.0f} s)")
            return v
        with ThreadPoolExecutor(max_workers=self.jobs) as pool_:
            matrix.verdicts = list(pool_.map(one, exercised[:budget]))
        return matrix


def compute(root: Path, phases: list[str], budget: int, seed: int, jobs: int, progress=print,
            later_seconds: float | None = None) -> list[PhaseMatrix]:
    """The matrix of ``phases`` (see the module docstring)."""
    gates = ownership.all_gates(root)
    closure = ownership.dependency_closure(gates)
    order = topological_order({i: g.depends_on for i, g in gates.items()})
    later = {p: [q for q in order if p in closure[q]] for p in phases}
    needed = sorted(set(phases) | {q for p in phases for q in later[p]})
    by_phase = {p: targets(root, p, gates[p]) for p in needed}
    jobs = max(1, jobs)
    with tempfile.TemporaryDirectory(prefix="gates-contracts-") as tmp:
        trees: Queue[Path] = Queue()
        for i in range(jobs):
            shutil.copytree(root, Path(tmp, f"tree{i}"), ignore=COPY_IGNORE, symlinks=True)
            trees.put(Path(tmp, f"tree{i}"))
        chosen = [t for p in needed for t in by_phase[p]]
        digest, cache = tree_digest(root), root / "build" / "contracts-calls.json"
        plan = _cached(cache, digest, chosen)
        if plan is None:
            progress(f"contracts: mapping which functions the tests of phases {', '.join(needed)} call")
            first = trees.get()
            plan = map_calls(first, chosen, jobs, progress)
            trees.put(first)
            _save(cache, digest, plan)
        else:
            progress(f"contracts: which functions the tests call, from {cache} (same code and tests)")
        session = _Session(root, gates, ownership.load(root, gates), later, by_phase, plan, trees, jobs, progress,
                           later_seconds)
        saved = os.environ.get("PYTEST_ADDOPTS")   # a mutant's run stops at its first failure
        os.environ["PYTEST_ADDOPTS"] = " ".join(filter(None, [saved, "-x"]))
        try:
            return [session.matrix(phase, budget, seed) for phase in phases]
        finally:
            if saved is None:
                del os.environ["PYTEST_ADDOPTS"]
            else:
                os.environ["PYTEST_ADDOPTS"] = saved


def summary(matrices: list[PhaseMatrix]) -> str:
    """A table of the figures per phase, then every owner-untested contract."""
    lines = ["| phase | mutants | no test calls | run | owner kills | later only | exceptions | none | unresolved |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in matrices:
        lines.append(f"| {m.phase} | {m.pool} | {m.unexercised} | {len(m.verdicts)} | {m.count('owner')} | "
                     f"{m.count('later')} | {m.count('exception')} | {m.count('none')} | {m.count('unresolved')} |")
    for m in matrices:
        for v in (v for v in m.verdicts if v.verdict == "later"):
            lines.append(f"\nphase {m.phase} does not test: {v.id} (line {v.line}) {v.before!r} -> {v.after!r}\n"
                         f"  caught by phase {v.killed_by}: {v.failing_test}")
    return "\n".join(lines)


def report(matrices: list[PhaseMatrix], argv: list[str]) -> dict:
    return {"command": " ".join(["python -m gates", *argv]),
            "phases": [{"phase": m.phase, "pool": m.pool, "unexercised": m.unexercised,
                        **{k: m.count(k) for k in ("owner", "later", "exception", "none", "unresolved")},
                        "mutants": [asdict(v) for v in m.verdicts]} for m in matrices]}


def exit_code(matrices: list[PhaseMatrix]) -> int:
    """0 when no sampled mutant is caught only by a later phase (exceptions aside)."""
    return 0 if all(m.count("later") == 0 for m in matrices) else 1
