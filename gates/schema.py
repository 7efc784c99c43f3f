"""gate.yaml: the schema, its strict validation, and the typed gate it yields.

Every problem is a ``GateError`` naming the file and the field, e.g.
``phases/05_x/gate.yaml: runs[1].nproc: required when mode is torchrun``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

MODES = ("single", "torchrun")
REQUIREMENTS = ("cuda",)
DEFAULT_TIMEOUT_S = 900
PHASE_ID = re.compile(r"^\d\d$")
UNLOCK = re.compile(r"^(?P<path>[\w.-]+(?:/[\w.-]+)*)(?:::(?P<qualname>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?$")


class GateError(ValueError):
    """A gate file (or the phase tree) is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Run:
    """One pytest run: ``single`` once (a pytest session per test file), ``torchrun`` once per entry of
    ``nproc``. ``timeout_s`` bounds a torchrun run's ranks, and each test file's session of a
    single run. ``alone``: where it runs (its requirements met), nothing else of the gate run runs
    beside it: it starts once every running job has ended (jobs ahead of it in the queue may still
    start first), and no job starts while it runs (a benchmark whose figures another process on
    the GPU or the cores would change)."""
    mode: str
    tests: tuple[str, ...]
    nproc: tuple[int, ...] = ()
    requires: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    alone: bool = False


@dataclass(frozen=True)
class Rule:
    rule: str
    test: str


@dataclass(frozen=True)
class FailureMode:
    id: str
    symptom: str
    check: str
    fix: str
    tests: tuple[str, ...]

    def matches(self, nodeid: str) -> bool:
        """True if any of this mode's test substrings occurs in ``nodeid``."""
        return any(t in nodeid for t in self.tests)


@dataclass(frozen=True)
class LaterContract:
    """A function of this phase whose contract a later phase's tests hold (``gates contracts``
    counts a mutant of it that only ``phase`` catches as this exception, not as untested)."""
    symbol: str      # path::QualifiedName, or a module's path for its own code
    phase: str
    why: str


@dataclass(frozen=True)
class Gate:
    id: str
    title: str
    depends_on: tuple[str, ...]
    unlocks: tuple[str, ...]
    runs: tuple[Run, ...]
    eager_gate: tuple[Rule, ...]
    done_criteria: tuple[str, ...]
    failure_modes: tuple[FailureMode, ...]
    notes: tuple[str, ...] = ()
    contracts_tested_later: tuple[LaterContract, ...] = ()


def parse_unlock(text: str) -> tuple[str, str]:
    """An ``unlocks:`` entry, ``path`` or ``path::QualifiedName``, -> (path, qualname or "");
    ValueError for anything else (an absolute path, ``..``, prose)."""
    m = UNLOCK.match(text)
    if not m or ".." in m["path"].split("/"):
        raise ValueError(f"must be a path relative to the repository root or path::QualifiedName, like "
                         f"engine/model/models/dense.py::DenseDecoderLayer (prose goes to notes:); got {text!r}")
    return m["path"], m["qualname"] or ""


class _Checker:
    """Type checks that raise GateError with ``file: field: problem``."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str):
        raise GateError(f"{self.where}: {field}: {problem}")

    def mapping(self, value, field: str, required: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a mapping, got {type(value).__name__}")
        for key in value:
            if key not in required and key not in optional:
                allowed = ", ".join(sorted(required | set(optional)))
                self.fail(f"{field}.{key}" if field else str(key), f"unknown key (allowed: {allowed})")
        for key in sorted(required):
            if key not in value:
                self.fail(f"{field}.{key}" if field else key, "missing")
        return value

    def string(self, value, field: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(field, f"must be a non-empty string, got {value!r}")
        return value

    def strings(self, value, field: str, non_empty: bool = False) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(field, f"must be a list, got {type(value).__name__}")
        if non_empty and not value:
            self.fail(field, "must not be empty")
        return tuple(self.string(v, f"{field}[{i}]") for i, v in enumerate(value))

    def items(self, value, field: str, non_empty: bool = False) -> list:
        if not isinstance(value, list):
            self.fail(field, f"must be a list, got {type(value).__name__}")
        if non_empty and not value:
            self.fail(field, "must not be empty")
        return value

    def phase_id(self, value, field: str) -> str:
        if not isinstance(value, str) or not PHASE_ID.match(value):
            self.fail(field, f'must be a two-digit string in quotes, like "05"; got {value!r}')
        return value


def _run(c: _Checker, value, field: str) -> Run:
    c.mapping(value, field, {"mode", "tests"}, {"nproc", "requires", "timeout_s", "alone"})
    mode = value["mode"]
    if mode not in MODES:
        c.fail(f"{field}.mode", f"must be one of {', '.join(MODES)}; got {mode!r}")
    tests = c.strings(value["tests"], f"{field}.tests", non_empty=True)
    for i, t in enumerate(tests):
        if Path(t.split("::")[0]).is_absolute() or ".." in Path(t.split("::")[0]).parts:
            c.fail(f"{field}.tests[{i}]", f"must be a path relative to the repository root; got {t!r}")
    nproc: tuple[int, ...] = ()
    if mode == "torchrun":
        if "nproc" not in value:
            c.fail(f"{field}.nproc", "required when mode is torchrun (a list such as [2, 4])")
        raw = c.items(value["nproc"], f"{field}.nproc", non_empty=True)
        for i, n in enumerate(raw):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                c.fail(f"{field}.nproc[{i}]", f"must be a positive integer, got {n!r}")
        nproc = tuple(raw)
    elif "nproc" in value:
        c.fail(f"{field}.nproc", "only allowed when mode is torchrun")
    requires = c.strings(value.get("requires", []), f"{field}.requires")
    for i, r in enumerate(requires):
        if r not in REQUIREMENTS:
            c.fail(f"{field}.requires[{i}]", f"unknown requirement {r!r} (known: {', '.join(REQUIREMENTS)})")
    timeout = value.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        c.fail(f"{field}.timeout_s", f"must be a positive number of seconds, got {timeout!r}")
    alone = value.get("alone", False)
    if not isinstance(alone, bool):
        c.fail(f"{field}.alone", f"must be true or false, got {alone!r}")
    return Run(mode, tests, nproc, requires, float(timeout), alone)


def _rule(c: _Checker, value, field: str) -> Rule:
    c.mapping(value, field, {"rule", "test"})
    test = c.string(value["test"], f"{field}.test")
    path, _, name = test.partition("::")
    if not path.endswith(".py") or not name:
        c.fail(f"{field}.test", f"must be a pytest node id 'path/test_x.py::test_name'; got {test!r}")
    return Rule(c.string(value["rule"], f"{field}.rule"), test)


def _failure_mode(c: _Checker, value, field: str) -> FailureMode:
    c.mapping(value, field, {"id", "symptom", "check", "fix", "tests"})
    return FailureMode(
        id=c.string(value["id"], f"{field}.id"),
        symptom=c.string(value["symptom"], f"{field}.symptom"),
        check=c.string(value["check"], f"{field}.check"),
        fix=c.string(value["fix"], f"{field}.fix"),
        tests=c.strings(value["tests"], f"{field}.tests", non_empty=True),
    )


def _tested_later(c: _Checker, value, field: str, gate_id: str) -> LaterContract:
    c.mapping(value, field, {"symbol", "phase", "why"})
    symbol = c.string(value["symbol"], f"{field}.symbol")
    try:
        parse_unlock(symbol)
    except ValueError as e:
        c.fail(f"{field}.symbol", str(e))
    phase = c.phase_id(value["phase"], f"{field}.phase")
    if phase <= gate_id:
        c.fail(f"{field}.phase", f"must be a later phase than {gate_id}, got {phase!r}")
    return LaterContract(symbol, phase, c.string(value["why"], f"{field}.why"))


def parse_gate(data, where: str, expected_id: str) -> Gate:
    """Validate the parsed YAML ``data`` of the gate for phase ``expected_id``."""
    c = _Checker(where)
    c.mapping(data, "", {"id", "title", "depends_on", "unlocks", "runs", "eager_gate",
                         "done_criteria", "failure_modes"}, {"notes", "contracts_tested_later"})
    gate_id = c.phase_id(data["id"], "id")
    if gate_id != expected_id:
        c.fail("id", f"{gate_id!r} does not match the directory prefix {expected_id!r}")
    depends = tuple(c.phase_id(d, f"depends_on[{i}]")
                    for i, d in enumerate(c.items(data["depends_on"], "depends_on")))
    if gate_id in depends:
        c.fail("depends_on", "a phase cannot depend on itself")
    unlocks = c.strings(data["unlocks"], "unlocks")
    for i, entry in enumerate(unlocks):
        try:
            parse_unlock(entry)
        except ValueError as e:
            c.fail(f"unlocks[{i}]", str(e))
    return Gate(
        id=gate_id,
        title=c.string(data["title"], "title"),
        depends_on=depends,
        unlocks=unlocks,
        runs=tuple(_run(c, r, f"runs[{i}]")
                   for i, r in enumerate(c.items(data["runs"], "runs", non_empty=True))),
        eager_gate=tuple(_rule(c, r, f"eager_gate[{i}]")
                         for i, r in enumerate(c.items(data["eager_gate"], "eager_gate"))),
        done_criteria=c.strings(data["done_criteria"], "done_criteria", non_empty=True),
        failure_modes=tuple(_failure_mode(c, f, f"failure_modes[{i}]")
                            for i, f in enumerate(c.items(data["failure_modes"], "failure_modes"))),
        notes=c.strings(data.get("notes", []), "notes"),
        contracts_tested_later=tuple(_tested_later(c, e, f"contracts_tested_later[{i}]", gate_id) for i, e in
                                     enumerate(c.items(data.get("contracts_tested_later", []),
                                                       "contracts_tested_later"))),
    )


def load_gate(path: Path, expected_id: str, where: str | None = None) -> Gate:
    """Read and validate ``path``; ``where`` is the name used in errors (default: the path)."""
    where = where or str(path)
    if not path.is_file():
        raise GateError(f"{where}: missing (every phase directory needs a gate.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise GateError(f"{where}: not valid YAML: {e}") from None
    return parse_gate(data, where, expected_id)
