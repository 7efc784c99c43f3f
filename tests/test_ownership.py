"""Every engine symbol has exactly one owning phase, and uses only what its phase stands on.

The first test holds the repository to it; its message is the list of what to change. The
others check the rules on toy trees, one problem at a time."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gate_trees import gate, write_phase
from gates import ownership
from gates.exercise import contract_title

ROOT = Path(__file__).resolve().parents[1]


def test_every_engine_symbol_has_one_owner_and_the_layering_holds():
    problems = ownership.check(ROOT)
    assert not problems, "\n".join(["engine ownership (unlocks: in phases/NN_*/gate.yaml) is broken:", *problems])


def test_every_phase_has_a_contract_section():
    missing = [g for g in ownership.all_gates(ROOT) if contract_title(ROOT, g) is None]
    assert not missing, f"blueprint/contracts.md has no <a id=\"phase-NN\"></a> anchor for phase(s) {missing}"


def tree(tmp_path: Path, unlocks: dict[str, list[str]], files: dict[str, str],
         depends: dict[str, list[str]] | None = None) -> Path:
    """A toy repository: phases with these ``unlocks`` (and dependencies), engine modules ``files``."""
    for pid, entries in unlocks.items():
        write_phase(tmp_path, pid, gate(pid, (depends or {}).get(pid, ())) | {"unlocks": entries})
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    return tmp_path


def problems(root: Path) -> list[str]:
    return ownership.check(root)


MODULE = """\
    from __future__ import annotations

    LIMIT = 3


    class A:
        def f(self):
            return LIMIT

        def g(self):
            return 2


    def helper():
        return A()
    """


def test_the_most_specific_entry_owns(tmp_path):
    root = tree(tmp_path, {"01": ["engine/m.py::A"], "02": ["engine"], "03": ["engine/m.py", "engine/m.py::A.g"]},
                {"engine/m.py": MODULE, "engine/sub/n.py": "X = 1\n", "engine/__init__.py": ""},
                depends={"03": ["01"], "01": ["02"]})
    own = ownership.load(root, ownership.all_gates(root))
    assert own.problems == []
    assert own.owner_of("engine/m.py") == "03" and own.owner_of("engine/m.py", "helper") == "03"
    assert own.owner_of("engine/m.py", "A") == own.owner_of("engine/m.py", "A.f") == "01"
    assert own.owner_of("engine/m.py", "A.g") == "03"
    assert own.owner_of("engine/sub/n.py") == "02"  # the directory entry
    assert own.functions_of({"01"}) == {"engine/m.py": ["A.f"]}


@pytest.mark.parametrize("unlocks, expected", [
    ({"01": ["engine/a.py"]}, "engine/b.py: its module-level code and its top-level B, helper owned by no phase; "
                              "add `engine/b.py` to unlocks: in the gate.yaml of the phase whose tests cover it"),
    ({"01": ["engine/a.py", "engine/b.py::B"]},
     "engine/b.py: its module-level code and its top-level helper owned by no phase"),
    ({"01": ["engine/a.py", "engine/b.py"], "02": ["engine/b.py"]},
     "engine/b.py is owned twice, by phases/01_p/gate.yaml: unlocks[1] engine/b.py and by "
     "phases/02_p/gate.yaml: unlocks[0] engine/b.py: keep one of these entries"),
    ({"01": ["engine"], "02": ["engine/b.py::B"], "03": ["engine/b.py::B"]}, "engine/b.py::B is owned twice"),
    ({"01": ["engine", "engine/c.py"]}, "phases/01_p/gate.yaml: unlocks[1] engine/c.py: names nothing: no such"),
    ({"01": ["engine", "engine/b.py::C"]}, "engine/b.py::C: names nothing: engine/b.py defines no class or function"),
    ({"01": ["engine", "engine/b.py::B.nope"]}, "names nothing: engine/b.py defines no class or function B.nope"),
    ({"01": ["engine", "scripts/x.py"]}, "unlocks[1] scripts/x.py: names nothing under engine/"),
    ({"01": ["engine", "engine/b.py"]}, "unlocks[1] engine/b.py: redundant, phase 01 owns it already through"),
    ({"01": ["engine", "engine/b.py::B"]}, "unlocks[1] engine/b.py::B: redundant, phase 01 owns it already"),
])
def test_ownership_problems_say_what_to_edit(tmp_path, unlocks, expected):
    files = {"engine/a.py": "A = 1\n", "engine/b.py": "class B:\n    def f(self):\n        pass\n\n\n"
                                                      "def helper():\n    pass\n"}
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "x.py").write_text("")
    found = problems(tree(tmp_path, unlocks, files))
    assert any(expected in p for p in found), "\n".join(found)


LOW = """\
    def base():
        return 1
    """


@pytest.mark.parametrize("user, expected", [
    # a module-level import used by a function of the lower phase
    ("from engine.high import top\n\n\ndef base():\n    return top()\n",
     "engine/low.py::base (phase 01) uses engine/high.py::top (phase 02), but phase 01 does not depend on 02"),
    # an import inside the function
    ("def base():\n    from engine.high import top\n    return top()\n", "engine/low.py::base (phase 01) uses "
                                                                          "engine/high.py::top (phase 02)"),
    # module.attribute of an imported module
    ("from engine import high\n\n\ndef base():\n    return high.top()\n", "uses engine/high.py::top (phase 02)"),
    # a re-export nobody in the module reads is the module's own reference
    ("from engine.high import top  # noqa: F401\n", "engine/low.py (module-level code) (phase 01) uses "
                                                    "engine/high.py::top (phase 02)"),
])
def test_a_lower_phase_using_a_higher_one_breaks_the_layering(tmp_path, user, expected):
    root = tree(tmp_path, {"01": ["engine/low.py"], "02": ["engine/high.py"]},
                {"engine/low.py": user, "engine/high.py": "from engine.low import base\n\n\ndef top():\n"
                                                          "    return base()\n"}, depends={"02": ["01"]})
    found = problems(root)
    assert any(expected in p for p in found), "\n".join(found)
    assert all("engine/high.py::top (phase 02) uses" not in p for p in found)  # 02 may use 01


def test_an_import_read_only_in_annotations_is_no_reference(tmp_path):
    root = tree(tmp_path, {"01": ["engine/low.py"], "02": ["engine/high.py"]},
                {"engine/low.py": "from __future__ import annotations\n\nfrom engine.high import Top\n\n\n"
                                  "def base(x: Top) -> Top:\n    return x\n",
                 "engine/high.py": "class Top:\n    pass\n"}, depends={"02": ["01"]})
    assert problems(root) == []


def test_a_shared_module_is_checked_symbol_by_symbol(tmp_path):
    """One module, two owners: the class of phase 01 may not call the phase-02 function beside it;
    annotations and the module's constants are no references."""
    shared = """\
        from __future__ import annotations

        LIMIT = 3


        def later() -> int:
            return 2


        def early(x: later) -> int:
            return LIMIT


        def wrong():
            return later()
        """
    root = tree(tmp_path, {"01": ["engine/s.py::early", "engine/s.py::wrong"], "02": ["engine/s.py"]},
                {"engine/s.py": shared}, depends={"02": ["01"]})
    assert problems(root) == [
        "engine/s.py::wrong (phase 01) uses engine/s.py::later (phase 02), but phase 01 does not depend on 02: "
        "move the code, let another phase own one of them (unlocks: in phases/01_p/gate.yaml or "
        "phases/02_p/gate.yaml), or add the dependency"]


def test_the_engine_importing_the_gate_runner_breaks_the_layering(tmp_path):
    root = tree(tmp_path, {"01": ["engine"]}, {"engine/m.py": "from gates.diff import diff  # noqa: F401\n"})
    assert problems(root) == ["engine/m.py: imports gates.diff; the engine must not import the gate runner"]


def test_a_transitive_dependency_is_enough(tmp_path):
    root = tree(tmp_path, {"01": ["engine/a.py"], "02": ["engine/b.py"], "03": ["engine/c.py"]},
                {"engine/a.py": "def a():\n    pass\n", "engine/b.py": "def b():\n    pass\n",
                 "engine/c.py": "from engine.a import a\n\n\ndef c():\n    return a()\n"},
                depends={"02": ["01"], "03": ["02"]})
    assert problems(root) == []


def misplaced_faults(root: Path) -> list[str]:
    """A mutation of the audit catalogue plants its fault in code its own phase owns: a fault in an
    earlier phase's code that only a later phase catches is a contract its owner does not test.
    The one way past it is the owner's gate naming the symbol under ``contracts_tested_later:``
    with the mutation's phase and why (the contract belongs to the later phase's use of it)."""
    from gates import audit

    gates = ownership.all_gates(root)
    own = ownership.load(root, gates)
    later = {(e.symbol, e.phase) for g in gates.values() for e in g.contracts_tested_later}
    wrong = []
    for m in audit.load_catalogue(root / "gates" / "mutations"):
        for patch in m.patches:
            path, qualname = patch.symbol.partition("::")[::2]
            owner = own.owner_of(path, qualname)
            if owner != m.phase and (patch.symbol, m.phase) not in later:
                wrong.append(f"{m.id} (phase {m.phase}) patches {patch.symbol}, owned by phase {owner}: test the "
                             f"contract in {owner} and move the mutation there, or name it under "
                             f"contracts_tested_later: in {owner}'s gate")
    return wrong


def test_every_contract_tested_later_names_a_symbol_its_phase_owns():
    gates = ownership.all_gates(ROOT)
    own = ownership.load(ROOT, gates)
    wrong = [f"{g.id}: {e.symbol} (owned by {own.owner_of(*e.symbol.partition('::')[::2])})"
             for g in gates.values() for e in g.contracts_tested_later
             if own.owner_of(*e.symbol.partition("::")[::2]) != g.id]
    assert not wrong, "\n".join(wrong)


def test_every_planted_fault_lies_in_code_its_phase_owns():
    wrong = misplaced_faults(ROOT)
    assert not wrong, "\n".join(wrong)


