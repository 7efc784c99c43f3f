"""The performance gate's parts that run on a CPU: the short benchmark's code path on the tiny
presets (a complete report; never a timing assertion), and the gate's normalisation fed with
figures recorded on two H200 hosts (``recorded_hosts.json``).

The gate compares normalised figures (``engine.entrypoints.bench.short.NORMALISED``): GPU-bound ones as
ratios to the same run's device floors, the host-bound eager one times the same run's host
reference. An unchanged tree must pass on any H200 host, and a real slowdown must still fail,
naming its figure. The recorded hosts measured their floors but not the host reference (it is
new), so the host-bound half is checked as a property: whatever the host's speed factor (host
B's measured 1.49 among them), scaling an eager step and the host reference by it leaves the
gate's figure unchanged. That the reference does scale like an eager step is measured on the GPU
(``bash scripts/gpu.sh hostcheck``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.entrypoints.bench.short import NORMALISED, RAW_FIGURES, TOLERANCE, baseline_from, main, normalise
from gates.diff import compare

RECORDED = json.loads(Path(__file__).with_name("recorded_hosts.json").read_text())["hosts"]
HOST_A, HOST_B = "two-gpu host, 2026-11-29", "one-gpu host, 2026-12-01"
GPU_BOUND = ("qwen3_decode_b1_tok_s", "qwen3_prefill_tok_s", "qwen3_throughput_output_tok_s",
             "deepseek_decode_b1_tok_s", "matmul_chain_tok_s", "prefill_gemm_tok_s", "copy_gb_s")
HOST_BOUND = ("qwen3_eager_decode_b1_tok_s", "qwen3_eager_host_us_per_step", "host_ref_us")


def figures(values: dict[str, float]) -> dict:
    """Raw figures (name -> value) as the short benchmark reports them."""
    return {name: {"value": value, "unit": RAW_FIGURES[name][0], "higher_is_better": RAW_FIGURES[name][1]}
            for name, value in values.items()}


def recorded(host: str) -> dict[str, float]:
    return dict(RECORDED[host]["raw_figures"])


def slowed(values: dict[str, float], name: str, factor: float = 1.15) -> dict[str, float]:
    """``values`` with figure ``name`` taking ``factor`` times as long (a rate divided, a time multiplied)."""
    higher = RAW_FIGURES[name][1]
    return {**values, name: values[name] / factor if higher else values[name] * factor}


def regressed(run: dict[str, float], baseline: dict[str, float]) -> list[str]:
    return [c.name for c in compare(normalise(figures(run)), normalise(figures(baseline)), TOLERANCE)]


def test_raw_figures_fail_an_unchanged_tree_on_the_second_host():
    """Why the gate normalises: compared raw, host B's run fails on both eager figures (its CPU
    dispatches more slowly), though nothing regressed."""
    raw_b, raw_a = figures(recorded(HOST_B)), figures(recorded(HOST_A))
    assert sorted(c.name for c in compare(raw_b, {n: raw_a[n] for n in raw_b}, TOLERANCE)) == [
        "qwen3_eager_decode_b1_tok_s", "qwen3_eager_host_us_per_step"]


def test_host_b_passes_against_a_baseline_recorded_on_host_a():
    """Host B's recorded figures over its own floors against host A's over host A's: no GPU-bound
    figure regresses (host B recorded no throughput figure; it is left out of both sides)."""
    run, baseline = recorded(HOST_B), recorded(HOST_A)
    baseline.pop("qwen3_throughput_output_tok_s")
    compared = normalise(figures(run))
    assert sorted(compared) == ["deepseek_decode_b1_per_chain", "qwen3_decode_b1_per_chain",
                                "qwen3_prefill_per_gemm_floor"]
    assert regressed(run, baseline) == []


@pytest.mark.parametrize("name", ["qwen3_decode_b1_tok_s", "qwen3_prefill_tok_s"])
def test_a_15_percent_slowdown_on_host_b_fails_naming_its_figure(name):
    """Host B's run with one engine figure 15 % slower, against host A's baseline: exactly the
    gate figure made from it regresses. (V2-Lite is left out here: host B ran a later tree whose
    V2-Lite decode is 6 % faster over its chain than host A's baseline, so 15 % slower than that
    is 8 % worse than the baseline, within the tolerance: a baseline is re-recorded after a gain.)"""
    run, baseline = recorded(HOST_B), recorded(HOST_A)
    baseline.pop("qwen3_throughput_output_tok_s")
    gate_name = next(n for n, (figure, *_) in NORMALISED.items() if figure == name)
    assert regressed(slowed(run, name), baseline) == [gate_name]


def host_a_with_a_host_reference() -> dict[str, float]:
    """Host A's recorded figures, with a host reference of 10 us (not recorded: any value serves,
    the properties below scale it)."""
    return {**recorded(HOST_A), "host_ref_us": 10.0}


def on_another_host(values: dict[str, float], device: float, host: float) -> dict[str, float]:
    """``values`` as an unchanged tree would measure them on a host whose GPU runs ``device`` times
    as fast and whose CPU dispatches ``host`` times as fast: every GPU-bound rate (engine figure
    and floor alike) times ``device``, the host-bound rate times ``host``, host times divided."""
    out = {}
    for name, value in values.items():
        factor = device if name in GPU_BOUND else host
        out[name] = value * factor if RAW_FIGURES[name][1] else value / factor
    return out


HOST_B_SPEED = 40.18 / 59.794333726743844  # host B's eager decode over host A's: 0.67 (its CPU dispatches slower)
SPEEDS = st.floats(0.3, 3.0)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(device=SPEEDS, host=st.one_of(st.just(HOST_B_SPEED), SPEEDS))
def test_an_unchanged_tree_passes_at_any_device_and_host_speed(device, host):
    """Every gate figure is unchanged (to rounding) when the device or the host is faster or
    slower, host B's measured host factor among the cases, so the gate passes."""
    baseline = host_a_with_a_host_reference()
    run = on_another_host(baseline, device, host)
    for name, figure in normalise(figures(run)).items():
        assert math.isclose(figure["value"], normalise(figures(baseline))[name]["value"], rel_tol=1e-9), name
    assert regressed(run, baseline) == []


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(device=SPEEDS, host=st.one_of(st.just(HOST_B_SPEED), SPEEDS),
       name=st.sampled_from([figure for figure, *_ in NORMALISED.values()]))
def test_a_15_percent_slowdown_fails_naming_its_figure_at_any_device_and_host_speed(device, host, name):
    """On any host, one engine figure 15 % slower (a kernel that got slower, or a host path)
    regresses exactly the gate figure made from it, and only that one."""
    baseline = host_a_with_a_host_reference()
    run = slowed(on_another_host(baseline, device, host), name)
    gate_name = next(n for n, (figure, *_) in NORMALISED.items() if figure == name)
    assert regressed(run, baseline) == [gate_name]


def test_normalised_figures_need_both_parts():
    """A gate figure exists only where the run has both its engine figure and its reference (a
    baseline figure missing from a run is then a regression, named)."""
    run = recorded(HOST_A)
    run.pop("matmul_chain_tok_s")
    assert sorted(normalise(figures(run))) == ["qwen3_prefill_per_gemm_floor"]
    assert "qwen3_decode_b1_per_chain" in regressed(run, recorded(HOST_A))


def test_tiny_short_benchmark_writes_a_complete_report(tmp_path, capsys):
    """Every section of the H200 run, on the tiny presets and the CPU: every raw figure and every
    gate figure is there, finite and positive, with its unit and direction; stdout's last line is
    the report; a baseline holds both kinds of figures and the default tolerance."""
    path = tmp_path / "short.json"
    assert main(["--tiny", "--output", str(path)]) == 0
    report = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert report["scale"]["name"] == "tiny"
    assert sorted(report["sections"]) == ["deepseek", "qwen3", "qwen3_eager", "references"]
    assert sorted(report["raw_figures"]) == sorted(RAW_FIGURES) and sorted(report["figures"]) == sorted(NORMALISED)
    for name, fig in report["raw_figures"].items():
        assert math.isfinite(fig["value"]) and fig["value"] > 0, (name, fig)
        assert (fig["unit"], fig["higher_is_better"]) == RAW_FIGURES[name]
    for name, fig in report["figures"].items():
        assert math.isfinite(fig["value"]) and fig["value"] > 0, (name, fig)
        assert (fig["unit"], fig["higher_is_better"]) == (NORMALISED[name][3], RAW_FIGURES[NORMALISED[name][0]][1])
    baseline = baseline_from(report)
    assert (baseline["figures"], baseline["raw_figures"], baseline["tolerance"], baseline["scale"]) == (
        report["figures"], report["raw_figures"], TOLERANCE, "tiny")


def test_a_baseline_is_only_written_at_full_scale(tmp_path):
    with pytest.raises(SystemExit):
        main(["--tiny", "--write-baseline", str(tmp_path / "baseline.json")])
    assert not (tmp_path / "baseline.json").exists()
