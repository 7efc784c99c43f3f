"""Builders for temporary phase trees that the runner's tests point ``--root`` at."""
from __future__ import annotations

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
