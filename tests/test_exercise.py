"""``gates exercise`` and ``gates next`` on a toy repository (three phases, three modules), and
the skeleton rewrite on its own: what a skeleton keeps, what it raises, and that a module
registering things at import still imports."""
from __future__ import annotations

import ast
import contextlib
import io
import json
import shutil
import textwrap
import uuid
from pathlib import Path

import pytest

from gate_trees import gate, write_phase
from gates.cli import main
from gates.exercise import exercise
from gates.schema import GateError
from gates.skeleton import import_time, imported_calls, raising, skeletonize

SOURCE = '''\
"""A module — with a non-ASCII docstring (ast columns count bytes: ²)."""
from __future__ import annotations

from dataclasses import dataclass, field

LIMIT = 3  # a module constant


def _tags(default):
    """Called in a class body: runs at import, so a skeleton keeps it (and what it calls)."""
    return field(default_factory=_copy(default))


def _copy(items):
    return lambda: list(items)


def _registered(cls):
    return cls


@_registered
@dataclass(frozen=True)
class Box:
    """A frozen dataclass."""

    size: int
    tags: list = _tags([])
    unit = "cm"

    @property
    def area(self) -> int:
        """size² — a property."""
        return self.size * self.size  # the last statement's comment

    @staticmethod
    def scale(x: int = LIMIT) -> int: return x * 2

    def only_a_docstring(self):
        """Nothing but this."""

    class Inner:
        def deep(self):
            def nested():
                return 1
            return nested()


def kept(a, b):
    return a + b


async def later(x):
    """Awaited."""
    return x


if __name__ == "__main__":
    kept(1, 2)  # a script's call: not made at import
'''
REPLACED = ["Box.area", "Box.scale", "Box.only_a_docstring", "Box.Inner.deep", "later"]
AT_IMPORT = {"_tags", "_copy", "_registered"}


def message(q: str) -> str:
    return f"phase 05: m.py::{q} — see blueprint/contracts.md#phase-05"


def _structure(tree: ast.AST) -> str:
    """The module with every function body emptied: what a skeleton must keep."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in {"kept", "nested",
                                                                                         *AT_IMPORT}:
            node.body = node.body[:1] if ast.get_docstring(node) is not None else []
    return ast.dump(tree)


HELPERS = """
def capped(limit):
    return _check(limit)


def _check(limit):
    return limit


def unused_at_import():
    return 1
"""
MODELS = """
from engine.helpers import capped, unused_at_import as renamed


class Request:
    tools: capped("tools") = None

    def later(self):
        return renamed()
"""


def test_a_function_another_module_calls_while_it_is_imported_keeps_its_body():
    """A helper another module calls at import time (a pydantic model's field built by a function of
    another module) keeps its body, and so does what it calls; one called only from a function body
    does not."""
    trees = {"engine/helpers.py": ast.parse(HELPERS), "engine/models.py": ast.parse(MODELS)}
    elsewhere = imported_calls(trees)
    assert elsewhere == {"engine/helpers.py": {"capped"}}
    assert import_time(trees["engine/helpers.py"], elsewhere["engine/helpers.py"]) == {"capped", "_check"}
    assert import_time(trees["engine/helpers.py"]) == set()


def test_a_skeleton_keeps_everything_but_the_bodies_and_raises_with_phase_symbol_and_anchor():
    assert import_time(ast.parse(SOURCE)) == AT_IMPORT
    out = skeletonize(SOURCE, {q: message(q) for q in REPLACED})
    assert _structure(ast.parse(out)) == _structure(ast.parse(SOURCE))
    assert "LIMIT = 3  # a module constant" in out and "def kept(a, b):\n    return a + b" in out
    assert "the last statement's comment" not in out
    def_line = {line.split("def ")[1].split("(")[0]: i for i, line in enumerate(out.splitlines(), 1) if "def " in line}
    assert raising(out) == {q: (def_line[q.split(".")[-1]], message(q)) for q in REPLACED}
    ns: dict = {}
    exec(compile(out, "m.py", "exec"), ns)
    box = ns["Box"](2)
    assert (box.size, box.tags, ns["Box"].unit, ns["LIMIT"], ns["kept"](1, 2)) == (2, [], "cm", 3, 3)
    assert ns["Box"].area.__doc__ == "size² — a property."
    for call in (lambda: box.area, lambda: ns["Box"].scale(), box.only_a_docstring, ns["Box"].Inner().deep):
        with pytest.raises(NotImplementedError, match="^phase 05: m.py::Box"):
            call()
    with pytest.raises(NotImplementedError, match="later"):
        ns["later"](1).send(None)


def test_a_module_registering_a_custom_op_still_imports():
    """torch.library reads the skeleton's signature at import; the op and its fake exist and raise."""
    import torch

    op = f"gates_exercise_test_{uuid.uuid4().hex[:8]}::double"
    source = textwrap.dedent(f'''\
        import torch


        @torch.library.custom_op("{op}", mutates_args=())
        def double(x: torch.Tensor) -> torch.Tensor:
            """2 * x, a new tensor."""
            return x * 2


        @double.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)
        ''')
    ns: dict = {}
    exec(compile(skeletonize(source, {"double": message("double"), "_": message("_")}), "op.py", "exec"), ns)
    with pytest.raises(NotImplementedError, match="double"):
        ns["double"](torch.ones(2))


def test_an_unknown_function_is_an_error():
    with pytest.raises(KeyError, match="Box.volume"):
        skeletonize(SOURCE, {"Box.volume": "x"})


def toy(root: Path) -> Path:
    """Phases 01 <- 02 and an independent 03, each owning one engine module and testing it."""
    files = {"engine/__init__.py": "", "engine/a.py": 'def add(x, y):\n    """x + y."""\n    return x + y\n',
             "engine/b.py": "from engine.a import add\n\n\ndef twice(x):\n    return add(x, x)\n",
             "engine/c.py": "def neg(x):\n    return -x\n",
             "blueprint/contracts.md": "".join(f'<a id="phase-0{i}"></a>\n## Phase 0{i} — toy\n\n' for i in (1, 2, 3))}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    fm = {"id": "FM-900", "symptom": "sums are wrong", "check": "is add x + y?", "fix": "return x + y",
          "tests": ["test_add"]}
    write_phase(root, "01", gate("01", failure_modes=[fm]) | {"unlocks": ["engine/a.py"]},
                {"test_a.py": "from engine.a import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"})
    write_phase(root, "02", gate("02", ["01"]) | {"unlocks": ["engine/b.py"]},
                {"test_b.py": "from engine.b import twice\n\n\ndef test_twice():\n    assert twice(2) == 4\n"})
    write_phase(root, "03", gate("03") | {"unlocks": ["engine/c.py"]},
                {"test_c.py": "from engine.c import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n"})
    return root


def gates(root: Path, *argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["--root", str(root), *argv])
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def handed_out(tmp_path_factory):
    """(original, copy with phase 01 handed out, its gate report, `gates next --json`)."""
    base = tmp_path_factory.mktemp("exercise")
    root, out = toy(base / "repo"), base / "copy"
    code, text = gates(root, "exercise", "--only", "01", "--out", str(out))
    assert code == 0, text
    report = out / "gate-report.json"
    assert gates(out, "run", "--report", str(report))[0] == 1
    code, advice = gates(out, "next", "--report", str(report), "--json")
    assert code == 1
    return root, out, json.loads(report.read_text()), json.loads(advice)


def test_the_handed_out_phase_fails_its_dependants_are_blocked_and_the_rest_passes(handed_out):
    root, out, report, _ = handed_out
    status = {p["id"]: p["status"] for p in report["phases"]}
    assert status == {"01": "FAIL", "02": "BLOCKED", "03": "PASS"}
    (failing,) = report["phases"][0]["runs"][0]["failing"]
    assert "NotImplementedError: phase 01: engine/a.py::add — see blueprint/contracts.md#phase-01" in failing["message"]
    assert report["phases"][0]["failure_modes"] == ["FM-900"]
    assert (out / "engine/b.py").read_text() == (root / "engine/b.py").read_text()
    assert (out / "phases").is_dir() and (out / "blueprint/contracts.md").is_file()


def test_next_names_the_phase_its_test_failure_mode_skeleton_and_contract(handed_out):
    _, _, _, advice = handed_out
    assert advice["status"] == "work" and advice["phase"] == "01" and advice["phase_status"] == "FAIL"
    (test,) = advice["failing_tests"]
    assert test["nodeid"] == "phases/01_p/test_a.py::test_add" and test["failure_modes"] == ["FM-900"]
    assert "phase 01: engine/a.py::add" in test["error"]
    assert advice["failure_modes"] == [{"id": "FM-900", "symptom": "sums are wrong", "check": "is add x + y?",
                                        "fix": "return x + y"}]
    assert advice["unimplemented"] == [{"symbol": "engine/a.py::add", "line": 1}]
    assert advice["contract"] == {"anchor": "blueprint/contracts.md#phase-01", "title": "Phase 01 — toy"}


def test_next_lists_what_to_build_leaves_first(tmp_path):
    """A phase handing out two modules, the first by name importing the second: ``gates next``
    lists the imported module's functions first, each module's by line."""
    root, out = tmp_path / "repo", tmp_path / "copy"
    files = {"engine/__init__.py": "",
             "engine/a.py": "from engine.b import inc\n\n\ndef twice_inc(x):\n    return inc(inc(x))\n",
             "engine/b.py": "def inc(x):\n    return x + 1\n\n\ndef dec(x):\n    return x - 1\n",
             "blueprint/contracts.md": '<a id="phase-01"></a>\n## Phase 01 — toy\n\n'}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    write_phase(root, "01", gate("01") | {"unlocks": ["engine/a.py", "engine/b.py"]},
                {"test_a.py": "from engine.a import twice_inc\n\n\ndef test_a():\n    assert twice_inc(1) == 3\n"})
    assert gates(root, "exercise", "--only", "01", "--out", str(out))[0] == 0
    report = out / "gate-report.json"
    gates(out, "run", "--report", str(report))
    code, advice = gates(out, "next", "--report", str(report), "--json")
    assert [u["symbol"] for u in json.loads(advice)["unimplemented"]] == [
        "engine/b.py::inc", "engine/b.py::dec", "engine/a.py::twice_inc"]

def test_next_as_text_for_a_person(handed_out):
    _, out, _, _ = handed_out
    code, text = gates(out, "next", "--report", str(out / "gate-report.json"))
    assert code == 1
    for line in ["next: phase 01 — phase 01 (FAIL: single: 1 failing test(s))",
                 "  phases/01_p/test_a.py::test_add [single]  -> FM-900",
                 "failure mode FM-900:", "  engine/a.py::add  (line 1)",
                 "read: blueprint/contracts.md#phase-01 (Phase 01 — toy)", "then: python -m gates run --upto 01"]:
        assert line in text, text


def test_the_reference_code_put_back_passes_and_next_says_done(handed_out, tmp_path):
    root, out, _, _ = handed_out
    restored = tmp_path / "restored"
    shutil.copytree(out, restored)
    shutil.copy(root / "engine/a.py", restored / "engine/a.py")
    report = restored / "gate-report.json"
    assert gates(restored, "run", "--report", str(report))[0] == 0
    code, text = gates(restored, "next", "--report", str(report))
    assert (code, text.strip()) == (0, "every phase passed: nothing left to do")
    gates(restored, "run", "--only", "01", "--report", str(report))
    code, text = gates(restored, "next", "--report", str(report), "--json")
    assert code == 1 and json.loads(text) == {"status": "not-run", "phase": "02", "not_run": ["02", "03"],
                                              "skipped": {}, "command": "python -m gates run --from 02"}
    gates(restored, "run", "--only", "03", "--report", str(report))
    code, text = gates(restored, "next", "--report", str(report))
    assert (code, text.strip()) == (1, "every phase in the report passed; not run yet: 01, 02\n"
                                       "next: python -m gates run")


def test_exercise_from_hands_out_every_later_phase(tmp_path):
    root = toy(tmp_path / "repo")
    exercise(root, tmp_path / "copy", {"02", "03"})
    assert list(raising((tmp_path / "copy/engine/b.py").read_text())) == ["twice"]
    assert list(raising((tmp_path / "copy/engine/c.py").read_text())) == ["neg"]
    assert raising((tmp_path / "copy/engine/a.py").read_text()) == {}
    code, text = gates(root, "exercise", "--from", "02", "--out", str(tmp_path / "copy2"))
    assert code == 0 and "phase(s) 02, 03 handed out" in text


def test_exercise_refuses_a_bad_target_or_broken_ownership(tmp_path):
    root = toy(tmp_path / "repo")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(GateError, match="exists and is not empty"):
        exercise(root, tmp_path / "full", {"01"})
    with pytest.raises(GateError, match="outside the repository"):
        exercise(root, root / "build" / "x", {"01"})
    (root / "engine/d.py").write_text("def orphan():\n    pass\n")
    with pytest.raises(GateError, match="engine/d.py: its module-level code and its top-level orphan owned by no"):
        exercise(root, tmp_path / "copy", {"01"})
