"""``python -m gates exercise``: hand phases out to be built again from their contracts.

``exercise(root, out, phases)`` copies the repository to ``out`` and replaces, in the copy,
the body of every function and method the given phases own (``gates.ownership``) by
``raise NotImplementedError("phase NN: path::qualname — see blueprint/contracts.md#phase-NN")``;
signatures, docstrings (the contracts), decorators, class attributes, module constants,
imports and the functions a module calls while it is imported stay, and so do the tests, the
gates, the blueprint and every other phase. In the
copy ``python -m gates run`` then passes the phases before, fails the handed-out ones with
their failure-mode hints, and blocks what depends on them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from gates import ownership
from gates.audit import COPY_IGNORE
from gates.schema import GateError
from gates.skeleton import import_time, imported_calls, skeletonize

CONTRACTS = "blueprint/contracts.md"


def anchor(phase: str) -> str:
    """Where the contract of ``phase`` is written: ``blueprint/contracts.md#phase-NN``."""
    return f"{CONTRACTS}#phase-{phase}"


def contract_title(root: Path, phase: str) -> str | None:
    """The heading under ``<a id="phase-NN"></a>`` in contracts.md (None: no such anchor)."""
    path = root / CONTRACTS
    lines = path.read_text().splitlines() if path.is_file() else []
    marker = f'<a id="phase-{phase}"></a>'
    for i, line in enumerate(lines):
        if line.strip() == marker:
            return next((h.lstrip("#").strip() for h in lines[i + 1:] if h.startswith("#")), None)
    return None


def select(ids: list[str], only: list[str] | None, start: str | None) -> set[str]:
    """``--only`` (those phases) or ``--from`` (that phase and every later one)."""
    unknown = sorted((set(only or []) | ({start} if start else set())) - set(ids))
    if unknown:
        raise GateError(f"unknown phase id(s) {', '.join(unknown)} (known: {', '.join(ids)})")
    return set(only) if only else {i for i in ids if int(i) >= int(start)}


def exercise(root: Path, out: Path, phases: set[str]) -> dict[str, list[str]]:
    """Write the copy at ``out`` (absent or empty, outside ``root``); returns module path ->
    the functions replaced there (not those a module runs while it is imported:
    ``skeleton.import_time``, ``skeleton.imported_calls``). Refuses (GateError) while ownership or
    layering has problems, since the copy would then fail phases the handed-out ones do not reach."""
    gates = ownership.all_gates(root)
    own = ownership.load(root, gates)
    problems = own.problems + ownership.layering(root, own, gates)
    problems += [f"{CONTRACTS}: no <a id=\"phase-{p}\"></a> anchor for phase {p}"
                 for p in sorted(phases) if contract_title(root, p) is None]
    if problems:
        raise GateError("fix these first (tests/test_ownership.py checks them):\n  " + "\n  ".join(problems))
    out = out.resolve()
    if out == root or root in out.parents:
        raise GateError(f"--out {out}: choose a directory outside the repository")
    if out.exists() and any(out.iterdir()):
        raise GateError(f"--out {out}: exists and is not empty")
    shutil.copytree(root, out, ignore=COPY_IGNORE, symlinks=True, dirs_exist_ok=True)
    if (root / ".venv").exists():
        (out / ".venv").symlink_to((root / ".venv").resolve())
    replaced = {}
    elsewhere = imported_calls({path: module.tree for path, module in own.modules.items()})
    for path, names in own.functions_of(phases).items():
        file = out / path
        kept = import_time(own.modules[path].tree, elsewhere.get(path, set()))
        messages = {q: f"phase {own.owner_of(path, q)}: {path}::{q} — see {anchor(own.owner_of(path, q))}"
                    for q in names if q not in kept}
        if messages:
            file.write_text(skeletonize(file.read_text(), messages))
            replaced[path] = list(messages)
    return replaced
