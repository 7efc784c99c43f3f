"""The repository's own gate files stay wired to real tests: every eager-gate rule
names a collected test inside the phase's own runs, and every failure mode's test
substrings match a collected test id of that phase. Phases without test files yet
(their gates name the tests they will have) are left out."""
import subprocess
import sys
from pathlib import Path

import pytest

from gates import phases as gate_phases

ROOT = Path(__file__).resolve().parents[1]
PHASES = [p for p in gate_phases.discover(ROOT) if gate_phases.test_files(p)]


@pytest.fixture(scope="module")
def collected() -> list[str]:
    """Every test node id under phases/ (one collect-only run)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "phases"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids, out.stdout + out.stderr
    return ids


@pytest.mark.parametrize("phase", PHASES, ids=[p.id for p in PHASES])
def test_eager_gate_rules_name_collected_tests_inside_the_phase_runs(phase, collected):
    gate = phase.load_gate()
    run_targets = [t.split("::")[0] for run in gate.runs for t in run.tests]
    for rule in gate.eager_gate:
        assert any(i == rule.test or i.startswith((rule.test + "[", rule.test + "::")) for i in collected), \
            f"{phase.rel}: {rule.test} is not a collected test"
        assert any(rule.test.startswith(t) for t in run_targets), \
            f"{phase.rel}: {rule.test} is outside the phase's runs, so the gate never runs it"


@pytest.mark.parametrize("phase", PHASES, ids=[p.id for p in PHASES])
def test_failure_mode_test_substrings_match_a_test_of_the_phase(phase, collected):
    own = [i for i in collected if i.startswith(phase.rel + "/")]
    for fm in phase.load_gate().failure_modes:
        for sub in fm.tests:
            assert any(sub in i for i in own), f"{phase.rel}: {fm.id} names {sub!r}, which matches no test"
