"""Builders for temporary phase trees that the runner's tests point ``--root`` at, and what is
left running in one."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import yaml

PYTEST_INI = """\
[pytest]
markers =
    torchrun: runs in every rank under torchrun
    cuda: needs a CUDA GPU
"""


def gate(pid: str, depends_on=(), runs=None, eager_gate=(), failure_modes=()) -> dict:
    """A valid gate.yaml mapping for phase ``pid`` (one single run over its directory by default)."""
    return {
        "id": pid,
        "title": f"phase {pid}",
        "depends_on": list(depends_on),
        "unlocks": [],
        "runs": runs if runs is not None else [{"mode": "single", "tests": [f"phases/{pid}_p"]}],
        "eager_gate": list(eager_gate),
        "done_criteria": ["its tests pass"],
        "failure_modes": list(failure_modes),
    }


def write_phase(root: Path, pid: str, gate_data: dict | None, files: dict[str, str] | None = None) -> Path:
    """Create ``root/phases/{pid}_p`` with its gate.yaml (None: none) and test files."""
    d = root / "phases" / f"{pid}_p"
    d.mkdir(parents=True, exist_ok=True)
    if gate_data is not None:
        (d / "gate.yaml").write_text(yaml.safe_dump(gate_data, sort_keys=False))
    for name, body in (files or {}).items():
        (d / name).write_text(textwrap.dedent(body))
    (root / "pytest.ini").write_text(PYTEST_INI)
    return d


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that does not reap (PID 1 in some containers)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def running_in(root: Path) -> list[int]:
    """Live processes (Linux /proc) whose working directory is ``root`` or below it: what a gate
    run there (its pytest, torchrun and ranks, started with ``cwd=root``) left behind."""
    root, found = root.resolve(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if (cwd == root or root in cwd.parents) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found
