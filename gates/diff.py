"""What changed between two gate reports (``python -m gates diff OLD.json NEW.json``), and the
comparison of benchmark figures with a baseline that the performance gate (phase 11) makes.

A benchmark figure is ``{"value", "unit", "higher_is_better"}`` (``engine.entrypoints.bench.short``); the
performance gate's test records the figures it compares in the gate report
(``record_property("figures", ...)``: normalised, each stated against a reference measured in
the same run, so they hold from one H200 host to another) and the raw figures they came from
(``record_property("raw_figures", ...)``), both kept by ``gates.pytest_plugin``. The diff prints
phases whose status changed, tests whose outcome flipped (or that are new or gone) in runs that
ran in both reports, runs that slowed, every compared figure that changed, and the raw figures
(shown, never a regression: they move with the host). Something *regressed* when a phase that passed no longer
passes (a phase now skipped lost its coverage) or one that was skipped now fails or is blocked, a
test that passed is now skipped, gone, failing or erroring (or a skipped one fails or errors), a
run is slower by more than ``slower`` (relative) and ``MIN_SLOWER_S``, or a figure is worse than
before by more than the tolerance (a baseline of 0: by anything), or is gone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gates.execute import FAILING, run_label

DEFAULT_TOLERANCE = 0.10
DEFAULT_SLOWER = 0.25
MIN_SLOWER_S = 5.0
BAD_PHASE = ("FAIL", "BLOCKED")


@dataclass
class FigureChange:
    """A figure in ``old`` and/or ``new``; ``change`` is new / old - 1 (None when either is absent)."""
    name: str
    unit: str
    old: float | None
    new: float | None
    change: float | None
    regressed: bool

    def line(self) -> str:
        old = "absent" if self.old is None else f"{self.old:.4g}"
        new = "absent" if self.new is None else f"{self.new:.4g}"
        change = "" if self.change is None else f" ({self.change:+.1%})"
        return f"{self.name}: {old} -> {new} {self.unit}{change}"


def _value(figure: dict | None) -> float | None:
    value = figure.get("value") if isinstance(figure, dict) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def figure_changes(old: dict, new: dict, tolerance: float) -> list[FigureChange]:
    """Every figure of ``old`` or ``new`` (name -> figure). A figure regressed when it is worse
    than in ``old`` by more than ``tolerance`` (relative, in its own direction; from a baseline of
    0, e.g. allocations per step, any worse value), or when ``old`` has it and ``new`` does not
    (or holds no finite value)."""
    changes = []
    for name in [*old, *(n for n in new if n not in old)]:
        before, after = _value(old.get(name)), _value(new.get(name))
        figure = new.get(name) if name in new else old[name]
        sign = 1 if figure.get("higher_is_better", True) else -1
        change = after / before - 1 if before and after is not None else None
        if change is not None:
            worse = -sign * change > tolerance
        else:
            worse = before == 0 and after is not None and sign * after < 0
        regressed = worse or (name in old and after is None)
        changes.append(FigureChange(name, figure.get("unit", ""), before, after, change, regressed))
    return changes


def compare(figures: dict, baseline: dict, tolerance: float) -> list[FigureChange]:
    """The regressions of ``figures`` against ``baseline`` (both name -> figure): a figure worse by
    more than ``tolerance`` (0.1: 10 % fewer tok/s, or 10 % more us for a lower-is-better figure),
    or missing. An improvement, or a figure the baseline lacks, is no regression."""
    return [c for c in figure_changes(baseline, figures, tolerance) if c.regressed]


def report_figures(report: dict, kind: str = "figures") -> tuple[dict, float | None]:
    """(every benchmark figure tests recorded in a gate report under ``kind``: "figures", the
    compared ones, or "raw_figures"; the tolerance recorded with them)."""
    figures, tolerance = {}, None
    for phase in report["phases"]:
        for run in phase.get("runs", []):
            for test in run.get("test_results", []):
                properties = test.get("properties", {})
                figures.update(properties.get(kind, {}))
                tolerance = properties.get("figure_tolerance", tolerance)
    return figures, tolerance


def _runs(report: dict) -> dict[tuple, dict]:
    """Runs that executed, by (phase, label)."""
    runs = {}
    for phase in report["phases"]:
        for run in phase.get("runs", []):
            if run.get("command"):
                runs[phase["id"], run_label(run["mode"], run["nproc"]), tuple(run["tests"])] = run
    return runs


def _outcomes(run: dict) -> dict[str, str] | None:
    """nodeid -> outcome of every test of ``run`` (None: an older report, which lists failures only)."""
    return {t["nodeid"]: t["outcome"] for t in run["test_results"]} if "test_results" in run else None


def phase_changes(old: dict, new: dict) -> list[tuple[str, bool]]:
    before = {p["id"]: p["status"] for p in old["phases"]}
    after = {p["id"]: p["status"] for p in new["phases"]}
    lines = []
    for pid in sorted(before.keys() | after.keys()):
        a, b = before.get(pid, "absent"), after.get(pid, "absent")
        if a != b:
            lines.append((f"{pid}: {a} -> {b}", a == "PASS" or (a not in BAD_PHASE and b in BAD_PHASE)))
    return lines


def flipped_tests(old_runs: dict, new_runs: dict) -> list[tuple[str, bool]]:
    lines = []
    for key in [k for k in old_runs if k in new_runs]:
        label = "" if key[1] == "single" else f" [{key[1]}]"
        before, after = _outcomes(old_runs[key]), _outcomes(new_runs[key])
        if before is None or after is None:  # only the failing tests are known
            before = {t["nodeid"]: t["outcome"] for t in old_runs[key]["failing"]}
            after = {t["nodeid"]: t["outcome"] for t in new_runs[key]["failing"]}
            absent = "not failing"
        else:
            absent = "absent"
        for nodeid in [*before, *(n for n in after if n not in before)]:
            a, b = before.get(nodeid, absent), after.get(nodeid, absent)
            if a != b:
                lines.append((f"{nodeid}{label}: {a} -> {b}", a == "passed" or (a not in FAILING and b in FAILING)))
    return lines


def slowed_runs(old_runs: dict, new_runs: dict, slower: float) -> list[tuple[str, bool]]:
    lines = []
    for key in [k for k in old_runs if k in new_runs]:
        a, b = old_runs[key]["duration_s"], new_runs[key]["duration_s"]
        if b > a * (1 + slower) and b - a >= MIN_SLOWER_S:
            lines.append((f"{key[0]} {key[1]} {' '.join(key[2])}: {a:.1f} s -> {b:.1f} s ({b / a - 1:+.0%})", True))
    return lines


def diff(old: dict, new: dict, tolerance: float | None = None, slower: float = DEFAULT_SLOWER) -> tuple[str, bool]:
    """(the readable diff of two gate reports, whether something regressed). ``tolerance``:
    of the benchmark figures; default the one recorded in ``new``, else DEFAULT_TOLERANCE."""
    old_figures, _ = report_figures(old)
    new_figures, recorded = report_figures(new)
    tolerance = tolerance if tolerance is not None else recorded if recorded is not None else DEFAULT_TOLERANCE
    old_runs, new_runs = _runs(old), _runs(new)
    figures = [(c.line(), c.regressed) for c in figure_changes(old_figures, new_figures, tolerance)
               if c.change != 0 or c.regressed]
    raw = [(c.line(), False) for c in figure_changes(report_figures(old, "raw_figures")[0],
                                                     report_figures(new, "raw_figures")[0], tolerance)
           if c.change != 0]
    sections = [("phases whose status changed", phase_changes(old, new)),
                ("tests that flipped (runs that ran in both)", flipped_tests(old_runs, new_runs)),
                (f"runs slower by more than {slower:.0%} and {MIN_SLOWER_S:g} s", slowed_runs(old_runs, new_runs,
                                                                                               slower)),
                (f"benchmark figures (tolerance {tolerance:.0%})", figures),
                ("raw benchmark figures (not compared: they move with the host)", raw)]
    out = [f"old: {old.get('command', '?')} ({old.get('machine', {}).get('timestamp', '?')})",
           f"new: {new.get('command', '?')} ({new.get('machine', {}).get('timestamp', '?')})"]
    for title, lines in sections:
        out.append(f"\n{title}:" + ("" if lines else " none"))
        out += [f"  {line}" + "  REGRESSION" * bad for line, bad in lines]
    regressions = sum(bad for _, lines in sections for _, bad in lines)
    out.append(f"\n{regressions} regression(s)" if regressions else "\nno regression")
    return "\n".join(out), regressions > 0
