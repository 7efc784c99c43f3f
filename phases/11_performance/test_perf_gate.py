"""The performance gate: the short benchmark (``engine.entrypoints.bench.short``, a few minutes on the H200)
compared with the committed H200 baseline, ``baseline.json`` next to this file. Speed is
asserted here only, as a benchmark against a recorded baseline, never in unit tests.

The compared figures are normalised by references measured in the same run (device floors, a
host reference; ``engine.entrypoints.bench.short.NORMALISED``), so an unchanged tree passes on any H200 host;
the gate's CPU tests (``test_perf_gate_cpu.py``) check that on two hosts' recorded figures.
Record (or refresh, after a deliberate change) the baseline on the H200 and commit it:

    PYTHONPATH=. python -m engine.entrypoints.bench.short --write-baseline phases/11_performance/baseline.json

``PERF_TOLERANCE=0.15`` overrides the baseline's tolerance. The figures go into the gate report
(``python -m gates diff`` shows them, and the raw ones) and the whole benchmark report to
build/perf-short.json.
"""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from engine.entrypoints.bench.short import FULL, NORMALISED, RAW_FIGURES, TOLERANCE, normalise, run_short, write_json
from engine.model.models.decoder import DecoderModel
from gates.diff import compare

BASELINE = Path(__file__).with_name("baseline.json")
RECORD = "PYTHONPATH=. python -m engine.entrypoints.bench.short --write-baseline phases/11_performance/baseline.json"
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
    """Every raw figure (RAW_FIGURES) and every gate figure (NORMALISED) is there, finite and
    positive, with its unit and direction; the graphed engines really replayed CUDA graphs."""
    record_property("figures", short_report["figures"])
    record_property("raw_figures", short_report["raw_figures"])
    assert sorted(short_report["raw_figures"]) == sorted(RAW_FIGURES)
    assert sorted(short_report["figures"]) == sorted(NORMALISED)
    for name, figure in short_report["raw_figures"].items():
        assert math.isfinite(figure["value"]) and figure["value"] > 0, f"{name}: {figure['value']}"
        assert (figure["unit"], figure["higher_is_better"]) == RAW_FIGURES[name], name
    assert short_report["sections"]["qwen3"]["cuda_graphs"] and short_report["sections"]["deepseek"]["cuda_graphs"]


@pytest.mark.cuda
def test_figures_within_tolerance_of_baseline(short_report, record_property):
    """No figure is worse than the committed H200 baseline by more than its tolerance."""
    if not BASELINE.is_file():
        pytest.fail(f"no baseline at {BASELINE}: record it on the H200 with `{RECORD}` and commit it")
    baseline = json.loads(BASELINE.read_text())
    assert baseline["scale"] == FULL.name, f"{BASELINE} holds {baseline['scale']!r} figures; record it with `{RECORD}`"
    assert "raw_figures" in baseline, (f"{BASELINE} predates the normalised figures (raw figures only): "
                                       f"re-record it with `{RECORD}`")
    here = torch.cuda.get_device_name()
    if baseline["machine"].get("device") != here:
        pytest.skip(f"the baseline was recorded on {baseline['machine'].get('device')}, this is {here}")
    record_property("figure_tolerance", tolerance(baseline))
    regressions = compare(short_report["figures"], baseline["figures"], tolerance(baseline))
    assert not regressions, (f"{len(regressions)} figure(s) worse than the baseline by more than "
                             f"{tolerance(baseline):.0%}:\n" + "\n".join(c.line() for c in regressions))


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spends per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


@pytest.mark.cuda
def test_injected_slowdown_is_flagged(short_report, monkeypatch):
    """A real 15 % slowdown of one kernel on the GPU: the decoder stack ends with a GPU sleep of
    15 % of a graphed B=1 decode step (captured in the graphs like any kernel). The qwen3 section
    run again with it, normalised by this run's references and compared at the gate's tolerance
    with this module's own figures, flags the graphed decode figure."""
    cycles = int(0.15 * short_report["sections"]["qwen3"]["decode"]["ms_per_token"] * sleep_cycles_per_ms())
    real_forward = DecoderModel.forward

    def slowed_forward(self, *args, **kwargs):
        hidden = real_forward(self, *args, **kwargs)
        torch.cuda._sleep(cycles)
        return hidden

    monkeypatch.setattr(DecoderModel, "forward", slowed_forward)
    slowed = normalise({**short_report["raw_figures"], **run_short(FULL, sections=("qwen3",))["raw_figures"]})
    measured = {name: short_report["figures"][name] for name in slowed}
    allowed = tolerance(json.loads(BASELINE.read_text())) if BASELINE.is_file() else TOLERANCE
    regressed = {c.name for c in compare(slowed, measured, allowed)}
    assert "qwen3_decode_b1_per_chain" in regressed, (slowed, measured)
