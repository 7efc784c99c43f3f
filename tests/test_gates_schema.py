"""gate.yaml validation, selection and ordering (no subprocesses)."""
from __future__ import annotations

import copy

import pytest
import yaml

from gate_trees import gate
from gates.phases import select, topological_order
from gates.schema import GateError, load_gate, parse_gate, parse_unlock

WHERE = "phases/05_p/gate.yaml"


def valid() -> dict:
    return gate("05", depends_on=["01", "03"], runs=[
        {"mode": "single", "tests": ["phases/05_p"]},
        {"mode": "torchrun", "nproc": [2, 4], "tests": ["phases/05_p/test_tp.py"], "timeout_s": 60},
        {"mode": "single", "requires": ["cuda"], "tests": ["phases/05_p/test_gpu.py"], "alone": True},
    ], eager_gate=[{"rule": "r", "test": "phases/05_p/test_a.py::test_a"}],
        failure_modes=[{"id": "FM-008", "symptom": "s", "check": "c", "fix": "f", "tests": ["test_a"]}])


def test_valid_gate_parses_into_typed_fields():
    g = parse_gate(valid() | {"unlocks": ["engine/worker/kv_cache.py", "engine/model/kernels", "engine/m.py::A.f"],
                              "notes": ["why"]}, WHERE, "05")
    assert g.unlocks == ("engine/worker/kv_cache.py", "engine/model/kernels", "engine/m.py::A.f")
    assert g.notes == ("why",)
    assert parse_unlock("engine/m.py::A.f") == ("engine/m.py", "A.f") and parse_unlock("engine") == ("engine", "")
    assert g.id == "05" and g.depends_on == ("01", "03")
    assert [r.mode for r in g.runs] == ["single", "torchrun", "single"]
    assert g.runs[1].nproc == (2, 4) and g.runs[1].timeout_s == 60
    assert g.runs[0].timeout_s == 900 and g.runs[2].requires == ("cuda",)
    assert g.runs[2].alone and not g.runs[0].alone
    assert g.eager_gate[0].test == "phases/05_p/test_a.py::test_a"
    assert g.failure_modes[0].matches("phases/05_p/test_a.py::test_a[2]")
    assert not g.failure_modes[0].matches("phases/05_p/test_b.py::test_b")


def _set(path, value):
    def edit(d):
        *keys, last = path
        for k in keys:
            d = d[k]
        if value is DELETE:
            del d[last]
        else:
            d[last] = value
    return edit


DELETE = object()
BROKEN = {
    "unknown top-level key": (_set(["colour"], "red"), "colour: unknown key"),
    "missing title": (_set(["title"], DELETE), "title: missing"),
    "id not quoted": (_set(["id"], 5), "id: must be a two-digit string"),
    "id not matching directory": (_set(["id"], "06"), "id: '06' does not match the directory prefix '05'"),
    "depends_on not a list": (_set(["depends_on"], "01"), "depends_on: must be a list"),
    "dependency id malformed": (_set(["depends_on", 0], "1"), "depends_on[0]: must be a two-digit string"),
    "self dependency": (_set(["depends_on", 0], "05"), "depends_on: a phase cannot depend on itself"),
    "no runs": (_set(["runs"], []), "runs: must not be empty"),
    "unknown mode": (_set(["runs", 0, "mode"], "mpi"), "runs[0].mode: must be one of single, torchrun"),
    "torchrun without nproc": (_set(["runs", 1, "nproc"], DELETE), "runs[1].nproc: required when mode is torchrun"),
    "nproc on single": (_set(["runs", 0, "nproc"], [2]), "runs[0].nproc: only allowed when mode is torchrun"),
    "nproc not positive": (_set(["runs", 1, "nproc"], [2, 0]), "runs[1].nproc[1]: must be a positive integer"),
    "unknown run key": (_set(["runs", 0, "env"], {}), "runs[0].env: unknown key"),
    "unknown requirement": (_set(["runs", 2, "requires"], ["tpu"]), "runs[2].requires[0]: unknown requirement 'tpu'"),
    "bad timeout": (_set(["runs", 1, "timeout_s"], -1), "runs[1].timeout_s: must be a positive number"),
    "alone not a boolean": (_set(["runs", 2, "alone"], "yes"), "runs[2].alone: must be true or false"),
    "absolute test path": (_set(["runs", 0, "tests"], ["/tmp/x"]), "runs[0].tests[0]: must be a path relative"),
    "empty tests": (_set(["runs", 0, "tests"], []), "runs[0].tests: must not be empty"),
    "rule without test": (_set(["eager_gate", 0, "test"], DELETE), "eager_gate[0].test: missing"),
    "rule test not a node id": (_set(["eager_gate", 0, "test"], "phases/05_p/test_a.py"),
                                "eager_gate[0].test: must be a pytest node id"),
    "failure mode without fix": (_set(["failure_modes", 0, "fix"], DELETE), "failure_modes[0].fix: missing"),
    "failure mode empty symptom": (_set(["failure_modes", 0, "symptom"], ""),
                                   "failure_modes[0].symptom: must be a non-empty string"),
    "failure mode without tests": (_set(["failure_modes", 0, "tests"], []),
                                   "failure_modes[0].tests: must not be empty"),
    "done_criteria empty": (_set(["done_criteria"], []), "done_criteria: must not be empty"),
    "unlocks prose": (_set(["unlocks"], ["engine/worker/model_runner.py (CUDA graphs)"]),
                      "unlocks[0]: must be a path relative to the repository root or path::QualifiedName"),
    "unlocks absolute": (_set(["unlocks"], ["engine/x.py", "/engine/x.py"]), "unlocks[1]: must be a path"),
    "unlocks up a level": (_set(["unlocks"], ["engine/../x.py"]), "unlocks[0]: must be a path"),
    "unlocks bad qualname": (_set(["unlocks"], ["engine/x.py::A..b"]), "unlocks[0]: must be a path"),
    "notes not strings": (_set(["notes"], [{"a": "b"}]), "notes[0]: must be a non-empty string"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_gate_is_a_clear_error_naming_file_and_field(case):
    edit, message = BROKEN[case]
    data = copy.deepcopy(valid())
    edit(data)
    with pytest.raises(GateError) as e:
        parse_gate(data, WHERE, "05")
    assert str(e.value).startswith(f"{WHERE}: ")
    assert message in str(e.value)


def test_unparsable_and_missing_files_are_clear_errors(tmp_path):
    bad = tmp_path / "gate.yaml"
    bad.write_text("id: '05'\nruns: [\n")
    with pytest.raises(GateError, match=r"gate\.yaml: not valid YAML"):
        load_gate(bad, "05")
    with pytest.raises(GateError, match=r"nope\.yaml: missing"):
        load_gate(tmp_path / "nope.yaml", "05")
    bad.write_text(yaml.safe_dump(["a", "list"]))
    with pytest.raises(GateError, match=r"must be a mapping"):
        load_gate(bad, "05")


def test_selection_by_upto_from_and_only():
    ids = ["01", "02", "03", "08", "11"]
    assert select(ids, upto="03") == ["01", "02", "03"]
    assert select(ids, start="03") == ["03", "08", "11"]
    assert select(ids, upto="08", start="02") == ["02", "03", "08"]
    assert select(ids, only=["08", "02"]) == ["02", "08"]
    assert select(ids) == ids
    with pytest.raises(GateError, match="unknown phase id.*42"):
        select(ids, only=["42"])


def test_topological_order_puts_dependencies_first_and_breaks_ties_by_id():
    deps = {"01": (), "02": ("01",), "03": ("02",), "04": ("02",), "05": ("01", "03"),
            "06": ("05",), "07": ("06", "04"), "08": (), "09": ("07", "08"), "10": ("09",)}
    assert topological_order(deps) == ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10"]
    assert topological_order({"01": ("03",), "02": (), "03": ()}) == ["02", "03", "01"]
    # dependencies outside the given phases are ignored (not enforced)
    assert topological_order({"05": ("01",), "06": ("05",)}) == ["05", "06"]


def test_dependency_cycle_is_a_clear_error_naming_the_cycle():
    with pytest.raises(GateError, match=r"dependency cycle .*: 02 -> 04 -> 03 -> 02"):
        topological_order({"01": (), "02": ("01", "04"), "03": ("02",), "04": ("03",), "05": ("04",)})
