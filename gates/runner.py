"""Run the selected phases in dependency order and decide each phase's status.

A phase starts once every selected phase it stands on has passed (or been skipped). Its jobs,
and those of other phases ready at the same time, share ``Options.jobs`` CPU slots: a torchrun
run is a job that takes a slot per rank, a single run a job per test file (a pytest session
each) that takes one, merged into one result when its last file ends. Waiting jobs start
critical path first (see ``start_order``) whenever a slot frees, so the files of the phases
everything else waits for spread over every free slot; the first waiting job starts on fewer
slots than it wants rather than wait for them. Console output stays in dependency order.

A run marked ``alone`` (where it runs) waits for every running job and holds every waiting
one until it ends.

PASS: every run that ran passed (runs skipped for a missing requirement are
reported). FAIL: a run failed, timed out, or ran no test (a phase with no tests
is never PASS). BLOCKED: a selected dependency did not pass; its tests are not
run (without ``keep_going``). SKIP: every run was skipped for a missing
requirement, for ``mode`` filtering, or (``skip_empty``) for having no tests yet.
"""
from __future__ import annotations

import shlex
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

from gates import flaky, report
from gates.execute import RunResult, combine, execute, kill_running, missing_requirements, pytest_command
from gates.phases import Phase, defines_test, discover, has_tests, select, test_targets, topological_order
from gates.schema import FailureMode, Gate, GateError, Run

PASS, FAIL, BLOCKED, SKIP = "PASS", "FAIL", "BLOCKED", "SKIP"


def default_jobs() -> int:
    """The slots of a gate run: one more than the cores the runner may use. A run's processes are off
    the CPU part of the time (torchrun ranks waiting in collectives, a test waiting on the server it
    started, processes starting), so with a slot per core the cores sat idle: on 2 cores every phase
    took 12 min 53 s, CPU time 62% of the cores' time; with one slot more 8 min 46 s, 89% busy."""
    return flaky.default_load() + 1


@dataclass
class Options:
    upto: str | None = None
    only: list[str] | None = None
    start: str | None = None
    keep_going: bool = False
    mode: str = "all"          # single | torchrun | all
    skip_empty: bool = False
    nproc: tuple[int, ...] | None = None   # torchrun only at these rank counts (None: every count a gate names)
    jobs: int = 1   # CPU slots the runs share (see run_gates)


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


def _attempt(root: Path, run: Run, nproc: int, threads: int | None) -> RunResult:
    """Execute ``run`` at ``nproc`` ranks, or say why it cannot run here."""
    missing = missing_requirements(run, nproc)
    if missing:
        return RunResult(run.mode, nproc, run.tests, "skipped", f"requires {', '.join(missing)}")
    absent = [t for t in run.tests if not has_tests(root, t)]
    if len(absent) == len(run.tests):
        return RunResult(run.mode, nproc, run.tests, "empty", "no test files yet")
    if absent:
        return RunResult(run.mode, nproc, run.tests, "failed", f"missing test path(s): {', '.join(absent)}")
    return execute(run, nproc, root, threads)


@dataclass
class Job:
    """A torchrun run of a phase at one rank count, or one test file of a single run (``run``'s
    tests that file alone, ``whole`` the run as the gate declares it), waiting for CPU slots or
    running."""
    phase: str
    index: int          # its run's place among the phase's runs (the report keeps that order)
    run: Run
    nproc: int
    whole: Run | None = None   # a single run's file: the run it belongs to
    started: float = 0.0       # time.monotonic() when it started and finished
    finished: float = 0.0
    result: RunResult | None = None


def _phase_jobs(root: Path, gate: Gate, options: Options) -> tuple[PhaseResult, list[Job], list[int]]:
    """The phase's result so far (decided already when it has nothing to run or a broken
    eager gate), the jobs it runs, and the torchrun sizes ``--nproc`` leaves out."""
    result = PhaseResult(gate.id, gate.title, gate.depends_on)
    runs = [r for r in gate.runs if options.mode in ("all", r.mode)]
    if not runs:
        result.status, result.reason = SKIP, f"no {options.mode} runs"
        return result, [], []
    missing = missing_rule_tests(root, gate)
    if missing and any(has_tests(root, t) for r in gate.runs for t in r.tests):
        result.status = FAIL
        result.reason = "eager-gate rule names no test: " + ", ".join(missing)
        return result, [], []
    jobs, left_out, index = [], [], 0
    for run in runs:
        if run.mode == "single":  # a job per file; one whole-run job when it cannot run (no files yet, ...)
            files = test_targets(root, run.tests) if all(has_tests(root, t) for t in run.tests) else []
            jobs += [Job(gate.id, index, replace(run, tests=(f,)), 1, run) for f in files] or \
                [Job(gate.id, index, run, 1)]
            index += 1
            continue
        sizes = run.nproc or (1,)
        if options.nproc is not None:
            left_out += [n for n in sizes if n not in options.nproc]
            sizes = tuple(n for n in sizes if n in options.nproc)
        jobs += [Job(gate.id, index + i, run, n) for i, n in enumerate(sizes)]
        index += len(sizes)
    if not jobs:
        result.status, result.reason = SKIP, f"no runs at nproc {', '.join(map(str, options.nproc or ()))}"
    return result, jobs, left_out


def _judge_phase(result: PhaseResult, gate: Gate, options: Options, left_out: list[int]) -> None:
    """Set the status and reason of a phase whose runs have all finished."""
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


class OrderedOutput:
    """Each phase's console lines in run order, whatever order the phases run in: the first
    phase not yet finished prints as it goes; a later phase's lines wait until every phase
    before it has finished, then come out together."""

    def __init__(self, order: list[str]):
        self.order, self.head, self.done = order, 0, set()
        self.waiting: dict[str, list[str]] = {i: [] for i in order}

    def say(self, phase: str, line: str) -> None:
        if self.order[self.head] == phase:
            print(line, flush=True)
        else:
            self.waiting[phase].append(line)

    def finish(self, phase: str) -> None:
        self.done.add(phase)
        while self.head < len(self.order) and self.order[self.head] in self.done:
            self.head += 1
            if self.head < len(self.order):
                for line in self.waiting.pop(self.order[self.head]):
                    print(line, flush=True)


def chain_lengths(depends_on: dict[str, tuple[str, ...]], weights: dict[str, int] | None = None) -> dict[str, int]:
    """For each phase of ``depends_on`` (its selected dependencies, in dependency order): the
    weight of the heaviest chain of phases standing on it, itself included; a phase weighs
    ``weights[phase]`` (default 1: the number of phases on the chain)."""
    weights = weights or {}
    lengths: dict[str, int] = {}
    for pid in reversed(list(depends_on)):
        above = [lengths[q] for q, deps in depends_on.items() if pid in deps]
        lengths[pid] = weights.get(pid, 1) + max(above, default=0)
    return lengths


def path_lengths(depends_on: dict[str, tuple[str, ...]], weights: dict[str, int] | None = None) -> dict[str, int]:
    """For each phase of ``depends_on`` (as for ``chain_lengths``): the weight of the heaviest
    dependency path through it (the heaviest chain it stands on, itself, and the heaviest chain
    standing on it)."""
    weights = weights or {}
    chains, depth = chain_lengths(depends_on, weights), {}
    for pid, deps in depends_on.items():
        depth[pid] = weights.get(pid, 1) + max((depth[d] for d in deps), default=0)
    return {pid: depth[pid] + chains[pid] - weights.get(pid, 1) for pid in depends_on}


def job_count(root: Path, gate: Gate) -> int:
    """How many jobs ``gate``'s runs make (a test file of a single run or a torchrun run at one
    size is one; at least 1): the weight of its phase on a dependency path, each job taken as a
    unit of work (its duration is not known before it runs)."""
    return max(1, sum(len(test_targets(root, r.tests)) if r.mode == "single" else len(r.nproc or (1,))
                      for r in gate.runs))


def critical(job: Job, paths: dict[str, int], chains: dict[str, int]) -> tuple[int, int]:
    """How critical ``job``'s phase is: the longest dependency path through it, then the longest
    chain standing on it (larger: more critical)."""
    return paths[job.phase], chains[job.phase]


def start_order(job: Job, paths: dict[str, int], chains: dict[str, int], order: list[str]) -> tuple:
    """Sort key of a waiting job: the phases on the heaviest dependency path first, by jobs (the
    critical path: the last phase of a gate run waits on every phase of it), then those with the
    heaviest chain standing on them, then in dependency order; within a phase the single runs' files in
    order (most of a phase's tests), then the torchrun runs, most ranks first."""
    return (tuple(-x for x in critical(job, paths, chains)), order.index(job.phase), job.run.mode != "single",
            -job.nproc)


def alone(job: Job) -> bool:
    """``job`` runs with nothing beside it: its run says so and will run here (a run skipped for a
    missing requirement holds nothing up)."""
    return job.run.alone and not missing_requirements(job.run, job.nproc)


def run_result(root: Path, jobs: list[Job]) -> RunResult:
    """The result of one run of a phase from its finished jobs: a torchrun run's own, a single
    run's files merged (its time from the first file's start to the last one's end)."""
    if jobs[0].whole is None:
        return jobs[0].result
    whole = jobs[0].whole
    return combine(whole, [j.result for j in jobs], shlex.join(pytest_command(whole, 1, root)),
                   max(j.finished for j in jobs) - min(j.started for j in jobs))


def run_gates(root: Path, options: Options) -> list[PhaseResult]:
    """Run the selected phases of the tree at ``root``; print progress and failures as they
    happen, phase by phase in dependency order. A phase starts once every selected phase it
    depends on has passed (or been skipped); with ``options.jobs`` > 1 its runs, and those of
    other phases ready at the same time, share that many CPU slots. Raises GateError for a bad
    tree or selection."""
    ordered, notes = plan(root, options)
    for note in notes:
        report.note(note)
    gates = {gate.id: (phase, gate) for phase, gate in ordered}
    output = OrderedOutput(list(gates))
    selected_deps = {i: tuple(d for d in g.depends_on if d in gates) for i, (_, g) in gates.items()}
    weights = {i: job_count(root, g) for i, (_, g) in gates.items()}
    chains, paths = chain_lengths(selected_deps, weights), path_lengths(selected_deps, weights)
    results: dict[str, PhaseResult] = {}      # decided phases
    started: dict[str, tuple[PhaseResult, list[Job], list[int], float, str]] = {}  # result, jobs, --nproc
    # sizes left out, start time, a note when it runs although a dependency failed (--keep-going)
    queue: list[Job] = []
    run_results: dict[tuple[str, int], RunResult] = {}   # finished runs by (phase, index)
    running: dict[Future, tuple[Job, int]] = {}
    free = max(1, options.jobs)
    threads = 1 if options.jobs > 1 else None  # side by side, each process keeps to its own core

    def decide(res: PhaseResult) -> None:
        results[res.id] = res
        for line in report.phase_lines(res):
            output.say(res.id, line)
        output.finish(res.id)

    def finish_phase(pid: str) -> None:
        """Judge a started phase whose jobs have all finished (or that had none to run)."""
        res, jobs, left_out, began, although = started[pid]
        if jobs:
            res.runs = [run_results[pid, i] for i in sorted({j.index for j in jobs})]
            res.duration_s = round(time.monotonic() - began, 2)
            _judge_phase(res, gates[pid][1], options, left_out)
        res.reason = "; ".join(x for x in (res.reason, although) if x)
        decide(res)

    def start_ready_phases() -> None:
        for pid, (phase, gate) in gates.items():
            if pid in started or pid in results:
                continue
            if any(d in gates and d not in results for d in gate.depends_on):
                continue
            bad = [d for d in gate.depends_on if d in results and results[d].status in (FAIL, BLOCKED)]
            output.say(pid, report.phase_header(phase, gate))
            why = ", ".join(f"{d} {results[d].status}" for d in bad)
            if bad and not options.keep_going:
                decide(PhaseResult(gate.id, gate.title, gate.depends_on, BLOCKED, "dependency " + why))
                continue
            res, jobs, left_out = _phase_jobs(root, gate, options)
            started[pid] = (res, jobs, left_out, time.monotonic(), "ran although dependency " + why if bad else "")
            if jobs:
                queue.extend(jobs)
                queue.sort(key=lambda j: start_order(j, paths, chains, list(gates)))
            else:
                finish_phase(pid)

    with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        try:
            start_ready_phases()
            while queue or running:
                for job in list(queue):
                    if free < 1 or any(alone(j) for j, _ in running.values()):
                        break
                    if alone(job) and running:
                        break  # it waits for the running jobs to end; the jobs after it wait for it
                    want = min(job.nproc, options.jobs)   # a slot per rank; a file one
                    if want > free and job is not queue[0]:
                        continue
                    queue.remove(job)
                    want = min(want, free)  # the first waiting job starts on what is free
                    free -= want
                    jobs = started[job.phase][1]
                    if not any(j.started for j in jobs if j.index == job.index):  # the run's first job
                        files = sum(1 for j in jobs if j.index == job.index) if job.whole else 0
                        output.say(job.phase, report.run_start_line(job.whole or job.run, job.nproc, files))
                    job.started = time.monotonic()
                    future = pool.submit(_attempt, root, job.run, job.nproc, threads)
                    running[future] = (job, want)
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: list(gates).index(running[f][0].phase)):
                    job, want = running.pop(future)
                    free += want
                    job.result, job.finished = future.result(), time.monotonic()
                    jobs = started[job.phase][1]
                    same_run = [j for j in jobs if j.index == job.index]
                    if all(j.result is not None for j in same_run):
                        run_results[job.phase, job.index] = run_result(root, same_run)
                        output.say(job.phase, report.run_line(run_results[job.phase, job.index]))
                    if all(j.result is not None for j in jobs):
                        finish_phase(job.phase)
                start_ready_phases()
        except BaseException:
            kill_running()
            raise
    return [results[pid] for pid in gates]


def exit_code(results: list[PhaseResult]) -> int:
    """0 if every phase passed or was skipped, else 1."""
    return 0 if all(r.status in (PASS, SKIP) for r in results) else 1
