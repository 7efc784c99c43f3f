"""``python -m gates contracts`` on a toy tree: phase 01 owns engine/toy.py and tests only part of
its contract; phase 02 (depending on 01) tests the rest. The mutants 01's tests kill are
``owner``, those only 02's kill are ``later`` (owner-untested contracts) unless 01's gate names
the function under ``contracts_tested_later:``; a function no test calls is counted apart.
Also the generated operators and the symbol anchoring they and the audit's mutations use."""
from __future__ import annotations

import ast
import json

import pytest
import yaml

from gate_trees import gate, write_phase
from gates import anchor, contracts
from gates.cli import main
from gates.mutants import mutants

TOY = '''\
def add(a, b):
    """The sum."""
    return a + b


def scale(x, k=2):
    if k < 0:
        raise ValueError("k must not be negative")
    return x * k


def unused(values):
    return sorted(values)
'''
OWNER_TEST = "from engine.toy import add, scale\n\n\ndef test_add():\n    assert add(2, 3) == 5 and scale(3) == 6\n"
LATER_TEST = """\
import pytest

from engine.toy import scale


def test_negative_scale_is_refused():
    with pytest.raises(ValueError, match="^k must not be negative"):
        scale(3, -1)
"""


def toy_tree(root, exceptions=()):
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "toy.py").write_text(TOY)
    owner = dict(gate("01"), unlocks=["engine/toy.py"])
    if exceptions:
        owner["contracts_tested_later"] = list(exceptions)
    write_phase(root, "01", owner, {"test_owner.py": OWNER_TEST})
    write_phase(root, "02", gate("02", ["01"]), {"test_later.py": LATER_TEST})
    return root


def test_the_matrix_splits_owner_later_and_untested_contracts(tmp_path, capsys):
    root = toy_tree(tmp_path / "toy")
    report = tmp_path / "contracts.json"
    code = main(["--root", str(root), "contracts", "--phase", "01", "--budget", "100", "--jobs", "1",
                 "--report", str(report)])
    out = capsys.readouterr().out
    data = json.loads(report.read_text())["phases"][0]
    verdicts = {m["id"]: m for m in data["mutants"]}
    assert code == 1 and data["later"] >= 2
    raise_dropped = verdicts["engine/toy.py::scale#statement0"]
    assert (raise_dropped["verdict"], raise_dropped["killed_by"]) == ("later", "02")
    assert "test_negative_scale_is_refused" in raise_dropped["failing_test"]
    assert verdicts["engine/toy.py::scale#message0"]["verdict"] == "later"
    assert verdicts["engine/toy.py::add#return0"]["verdict"] == "owner"
    assert verdicts["engine/toy.py::scale#default0"]["verdict"] == "owner"
    assert verdicts["engine/toy.py::scale#compare0"]["verdict"] == "none"   # k == 0 is nobody's case
    assert data["unexercised"] == 2 and not any("unused" in i for i in verdicts)   # unused(): no test calls it
    assert "phase 01 does not test: engine/toy.py::scale#statement0" in out
    assert (root / "engine" / "toy.py").read_text() == TOY   # the tree is never touched


def test_a_named_exception_is_no_untested_contract(tmp_path):
    why = "the refusal is phase 02's contract"
    root = toy_tree(tmp_path / "toy", [{"symbol": "engine/toy.py::scale", "phase": "02", "why": why}])
    matrices = contracts.compute(root, ["01"], budget=100, seed=0, jobs=1, progress=lambda line: None)
    later = [v for v in matrices[0].verdicts if v.killed_by == "02"]
    assert later and all(v.verdict == "exception" and v.why == why for v in later)
    assert contracts.exit_code(matrices) == 0


def test_every_operator_changes_its_site_and_keeps_the_docstring():
    fn = ast.parse(TOY).body[1]
    found = {m.id: (m.before, m.after) for m in mutants("engine/toy.py::scale", fn)}
    assert found["engine/toy.py::scale#compare0"] == ("k < 0", "k <= 0")
    assert [found[f"engine/toy.py::scale#constant{i}"] for i in range(4)] == [("2", "3"), ("2", "1"), ("0", "1"),
                                                                             ("0", "-1")]   # walk order
    assert found["engine/toy.py::scale#statement0"][1] == "pass"
    assert found["engine/toy.py::scale#return0"] == ("return x * k", "return")
    assert found["engine/toy.py::scale#message0"][1] == "'must not be negative'"
    assert found["engine/toy.py::scale#default0"] == ("2", "3")
    add = mutants("engine/toy.py::add", ast.parse(TOY).body[0])
    assert all('"""The sum."""' in m.text or "'The sum.'" in m.text for m in add)
    unsort = mutants("engine/toy.py::unused", ast.parse(TOY).body[2])
    assert [m.after for m in unsort if m.operator == "unsort"] == ["list(values)"]


FORMATTED = '''\
import os


class Box:
    """A box."""

    @property
    def size(self):   # a comment
        """Its size:
        always positive."""
        return abs(
            self._size
        )
'''


def test_a_change_written_against_the_canonical_text_survives_formatting():
    """The same find/replace applies to two formattings of one method; only its lines change,
    its docstring keeps its text, and a symbol or text that is not there is an error naming it."""
    one_line = FORMATTED.replace("abs(\n            self._size\n        )", "abs(self._size)")
    for source in (FORMATTED, one_line):
        text = anchor.replace_in(source, "box.py::Box.size", "return abs(self._size)", "return self._size")
        assert text.startswith("import os\n\n\nclass Box:\n") and "return self._size\n" in text
        assert ast.get_docstring(anchor.locate(ast.parse(text), "Box.size")) == "Its size:\nalways positive."
    with pytest.raises(anchor.AnchorError, match="box.py::Box.volume: no such class or function"):
        anchor.replace_in(FORMATTED, "box.py::Box.volume", "x", "y")
    with pytest.raises(anchor.AnchorError, match=r"box.py::Box.size: the text to replace occurs 0 times"):
        anchor.replace_in(FORMATTED, "box.py::Box.size", "return -1", "return 1")


def test_gate_schema_checks_contracts_tested_later(tmp_path):
    from gates.schema import GateError, parse_gate

    data = dict(gate("03"), contracts_tested_later=[{"symbol": "engine/x.py::f", "phase": "02", "why": "w"}])
    with pytest.raises(GateError, match=r"contracts_tested_later\[0\].phase: must be a later phase than 03"):
        parse_gate(yaml.safe_load(yaml.safe_dump(data)), "g.yaml", "03")
