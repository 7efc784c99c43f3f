"""The performance gate's parts that run on a CPU: the short benchmark's code path on the tiny
presets (a complete report, every figure present and finite; never a timing assertion), and
``compare``, which decides what counts as a regression against the baseline."""
from __future__ import annotations

import json
import math

import pytest

from engine.bench.short import FIGURES, baseline_from, main
from gates.diff import DEFAULT_TOLERANCE, compare


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


def test_tiny_short_benchmark_writes_a_complete_report(tmp_path, capsys):
    """Every engine and measurement of the H200 run, on the tiny presets: every figure is there,
    finite and positive, with its unit and direction; stdout's last line is the report."""
    path = tmp_path / "short.json"
    assert main(["--tiny", "--output", str(path)]) == 0
    report = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert report["scale"]["name"] == "tiny" and sorted(report["sections"]) == ["deepseek", "qwen3", "qwen3_eager"]
    assert sorted(report["figures"]) == sorted(FIGURES)
    for name, fig in report["figures"].items():
        assert math.isfinite(fig["value"]) and fig["value"] > 0, (name, fig)
        assert (fig["unit"], fig["higher_is_better"]) == FIGURES[name]
    baseline = baseline_from(report)
    assert (baseline["figures"], baseline["tolerance"], baseline["scale"]) == (report["figures"], DEFAULT_TOLERANCE,
                                                                              "tiny")


def test_a_baseline_is_only_written_at_full_scale(tmp_path):
    with pytest.raises(SystemExit):
        main(["--tiny", "--write-baseline", str(tmp_path / "baseline.json")])
    assert not (tmp_path / "baseline.json").exists()
