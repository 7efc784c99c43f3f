"""A build can resume at the engine (``exercise --from 09``: phases 01-08 still pass), and
``gates next`` names the phase, test and failure mode of a fault planted from the audit
catalogue."""
from __future__ import annotations

import shutil

import pytest

from exercise_runs import ALL, GATES, MODE, ROOT, run_gates, statuses
from gates import audit
from gates.exercise import exercise
from gates.next_step import advise


@pytest.mark.slow
def test_handing_out_the_engine_leaves_phases_01_to_08_passing(tmp_path):
    """CI runs 05-08 (the phases that build models and schedule sequences, the ones a test could
    reach the engine from; 01-04 test kernels, collectives and TP layers); exercise-all all of them."""
    tree = tmp_path / "tree"
    exercise(ROOT, tree, {p for p in GATES if p >= "09"})
    first = "01" if ALL else "05"
    report = run_gates(tree, "--from", first, "--upto", "08", *MODE)
    assert statuses(report) == {p: "PASS" for p in GATES if first <= p <= "08"}, \
        [(p["id"], p["reason"]) for p in report["phases"] if p["status"] != "PASS"]


@pytest.mark.slow
def test_next_names_the_phase_test_and_failure_mode_of_a_planted_fault(tmp_path):
    (mutation,) = audit.select(audit.load_catalogue(ROOT / "gates" / "mutations"), None, ["M06-mlp-gate-up-swapped"])
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=audit.COPY_IGNORE, symlinks=True)
    assert audit.apply(tree, mutation) == ""
    advice = advise(tree, run_gates(tree, "--only", mutation.phase, "--mode", "single"))
    assert advice["phase"] == mutation.phase and advice["status"] == "work"
    assert set(mutation.failure_modes) <= {fm["id"] for fm in advice["failure_modes"]}
    named = [t for t in advice["failing_tests"] if set(mutation.failure_modes) & set(t["failure_modes"])]
    assert named and all(t["error"] for t in named), advice["failing_tests"]
    assert advice["unimplemented"] == []
