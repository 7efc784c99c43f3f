"""The phase tree: discovery of ``phases/NN_name`` directories, selection,
dependency order, and which declared test targets exist yet."""
from __future__ import annotations

import ast
import heapq
import re
from dataclasses import dataclass
from pathlib import Path

from gates.schema import Gate, GateError, load_gate

PHASE_DIR = re.compile(r"^(\d\d)_\w+$")


@dataclass(frozen=True)
class Phase:
    id: str
    path: Path   # the phase directory
    rel: str     # its path relative to the root, e.g. phases/05_attention_kv_cache

    @property
    def gate_path(self) -> Path:
        return self.path / "gate.yaml"

    def load_gate(self) -> Gate:
        return load_gate(self.gate_path, self.id, where=f"{self.rel}/gate.yaml")


def discover(root: Path) -> list[Phase]:
    """Every ``root/phases/NN_name`` directory, by id; two directories with one id is an error."""
    base = root / "phases"
    if not base.is_dir():
        raise GateError(f"{base}: no phases directory")
    phases: dict[str, Phase] = {}
    for d in sorted(p for p in base.iterdir() if p.is_dir()):
        m = PHASE_DIR.match(d.name)
        if not m:
            continue
        if m.group(1) in phases:
            raise GateError(f"phases/{d.name}: id {m.group(1)} is also used by {phases[m.group(1)].rel}")
        phases[m.group(1)] = Phase(m.group(1), d, f"phases/{d.name}")
    return list(phases.values())


def select(ids: list[str], upto: str | None = None, only: list[str] | None = None,
           start: str | None = None) -> list[str]:
    """Ids chosen by ``--only`` (exactly those), else ``--from`` (id >= start) and
    ``--upto`` (id <= upto). Unknown ids are an error (``--upto 99`` is a typo, not "all")."""
    for flag, value in (("--upto", upto), ("--from", start)):
        if value is not None and value not in ids:
            raise GateError(f"{flag}: unknown phase id {value} (known: {', '.join(ids)})")
    if only is not None:
        unknown = sorted(set(only) - set(ids))
        if unknown:
            raise GateError(f"--only: unknown phase id(s) {', '.join(unknown)} (known: {', '.join(ids)})")
        return [i for i in ids if i in only]
    return [i for i in ids
            if (upto is None or int(i) <= int(upto)) and (start is None or int(i) >= int(start))]


def topological_order(deps: dict[str, tuple[str, ...]]) -> list[str]:
    """Order the keys of ``deps`` (id -> dependency ids) so every dependency comes
    first; ties by id. Dependencies that are not keys are ignored. A cycle is a
    GateError naming it."""
    pending = {i: {d for d in ds if d in deps} for i, ds in deps.items()}
    ready = [i for i, ds in pending.items() if not ds]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j, ds in pending.items():
            if i in ds:
                ds.remove(i)
                if not ds:
                    heapq.heappush(ready, j)
    if len(order) < len(deps):
        raise GateError(f"dependency cycle (a -> b: a depends on b): {' -> '.join(_find_cycle(pending))}")
    return order


def _find_cycle(pending: dict[str, set[str]]) -> list[str]:
    """One cycle among the ids that still have unmet dependencies."""
    node = min(i for i, ds in pending.items() if ds)
    path: list[str] = []
    while node not in path:
        path.append(node)
        node = min(pending[node])
    return path[path.index(node):] + [node]


def has_tests(root: Path, target: str) -> bool:
    """True if the test target (path or node id, relative to ``root``) names an
    existing test file or a directory holding one."""
    path = root / target.split("::")[0]
    if path.is_file():
        return True
    return path.is_dir() and any(path.rglob("test_*.py"))


def test_targets(root: Path, tests: tuple[str, ...]) -> list[str]:
    """The pytest targets of a single run, one session each: every ``test_*.py`` under a directory
    (sorted), a file or node id as given."""
    targets = []
    for target in tests:
        path = root / target.split("::")[0]
        targets += [str(p.relative_to(root)) for p in sorted(path.rglob("test_*.py"))] if path.is_dir() else [target]
    return targets


def test_files(phase: Phase) -> list[Path]:
    """The test files in the phase directory."""
    return sorted(phase.path.rglob("test_*.py"))


def _module_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level names a test module defines or imports (imported tests are collected too)."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def defines_test(root: Path, nodeid: str) -> bool:
    """True if the node id ``path.py::name`` (or ``path.py::Class::name``) names a test
    the file defines (parameter brackets ignored). Read with ``ast``, without importing."""
    path, _, rest = nodeid.partition("::")
    file = root / path
    if not file.is_file():
        return False
    try:
        names = _module_names(ast.parse(file.read_text()))
    except SyntaxError:
        return False
    parts = [p.split("[")[0] for p in rest.split("::")] if rest else []
    if not parts:
        return True
    node = names.get(parts[0])
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return False
        node = next((n for n in node.body if getattr(n, "name", None) == part), None)
    return node is not None
