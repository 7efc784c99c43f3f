"""``python -m gates diff`` on two reports recorded by real gate runs of one temporary tree.

Between the runs one test flips from passing to failing and one recorded benchmark figure
drops by 20 % (another moves within the tolerance, and a raw figure, shown but never compared,
doubles), so the diff must name both as regressions and exit 1; a report against itself has no
regression. Below, ``compare`` (what the performance gate counts as a regression) on figures.
"""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from gate_trees import gate, write_phase
from gates.cli import main
from gates.diff import compare, figure_changes

PERF = """
import json
from pathlib import Path

STATE = json.loads((Path(__file__).parent / "state.json").read_text())


def test_stable():
    pass


def test_flips():
    assert STATE["ok"], "the state file says fail"


def test_bench(record_property):
    record_property("figures", {
        "decode_tok_s": {"value": STATE["tok_s"], "unit": "tok/s", "higher_is_better": True},
        "host_us_per_step": {"value": STATE["host_us"], "unit": "us", "higher_is_better": False}})
    record_property("raw_figures", {"host_ref_us": {"value": STATE["ref_us"], "unit": "us", "higher_is_better": False}})
    record_property("figure_tolerance", 0.1)
"""


def gates_cli(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(args))
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """(old, new) report paths: the tree run with its first state, then with its second."""
    root = tmp_path_factory.mktemp("tree")
    phase = write_phase(root, "01", gate("01"), {"test_perf.py": PERF})
    paths = []
    for name, state in (("old", {"ok": True, "tok_s": 100.0, "host_us": 500.0, "ref_us": 10.0}),
                        ("new", {"ok": False, "tok_s": 80.0, "host_us": 520.0, "ref_us": 20.0})):
        (phase / "state.json").write_text(json.dumps(state))
        paths.append(root / f"{name}.json")
        gates_cli("--root", str(root), "run", "--report", str(paths[-1]))
    return paths


def test_reports_record_every_test_and_the_figures(reports):
    run = json.loads(reports[0].read_text())["phases"][0]["runs"][0]
    outcomes = {t["nodeid"].rsplit("::", 1)[1]: t["outcome"] for t in run["test_results"]}
    assert outcomes == {"test_stable": "passed", "test_flips": "passed", "test_bench": "passed"}
    bench = next(t for t in run["test_results"] if t["nodeid"].endswith("test_bench"))
    assert bench["properties"]["figures"]["decode_tok_s"]["value"] == 100.0


def test_diff_names_the_flipped_test_and_the_slowed_figure(reports):
    code, out = gates_cli("diff", *map(str, reports))
    assert code == 1, out
    lines = out.splitlines()
    assert "  01: PASS -> FAIL  REGRESSION" in lines
    assert "  phases/01_p/test_perf.py::test_flips: passed -> failed  REGRESSION" in lines
    assert "  decode_tok_s: 100 -> 80 tok/s (-20.0%)  REGRESSION" in lines
    assert "  host_us_per_step: 500 -> 520 us (+4.0%)" in lines  # worse, but within 10 %
    raw = lines.index("raw benchmark figures (not compared: they move with the host):")
    assert lines[raw + 1] == "  host_ref_us: 10 -> 20 us (+100.0%)"  # shown, never a regression
    assert not any("test_stable" in line or "test_bench" in line for line in lines)
    assert "3 regression(s)" in out


def test_diff_tolerance_option_and_a_report_against_itself(reports):
    assert gates_cli("diff", str(reports[0]), str(reports[0]))[0] == 0
    _, out = gates_cli("diff", "--tolerance", "0.01", *map(str, reports))
    assert "  host_us_per_step: 500 -> 520 us (+4.0%)  REGRESSION" in out.splitlines()


def test_diff_flags_a_slower_run(reports, tmp_path):
    data = json.loads(reports[0].read_text())
    data["phases"][0]["runs"][0]["duration_s"] += 60.0
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps(data))
    code, out = gates_cli("diff", str(reports[0]), str(slower))
    assert code == 1 and "01 single phases/01_p:" in out and "REGRESSION" in out, out


def test_diff_of_a_missing_report_is_an_error(reports, tmp_path, capsys):
    assert main(["diff", str(reports[0]), str(tmp_path / "absent.json")]) == 2
    assert "no report at" in capsys.readouterr().err


def test_diff_flags_lost_coverage(reports, tmp_path):
    """A phase that passed and is now skipped, and a test that passed and is now skipped, regressed
    (coverage was lost, nothing failed)."""
    data = json.loads(reports[0].read_text())
    data["phases"][0]["status"] = "SKIP"
    stable = next(t for t in data["phases"][0]["runs"][0]["test_results"] if t["nodeid"].endswith("test_stable"))
    stable["outcome"] = "skipped"
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps(data))
    code, out = gates_cli("diff", str(reports[0]), str(skipped))
    lines = out.splitlines()
    assert code == 1 and "  01: PASS -> SKIP  REGRESSION" in lines, out
    assert "  phases/01_p/test_perf.py::test_stable: passed -> skipped  REGRESSION" in lines, out


def test_a_figure_from_a_zero_baseline_regresses_when_worse():
    """No relative change exists from 0: a lower-is-better figure that grows from 0 regressed, one
    that stays 0 did not; a higher-is-better figure that grows from 0 improved."""
    allocations = {"value": 0, "unit": "allocations", "higher_is_better": False}
    grown = dict(allocations, value=3)
    assert [c.regressed for c in figure_changes({"a": allocations}, {"a": grown}, 0.1)] == [True]
    assert [c.regressed for c in figure_changes({"a": allocations}, {"a": allocations}, 0.1)] == [False]
    tok_s = {"value": 0, "unit": "tok/s", "higher_is_better": True}
    assert [c.regressed for c in figure_changes({"t": tok_s}, {"t": dict(tok_s, value=5)}, 0.1)] == [False]


def figure(value, higher_is_better=True, unit="tok/s") -> dict:
    return {"value": value, "unit": unit, "higher_is_better": higher_is_better}


BASELINE = {"decode_tok_s": figure(100.0), "host_us": figure(500.0, higher_is_better=False, unit="us")}


def names(regressions) -> list[str]:
    return [c.name for c in regressions]


def test_a_figure_slowed_beyond_the_tolerance_regresses():
    regressions = compare({**BASELINE, "decode_tok_s": figure(85.0)}, BASELINE, 0.10)
    assert names(regressions) == ["decode_tok_s"]
    assert (regressions[0].old, regressions[0].new) == (100.0, 85.0)
    assert regressions[0].change == pytest.approx(-0.15)


def test_within_the_tolerance_or_improved_passes():
    assert compare({**BASELINE, "decode_tok_s": figure(91.0)}, BASELINE, 0.10) == []
    assert compare({"decode_tok_s": figure(300.0), "host_us": figure(100.0, False, "us")}, BASELINE, 0.10) == []


def test_lower_is_better_figures_regress_when_they_grow():
    assert names(compare({**BASELINE, "host_us": figure(600.0, False, "us")}, BASELINE, 0.10)) == ["host_us"]
    assert compare({**BASELINE, "host_us": figure(540.0, False, "us")}, BASELINE, 0.10) == []


def test_a_missing_or_non_finite_figure_regresses_and_a_new_one_does_not():
    assert names(compare({"host_us": BASELINE["host_us"]}, BASELINE, 0.10)) == ["decode_tok_s"]
    assert names(compare({**BASELINE, "decode_tok_s": figure(math.nan)}, BASELINE, 0.10)) == ["decode_tok_s"]
    assert compare({**BASELINE, "prefill_tok_s": figure(1.0)}, BASELINE, 0.10) == []


def test_the_tolerance_decides():
    slowed = {**BASELINE, "decode_tok_s": figure(85.0)}
    assert compare(slowed, BASELINE, 0.20) == []
    assert names(compare(slowed, BASELINE, 0.05)) == ["decode_tok_s"]
