"""The performance gate: the short benchmark (``engine.bench.short``, a few minutes on the H200)
compared with the committed H200 baseline, ``baseline.json`` next to this file. Speed is
asserted here only, as a benchmark against a recorded baseline, never in unit tests.

Record (or refresh, after a deliberate change) the baseline on the H200 and commit it:

    PYTHONPATH=. python -m engine.bench.short --write-baseline phases/11_performance/baseline.json

``PERF_TOLERANCE=0.15`` overrides the baseline's tolerance. The figures go into the gate report
(``python -m gates diff`` shows them) and the whole benchmark report to build/perf-short.json.
"""
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from engine.bench.short import FIGURES, FULL, run_short, write_json
from engine.model_runner import ModelRunner
from gates.diff import DEFAULT_TOLERANCE, compare

BASELINE = Path(__file__).with_name("baseline.json")
RECORD = "PYTHONPATH=. python -m engine.bench.short --write-baseline phases/11_performance/baseline.json"
REPORT = Path(__file__).resolve().parents[2] / "build" / "perf-short.json"


@pytest.fixture(scope="module")
def short_report() -> dict:
    """The short benchmark at full scale, run once for the module."""
    report = run_short(FULL)
    write_json(str(REPORT), report)
    return report


def tolerance(baseline: dict) -> float:
    return float(os.environ.get("PERF_TOLERANCE", baseline["tolerance"]))


@pytest.mark.cuda
def test_short_benchmark_report_is_complete(short_report, record_property):
    """Every figure of FIGURES is there, finite and positive, with its unit and direction;
    the graphed engines really replayed CUDA graphs."""
    figures = short_report["figures"]
    record_property("figures", figures)
    assert sorted(figures) == sorted(FIGURES)
    for name, figure in figures.items():
        unit, higher = FIGURES[name]
        assert math.isfinite(figure["value"]) and figure["value"] > 0, f"{name}: {figure['value']}"
        assert (figure["unit"], figure["higher_is_better"]) == (unit, higher), name
    assert short_report["sections"]["qwen3"]["cuda_graphs"] and short_report["sections"]["deepseek"]["cuda_graphs"]


@pytest.mark.cuda
def test_figures_within_tolerance_of_baseline(short_report, record_property):
    """No figure is worse than the committed H200 baseline by more than its tolerance."""
    if not BASELINE.is_file():
        pytest.fail(f"no baseline at {BASELINE}: record it on the H200 with `{RECORD}` and commit it")
    baseline = json.loads(BASELINE.read_text())
    assert baseline["scale"] == FULL.name, f"{BASELINE} holds {baseline['scale']!r} figures; record it with `{RECORD}`"
    here = torch.cuda.get_device_name()
    if baseline["machine"].get("device") != here:
        pytest.skip(f"the baseline was recorded on {baseline['machine'].get('device')}, this is {here}")
    record_property("figure_tolerance", tolerance(baseline))
    regressions = compare(short_report["figures"], baseline["figures"], tolerance(baseline))
    assert not regressions, (f"{len(regressions)} figure(s) worse than the baseline by more than "
                             f"{tolerance(baseline):.0%}:\n" + "\n".join(c.line() for c in regressions))


@pytest.mark.cuda
def test_injected_slowdown_is_flagged(short_report, monkeypatch):
    """A real slowdown (every engine step sleeps as long as a graphed B=1 decode step took) in the
    qwen3 section, at the gate's tolerance: comparing with this module's own figures flags the
    decode figure (its tok/s halves)."""
    sleep_s = short_report["sections"]["qwen3"]["decode"]["ms_per_token"] / 1e3
    real_run = ModelRunner.run

    def slowed_run(self, *args, **kwargs):
        time.sleep(sleep_s)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "run", slowed_run)
    slowed = run_short(FULL, sections=("qwen3",))["figures"]
    measured = {name: short_report["figures"][name] for name in slowed}
    allowed = tolerance(json.loads(BASELINE.read_text())) if BASELINE.is_file() else DEFAULT_TOLERANCE
    regressed = {c.name for c in compare(slowed, measured, allowed)}
    assert "qwen3_decode_b1_tok_s" in regressed, (slowed, measured)
