"""``python -m gates audit`` on a toy phase: one mutation its tests catch (with the right
failure-mode hint), one planted to escape, one whose patch no longer applies."""
from __future__ import annotations

import json

import pytest
import yaml

from gate_trees import gate, write_phase
from gates import audit
from gates.cli import main
from gates.schema import GateError

TOY = "def add(a, b):\n    return a + b\n\n\ndef unused():\n    return 1\n"
TEST_TOY = "from toy import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
CATALOGUE = [
    {"id": "M01-add-subtracts", "phase": "01", "failure_modes": ["FM-900"], "description": "add subtracts",
     "patches": [{"symbol": "toy.py::add", "find": "return a + b", "replace": "return a - b"}]},
    {"id": "M01-untested", "phase": "01", "failure_modes": ["FM-901"], "description": "nothing tests unused()",
     "patches": [{"symbol": "toy.py::unused", "find": "return 1", "replace": "return 2"}]},
    {"id": "M01-stale", "phase": "01", "failure_modes": ["FM-900"], "description": "the code moved on",
     "patches": [{"symbol": "toy.py::add", "find": "return a * b", "replace": "return a / b"}]},
]


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """(tree, exit code, stdout, JSON report) of one audit of the toy tree."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("toy")
    (root / "toy.py").write_text(TOY)
    fms = [{"id": "FM-900", "symptom": "sums are wrong", "check": "c", "fix": "f", "tests": ["test_add"]}]
    write_phase(root, "01", gate("01", failure_modes=fms), {"test_toy.py": TEST_TOY})
    later = [{"id": "FM-901", "symptom": "s", "check": "c", "fix": "f", "tests": ["test_unused"]}]
    write_phase(root, "02", gate("02", ["01"], failure_modes=later),
                {"test_later.py": "from toy import unused\n\n\ndef test_unused():\n    assert unused() == 1\n"})
    catalogue = root / "catalogue"
    catalogue.mkdir()
    (catalogue / "01.yaml").write_text(yaml.safe_dump(CATALOGUE, sort_keys=False))
    report = root / "audit.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["--root", str(root), "audit", "--catalogue", str(catalogue), "--report", str(report)])
    return root, code, buf.getvalue(), json.loads(report.read_text())


def test_verdicts_and_hints(audited):
    _, code, _, report = audited
    verdicts = {m["id"]: (m["verdict"], m["hint_ok"], m["ok"]) for m in report["mutations"]}
    assert verdicts == {"M01-add-subtracts": ("caught", True, True),
                        "M01-untested": ("escaped", False, False),
                        "M01-stale": ("stale", False, False)}
    assert code == report["exit_code"] == 1


def test_json_report_fields(audited):
    _, _, _, report = audited
    caught = next(m for m in report["mutations"] if m["id"] == "M01-add-subtracts")
    assert caught["caught_by"] == ["01"] and caught["named"] == ["FM-900"]
    assert caught["failing_tests"] == ["phases/01_p/test_toy.py::test_add"] and caught["duration_s"] > 0
    escaped = next(m for m in report["mutations"] if m["id"] == "M01-untested")
    assert escaped["caught_by"] == [] and "phase 01 PASS" in escaped["detail"]
    stale = next(m for m in report["mutations"] if m["id"] == "M01-stale")
    assert "occurs 0 times" in stale["detail"]
    assert report["summary"] == {"caught": 1, "caught-later": 0, "escaped": 1, "stale": 1, "error": 0,
                                 "hint_missing": 0}


def test_table_and_the_working_tree_left_alone(audited):
    root, _, out, _ = audited
    assert "| M01-add-subtracts | 01 | FM-900 | caught | 01 | yes |" in out
    assert "| M01-untested | 01 | FM-901 | escaped | - | no |" in out
    assert (root / "toy.py").read_text() == TOY


def test_all_phases_says_which_later_phase_catches_an_escape(audited):
    root = audited[0]
    report = root / "later.json"
    code = main(["--root", str(root), "audit", "--catalogue", str(root / "catalogue"), "--report", str(report),
                 "--only", "M01-untested", "--all-phases"])
    (m,) = json.loads(report.read_text())["mutations"]
    assert code == 1 and m["verdict"] == "caught-later" and m["caught_by"] == ["02"]
    assert m["named"] == ["FM-901"] and m["hint_ok"]


def test_selection_by_phase_and_failure_mode(tmp_path):
    (tmp_path / "01.yaml").write_text(yaml.safe_dump(CATALOGUE))
    (tmp_path / "02.yaml").write_text(yaml.safe_dump([dict(CATALOGUE[0], id="M02-x", phase="02",
                                                          failure_modes=["FM-902"])]))
    mutations = audit.load_catalogue(tmp_path)
    assert [m.id for m in audit.select(mutations, audit.parse_phases("02"), None)] == ["M02-x"]
    assert len(audit.select(mutations, audit.parse_phases("01..02"), None)) == 4
    assert [m.id for m in audit.select(mutations, None, ["FM-901"])] == ["M01-untested"]
    assert [m.id for m in audit.select(mutations, None, ["M01-stale"])] == ["M01-stale"]
    with pytest.raises(GateError, match="matches no mutation"):
        audit.select(mutations, {"03"}, None)
    with pytest.raises(GateError, match="not a phase id"):
        audit.parse_phases("1-8")


def test_a_malformed_catalogue_is_a_clear_error(tmp_path):
    (tmp_path / "01.yaml").write_text(yaml.safe_dump([dict(CATALOGUE[0], patches=[])]))
    with pytest.raises(GateError, match=r"01.yaml\[0\]: patches must not be empty"):
        audit.load_catalogue(tmp_path)
    (tmp_path / "01.yaml").write_text(yaml.safe_dump([CATALOGUE[0], CATALOGUE[0]]))
    with pytest.raises(GateError, match="duplicate id M01-add-subtracts"):
        audit.load_catalogue(tmp_path)


def test_the_repository_catalogue_loads_and_every_patch_applies_once(tmp_path):
    """Each mutation in gates/mutations still matches the code it patches (no run)."""
    import shutil
    from pathlib import Path

    from gates.phases import discover

    repo = Path(__file__).resolve().parents[1]
    mutations = audit.load_catalogue(repo / "gates" / "mutations")
    cited = {p.id: {fm.id for fm in p.load_gate().failure_modes} for p in discover(repo)}
    for m in mutations:
        assert set(m.failure_modes) <= cited[m.phase], \
            f"{m.id}: phase {m.phase}'s gate does not cite {set(m.failure_modes) - cited[m.phase]}"
        files = {p.file for p in m.patches}
        for f in files:
            (tmp_path / m.id / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / f, tmp_path / m.id / f)
        assert audit.apply(tmp_path / m.id, m) == "", m.id


def test_the_gate_run_of_a_mutation_sees_the_packages_on_the_callers_path(tmp_path, monkeypatch):
    """A package found only through the caller's PYTHONPATH (the GPU host's carried wheels) is
    importable in the mutated copy's gate run: the add mutation is caught by its test, not lost to
    an import error (hint ok: the failing test is the one the failure mode names)."""
    root, beside = tmp_path / "tree", tmp_path / "site"
    root.mkdir()
    beside.mkdir()
    (beside / "carried.py").write_text("TWO = 2\n")
    (root / "toy.py").write_text(TOY)
    fms = [{"id": "FM-900", "symptom": "sums are wrong", "check": "c", "fix": "f", "tests": ["test_add"]}]
    write_phase(root, "01", gate("01", failure_modes=fms), {"test_toy.py": "from carried import TWO\n" + TEST_TOY})
    monkeypatch.setenv("PYTHONPATH", str(beside))
    out = audit.run_mutation(root, audit.Mutation("M01-add-subtracts", "01", ("FM-900",), "add subtracts", (
        audit.Patch("toy.py", "return a + b", "return a - b"),)))
    assert (out.verdict, out.hint_ok, out.failing_tests) == ("caught", True, ["phases/01_p/test_toy.py::test_add"])


def test_gate_runs_side_by_side_keep_one_thread_a_process(tmp_path):
    """An audit of several mutations at once gives each gate run's processes one OpenMP thread:
    torch's default, a thread per core in every session of a one-slot gate run, had two runs on
    two cores spin on each other's cores (a phase-09 mutation took 465 s instead of 80). The toy
    phase's second test reads the session's torch threads; only the planted fault fails."""
    (tmp_path / "toy.py").write_text(TOY)
    threads_test = "import torch\n\n\ndef test_one_thread():\n    assert torch.get_num_threads() == 1\n"
    fms = [{"id": "FM-900", "symptom": "sums are wrong", "check": "c", "fix": "f", "tests": ["test_add"]}]
    write_phase(tmp_path, "01", gate("01", failure_modes=fms), {"test_toy.py": TEST_TOY + "\n\n" + threads_test})
    catalogue = tmp_path / "catalogue"
    catalogue.mkdir()
    (catalogue / "01.yaml").write_text(yaml.safe_dump(CATALOGUE[:1], sort_keys=False))
    report = tmp_path / "audit.json"
    main(["--root", str(tmp_path), "audit", "--catalogue", str(catalogue), "--jobs", "2", "--report", str(report)])
    (outcome,) = json.loads(report.read_text())["mutations"]
    assert (outcome["verdict"], outcome["failing_tests"]) == ("caught", ["phases/01_p/test_toy.py::test_add"])
