"""The gates survive a refactor no one edits them for: on a copy of the repository after
``ruff format engine`` and a module moved with ``scripts/move_module.py`` (its references
rewritten, the gates' and mutations' included), ownership and layering hold, every mutation of
the catalogue still plants, and two phases (05, which owns the moved module, and 06) pass their
gates and catch each of their mutations with its failure-mode hint."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
import subprocess
import sys
from pathlib import Path

from gates import audit, ownership
from gates.cli import main

ROOT = Path(__file__).resolve().parents[1]
OLD, NEW = "engine/model/attention_context.py", "engine/model/layers/attention_context.py"
PHASES = "05,06"


def _move_module():
    spec = importlib.util.spec_from_file_location("move_module", ROOT / "scripts" / "move_module.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_formatted_tree_with_a_module_moved_passes_and_catches_every_mutation(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=audit.COPY_IGNORE, symlinks=True)
    before = (tree / OLD).read_text()
    subprocess.run([str(Path(sys.executable).parent / "ruff"), "format", "--quiet", "engine"], cwd=tree, check=True)
    assert (tree / OLD).read_text() != before, "ruff format left the module to move as it was: pick another"
    changed = _move_module().move(tree, OLD, NEW)
    assert {"gates/mutations/05.yaml", "phases/05_attention_kv_cache/gate.yaml"} <= set(changed)
    assert ownership.check(tree) == []

    stale = []
    for m in audit.load_catalogue(tree / "gates" / "mutations"):
        scratch = tmp_path / "plant" / m.id
        for f in {p.file for p in m.patches}:
            (scratch / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tree / f, scratch / f)
        problem = audit.apply(scratch, m)
        if problem:
            stale.append(f"{m.id}: {problem}")
    assert not stale, "\n".join(stale)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ran = main(["--root", str(tree), "run", "--only", PHASES, "--report", str(tmp_path / "gate.json")])
        audited = main(["--root", str(tree), "audit", "--phase", PHASES, "--jobs", "2",
                        "--report", str(tmp_path / "audit.json")])
    assert (ran, audited) == (0, 0), out.getvalue()[-4000:]
