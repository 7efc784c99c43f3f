"""``scripts/record_benchmarks.py``: benchmark reports -> named figures in benchmarks.json.

A latency report measured here (tiny preset, CPU) maps to its names with a command that
parses back to the same settings; CPU reports are refused by the command line; a full-scale
short report (host A's recorded figures, ``recorded_hosts.json``, in the shape ``run_short``
reports) and a floors report merge into an existing file, keeping its other figures; a
``bench serve --structured`` report records its constrained / plain throughput ratios.
BENCHMARKS.md is the rendering of benchmarks.json (checked in, never edited by hand): the two
never drift apart, and the renderer shows every figure once, in its group, in a fixed order.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.__main__ import main as engine_main
from engine.entrypoints.bench import add_bench_command
from engine.entrypoints.bench.short import FULL, RAW_FIGURES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import record_benchmarks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads(Path(__file__).with_name("recorded_hosts.json").read_text())["hosts"]
MACHINE = {"device": "NVIDIA H200", "time": "2026-11-29T23:17:44+0000", "host": "vm"}


@pytest.fixture(scope="module")
def latency_report(tmp_path_factory) -> tuple[Path, dict]:
    """A real ``bench latency`` report of the tiny Qwen3 preset, eager, synchronous steps, on the CPU."""
    path = tmp_path_factory.mktemp("bench") / "latency.json"
    assert engine_main(["bench", "latency", "--preset", "tiny-qwen3", "--random-weights", "--enforce-eager",
                        "--no-overlap", "--device", "cpu",
                        "--max-model-len", "64", "--prompt-lens", "16", "--repeats", "1", "--decode-tokens", "4",
                        "--decode-prompt-len", "8", "--split-steps", "2", "--output", str(path)]) == 0
    return path, json.loads(path.read_text())


def test_a_latency_report_maps_to_named_figures_with_a_command_that_reproduces_it(latency_report):
    _, report = latency_report
    figures = record_benchmarks.figures_of(report)
    assert sorted(figures) == ["tiny_qwen3_b1_eager_no_overlap_tok_s", "tiny_qwen3_prefill_16_no_overlap_tok_s",
                               "tiny_qwen3_ttft_16_no_overlap_ms"]
    decode, prefill = figures["tiny_qwen3_b1_eager_no_overlap_tok_s"], figures["tiny_qwen3_prefill_16_no_overlap_tok_s"]
    assert (decode["value"], decode["unit"]) == (report["decode"]["tok_s"], "tok/s")
    (ttft,) = report["ttft"]
    assert prefill["value"] == pytest.approx(16 / (ttft["ms"] / 1e3))
    assert figures["tiny_qwen3_ttft_16_no_overlap_ms"]["value"] == ttft["ms"]
    for figure in figures.values():
        assert (figure["date"], figure["device"]) == (report["machine"]["time"], report["machine"]["device"])
    words = shlex.split(decode["command"])
    assert words[:5] == ["python", "-m", "engine", "bench", "latency"]
    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers(dest="command"))
    settings = {k: v for k, v in vars(parser.parse_args(words[3:])).items() if k not in ("run", "command")}
    assert settings == report["settings"]


def test_fp8_and_overlapped_runs_have_their_own_names(latency_report):
    """The default (overlapped) bf16 run owns the headline names; an FP8 run adds ``_fp8`` after the
    model, an FP8 KV cache ``_fp8kv`` after the mode, so none replaces another's figures."""
    _, report = latency_report
    variants = {"bf16": {"overlap": True}, "fp8": {"overlap": True, "quantization": "fp8"},
                "fp8kv": {"overlap": True, "kv_cache_dtype": "fp8"}}
    names = {kind: sorted(record_benchmarks.figures_of(
        {**report, "command": "c", "settings": {**report["settings"], **change}})) for kind, change in variants.items()}
    assert names == {"bf16": ["tiny_qwen3_b1_eager_tok_s", "tiny_qwen3_prefill_16_tok_s", "tiny_qwen3_ttft_16_ms"],
                     "fp8": ["tiny_qwen3_fp8_b1_eager_tok_s", "tiny_qwen3_fp8_prefill_16_tok_s",
                             "tiny_qwen3_fp8_ttft_16_ms"],
                     "fp8kv": ["tiny_qwen3_b1_eager_fp8kv_tok_s", "tiny_qwen3_prefill_16_fp8kv_tok_s",
                               "tiny_qwen3_ttft_16_fp8kv_ms"]}


def test_cpu_reports_are_refused_and_nothing_is_written(latency_report, tmp_path):
    path, _ = latency_report
    into = tmp_path / "benchmarks.json"
    with pytest.raises(SystemExit):
        record_benchmarks.main([str(path), "--into", str(into)])
    assert not into.exists()


def short_report() -> dict:
    """The full-scale short benchmark's report as ``run_short`` shapes it, with host A's recorded figures."""
    raw = RECORDED["two-gpu host, 2026-11-29"]["raw_figures"]
    return {"bench": "short", "command": "python -m engine.entrypoints.bench.short --output short.json",
            "machine": MACHINE,
            "scale": {"name": "full", "qwen3": FULL.qwen3, "deepseek": FULL.deepseek, "prefill_len": FULL.prefill_len},
            "raw_figures": {name: {"value": value, "unit": RAW_FIGURES[name][0],
                                   "higher_is_better": RAW_FIGURES[name][1]} for name, value in raw.items()}}


def test_gpu_reports_merge_into_benchmarks_json(tmp_path):
    floors = {"bench": "floors", "command": "python scripts/bench_floors.py --json floors.json", "machine": MACHINE,
              "preset": "qwen3-8b", "copy_gb_s": 4250.0, "copy_floor_tok_s": 259.4, "prefill_gemm_tok_s": 48989.0,
              "gemm_tflops": 680.0, "matmul_chain_tok_s": 236.0}
    paths = []
    for name, report in (("short", short_report()), ("floors", floors)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    into = tmp_path / "benchmarks.json"
    kept = {"value": 1.0, "unit": "x", "command": "c", "date": "d", "device": "g", "peer": {}}
    into.write_text(json.dumps({"figures": {"older_figure": kept}}))
    assert record_benchmarks.main([*map(str, paths), "--into", str(into)]) == 0
    figures = json.loads(into.read_text())["figures"]
    raw = RECORDED["two-gpu host, 2026-11-29"]["raw_figures"]
    assert figures["older_figure"] == kept
    assert figures["qwen3_8b_b1_graphs_tok_s"]["value"] == raw["qwen3_decode_b1_tok_s"]
    assert figures["qwen3_8b_b1_graphs_tok_s"]["peer"] == {"matmul_chain_tok_s": raw["matmul_chain_tok_s"]}
    assert figures["qwen3_8b_b1_eager_tok_s"]["value"] == raw["qwen3_eager_decode_b1_tok_s"]
    assert figures["qwen3_8b_prefill_4096_tok_s"]["value"] == raw["qwen3_prefill_tok_s"]
    assert figures["dsv2_lite_b1_graphs_tok_s"]["value"] == raw["deepseek_decode_b1_tok_s"]
    # the floors report came last: its chain replaces the short run's, with its own command and peers
    chain = figures["qwen3_8b_matmul_chain_tok_s"]
    assert (chain["value"], chain["command"], chain["peer"]["copy_gb_s"]) == (236.0, floors["command"], 4250.0)
    short_command = "python -m engine.entrypoints.bench.short --output short.json"
    assert figures["qwen3_8b_b1_graphs_tok_s"]["command"] == short_command
    assert {figure["device"] for figure in figures.values()} == {"NVIDIA H200", "g"}
    assert set(kept) <= set(chain) and chain["date"] == MACHINE["time"]
    # --only: just the matching figures of a report; the others stay as they were
    only = tmp_path / "only.json"
    only.write_text(json.dumps({"figures": {"qwen3_8b_b1_graphs_tok_s": kept}}))
    assert record_benchmarks.main([str(paths[0]), "--into", str(only), "--only", "qwen3_8b_prefill_.*"]) == 0
    prefill = figures["qwen3_8b_prefill_4096_tok_s"]
    assert json.loads(only.read_text())["figures"] == {"qwen3_8b_b1_graphs_tok_s": kept,
                                                      "qwen3_8b_prefill_4096_tok_s": prefill}


def test_gpu_busy_is_read_from_the_timed_run_when_the_report_has_it():
    settings = {"num_seqs": 256, "min_len": 100, "max_len": 1024}
    device = {"util_pct_mean": 60.0}
    report = {"bench": "throughput", "command": "c", "machine": MACHINE, "model": {"source": "preset qwen3-8b"},
              "settings": settings, "throughput": {"output_tok_s": 1.0}, "gpu_monitor": {"devices": [device]}}
    whole = record_benchmarks.figures_of(report)["qwen3_8b_throughput_gpu_busy_pct"]
    report["gpu_monitor"]["timed_run"] = {"devices": [{"util_pct_mean": 95.0}]}
    timed = record_benchmarks.figures_of(report)["qwen3_8b_throughput_gpu_busy_pct"]
    assert (whole["value"], timed["value"]) == (60.0, 95.0)
    assert timed["from"].startswith("gpu_monitor.timed_run")
    capped = {**report, "settings": {**settings, "prefill_tokens_beside_decodes": 384, "kv_cache_dtype": "fp8"}}
    assert sorted(record_benchmarks.figures_of(capped)) == [  # an A/B run has its own names, in serve's order
        "qwen3_8b_throughput_beside384_fp8kv_gpu_busy_pct", "qwen3_8b_throughput_beside384_fp8kv_out_tok_s"]


def test_a_throughput_run_off_nano_vllms_shape_has_no_headline_name():
    report = {"bench": "throughput", "machine": MACHINE, "model": {"source": "preset qwen3-8b"},
              "settings": {"num_seqs": 64, "min_len": 100, "max_len": 1024}, "throughput": {"output_tok_s": 1.0}}
    with pytest.raises(ValueError, match="nano-vllm's shape"):
        record_benchmarks.figures_of(report)


def structured_serve_report(**change) -> dict:
    """A ``bench serve --structured`` report of the Qwen3-8B preset in the bench's shape (its
    settings parsed by the bench's own parser), both workloads complete and valid."""
    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers(dest="command"))
    argv = ["bench", "serve", "--launch", "--preset", "qwen3-8b", "--random-weights", "--tokenizer", "tok",
            "--structured", "json_schema,tools", "--num-prompts", "8", "--max-concurrency", "64"]
    settings = {k: v for k, v in vars(parser.parse_args(argv)).items() if k not in ("run", "command")}
    settings["request_rate"] = "inf"  # as the report writes it

    def workload(name, ratio):
        side = {"completed": 8, "output_throughput": 1000.0, "itl_ms": {"median": 10.0, "p99": 20.0}}
        return {"workload": name, "plain": side, "constrained": {**side, "output_throughput": 1000.0 * ratio},
                "constrained_valid": 8, "constrained_invalid": 0, "first_invalid": None,
                "structured_vs_plain_throughput_ratio": ratio, "itl_p99_ratio": 1.5, "compile_ms_cold": 30.0,
                "compile_ms_cached": 0.01, "mask_fill_us_per_step": 300.0, "mask_rows": 64, "mask_steps": 200}

    return {"bench": "serve", "machine": MACHINE, "settings": {**settings, **change},
            "serve": {"url": "http://127.0.0.1:1", "structured": {"json_schema": workload("json_schema", 0.9),
                                                                  "tools": workload("tools", 0.8)}}}


def test_a_structured_serve_report_records_the_constrained_over_plain_ratios():
    """bench serve --structured: each workload's constrained / plain output tok/s under a name of
    the preset, its peers the two sides' tok/s and the grammar's costs, with a command that parses
    back to the run's settings; a run with a failed or invalid answer and a checkpoint's server have
    no figure."""
    report = structured_serve_report()
    figures = record_benchmarks.figures_of(report)
    assert sorted(figures) == ["qwen3_8b_structured_vs_plain_throughput_ratio",
                               "qwen3_8b_tools_vs_plain_throughput_ratio"]
    headline = figures["qwen3_8b_structured_vs_plain_throughput_ratio"]
    assert (headline["value"], headline["unit"], headline["device"]) == (0.9, "x", "NVIDIA H200")
    assert headline["peer"]["constrained_out_tok_s"] == 900.0 and headline["peer"]["mask_fill_us_per_step"] == 300.0
    assert figures["qwen3_8b_tools_vs_plain_throughput_ratio"]["value"] == 0.8
    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers(dest="command"))
    parsed = {k: v for k, v in vars(parser.parse_args(shlex.split(headline["command"])[3:])).items()
              if k not in ("run", "command")}
    assert {**parsed, "request_rate": "inf"} == report["settings"]
    skipped = structured_serve_report()
    skipped["serve"]["structured"]["tools"] = {"workload": "tools", "skipped": "no chat template"}
    assert sorted(record_benchmarks.figures_of(skipped)) == ["qwen3_8b_structured_vs_plain_throughput_ratio"]
    invalid = structured_serve_report()
    invalid["serve"]["structured"]["json_schema"]["constrained_valid"] = 7
    with pytest.raises(ValueError, match="constrained answers valid"):
        record_benchmarks.figures_of(invalid)
    with pytest.raises(ValueError, match="checkpoint"):
        record_benchmarks.figures_of(structured_serve_report(preset=None, random_weights=False))


def test_a_plain_serve_report_records_throughput_itl_and_ttft_under_its_concurrency_and_budget():
    """bench serve (plain load): output tok/s, ITL median and p99, TTFT p99 under the preset's name
    and the concurrency, ``_budget<N>``, ``_beside<N>``, ``_eager``, ``_prefill_graphs<N>``, ``_fp8kv`` when those
    settings are not the default (no run replaces another's figures); a run with a failed request,
    or without a concurrency cap, has no figure."""
    report = structured_serve_report(structured=None, input_len=512, output_len=128, num_prompts=8)
    report["serve"] = {"completed": 8, "output_throughput": 5000.0, "itl_ms": {"median": 6.5, "p99": 23.0},
                       "ttft_ms": {"median": 60.0, "p99": 900.0}}
    figures = record_benchmarks.figures_of(report)
    assert {name: figure["value"] for name, figure in figures.items()} == {
        "qwen3_8b_serve_c64_out_tok_s": 5000.0, "qwen3_8b_serve_c64_itl_p50_ms": 6.5,
        "qwen3_8b_serve_c64_itl_p99_ms": 23.0, "qwen3_8b_serve_c64_ttft_p99_ms": 900.0}
    assert figures["qwen3_8b_serve_c64_itl_p99_ms"]["peer"]["max_num_batched_tokens"] == 8192
    for change, name in (({"max_num_batched_tokens": 1024}, "qwen3_8b_serve_c64_budget1024_itl_p99_ms"),
                         ({"prefill_graph_tokens": 0, "enforce_eager": True},
                          "qwen3_8b_serve_c64_eager_prefill_graphs0_itl_p99_ms"),
                         ({"kv_cache_dtype": "fp8"}, "qwen3_8b_serve_c64_fp8kv_itl_p99_ms"),
                         ({"max_num_batched_tokens": 2048, "prefill_tokens_beside_decodes": 0},
                          "qwen3_8b_serve_c64_budget2048_beside0_itl_p99_ms")):
        assert name in record_benchmarks.figures_of({**report, "settings": {**report["settings"], **change}})
    with pytest.raises(ValueError, match="7 of 8 requests completed"):
        record_benchmarks.figures_of({**report, "serve": {**report["serve"], "completed": 7}})
    with pytest.raises(ValueError, match="needs --max-concurrency"):
        record_benchmarks.figures_of({**report, "settings": {**report["settings"], "max_concurrency": None}})


def test_benchmarks_md_is_the_rendering_of_benchmarks_json():
    """The checked-in BENCHMARKS.md is generated: it must equal the rendering of the checked-in
    benchmarks.json, so no figure is typed in and the two cannot drift apart."""
    figures = json.loads((ROOT / "benchmarks.json").read_text())["figures"]
    rendered = record_benchmarks.render_markdown(figures)
    assert (ROOT / "BENCHMARKS.md").read_text() == rendered, (
        "BENCHMARKS.md differs from benchmarks.json's rendering: run "
        "`python scripts/record_benchmarks.py --markdown BENCHMARKS.md` (never edit it by hand)")


def test_recording_without_reports_renders_the_markdown_beside_the_figures(tmp_path):
    """No report: the command line only renders BENCHMARKS.md beside --into (or --markdown PATH),
    leaving the figures as they are; recording a report rewrites both."""
    into = tmp_path / "benchmarks.json"
    kept = {"value": 1.5, "unit": "x", "command": "c", "date": "2026-01-02T00:00:00+0000", "device": "g", "peer": {}}
    into.write_text(json.dumps({"figures": {"older_figure": kept}}))
    before = into.read_text()
    assert record_benchmarks.main(["--into", str(into)]) == 0
    assert into.read_text() == before
    assert (tmp_path / "BENCHMARKS.md").read_text() == record_benchmarks.render_markdown({"older_figure": kept})
    elsewhere = tmp_path / "docs" / "figures.md"
    elsewhere.parent.mkdir()
    assert record_benchmarks.main(["--into", str(into), "--markdown", str(elsewhere)]) == 0
    assert elsewhere.read_text() == (tmp_path / "BENCHMARKS.md").read_text()
    with pytest.raises(SystemExit):
        record_benchmarks.main(["--into", str(into), "--no-markdown"])  # nothing to do
    with pytest.raises(SystemExit):
        record_benchmarks.main(["--into", str(tmp_path / "missing.json")])
    floors = {"bench": "floors", "command": "python scripts/bench_floors.py", "machine": MACHINE,
              "preset": "qwen3-8b", "copy_gb_s": 4250.0, "copy_floor_tok_s": 259.4, "prefill_gemm_tok_s": 48989.0,
              "gemm_tflops": 680.0, "matmul_chain_tok_s": 236.0}
    report = tmp_path / "floors.json"
    report.write_text(json.dumps(floors))
    assert record_benchmarks.main([str(report), "--into", str(into)]) == 0
    markdown = (tmp_path / "BENCHMARKS.md").read_text()
    assert "`qwen3_8b_matmul_chain_tok_s`" in markdown and "`older_figure`" in markdown


# Figure names in the shapes record_benchmarks writes (and one it does not), with their group.
NAME_SHAPES = [("{m}_b1_graphs_tok_s", "decode"), ("{m}_fp8_b1_eager_no_overlap_tok_s", "decode"),
               ("{m}_prefill_4096_tok_s", "prefill"), ("{m}_ttft_128_prefill_graphs0_ms", "prefill"),
               ("{m}_throughput_out_tok_s", "throughput"), ("{m}_throughput_fp8kv_gpu_busy_pct", "throughput"),
               ("{m}_serve_c64_budget768_itl_p99_ms", "serve"), ("{m}_serve_c8_out_no_overlap_tok_s", "serve"),
               ("spec_ngram_{m}_tokens_per_forward", "speculative"), ("demo_spec_ngram_{m}_b1_tok_s", "speculative"),
               ("{m}_spec_verify_k4_ratio", "speculative"), ("{m}_structured_vs_plain_throughput_ratio", "structured"),
               ("{m}_tools_vs_plain_throughput_ratio", "structured"), ("{m}_matmul_chain_tok_s", "floors"),
               ("{m}_something_else", "other")]
FIGURE = st.fixed_dictionaries({
    "value": st.one_of(st.floats(min_value=-1e7, max_value=1e7, allow_nan=False), st.integers(-10**6, 10**6)),
    "unit": st.sampled_from(["tok/s", "ms", "%", "x", "tokens/forward"]),
    "command": st.text(st.sampled_from("abcxyz -_/.=|`,"), min_size=1, max_size=40).filter(str.strip),
    "date": st.sampled_from(["2026-12-02T00:50:47+0000", "2026-01-31T23:59:59+0000"]),
    "device": st.sampled_from(["NVIDIA H200", "cpu (x86_64, 2 threads)", "NVIDIA H100 | 80GB"]),
    "peer": st.dictionaries(st.sampled_from(["plain_tok_s", "copy_gb_s", "same_tokens"]),
                            st.one_of(st.booleans(), st.floats(0, 1e5, allow_nan=False), st.integers(0, 10**5)))})
NAMES = st.dictionaries(st.tuples(st.sampled_from(range(len(NAME_SHAPES))),
                                  st.sampled_from(["qwen3_8b", "dsv2_lite", "llama3_8b", "edit", "m"])),
                        FIGURE, min_size=1, max_size=12)


def _cells(row: str) -> list[str]:
    """A markdown table row's cells (pipes escaped as \\| stay in their cell)."""
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _code_span(cell: str) -> str:
    """The text of a markdown code span (CommonMark: the fence's backticks off, then one space off
    each side when both are there)."""
    fence = re.match(r"`+", cell).group()
    assert cell.endswith(fence), cell
    inner = cell[len(fence):-len(fence)]
    return inner[1:-1] if inner.startswith(" ") and inner.endswith(" ") and inner.strip() else inner


@settings(max_examples=60, deadline=None)
@given(NAMES, st.randoms(use_true_random=False))
def test_the_markdown_shows_every_figure_once_in_its_group_in_a_fixed_order(drawn, rnd: random.Random):
    """Rendering synthetic figures: one table row per figure, holding its name, rounded value and
    unit, device, day and command; the row sits under its group's heading, groups in GROUPS' order
    and names sorted within each; the text does not depend on the figures' order in the dict."""
    figures = {NAME_SHAPES[shape][0].format(m=model): figure for (shape, model), figure in drawn.items()}
    expected_group = {NAME_SHAPES[shape][0].format(m=model): NAME_SHAPES[shape][1] for shape, model in drawn}
    text = record_benchmarks.render_markdown(figures)
    items = list(figures.items())
    rnd.shuffle(items)
    assert record_benchmarks.render_markdown(dict(items)) == text
    headings = {heading: group for group, (heading, _) in record_benchmarks.GROUPS.items()}
    group, rows = None, []
    for line in text.splitlines():
        if line.startswith("## "):
            group = headings[line[3:]]
        elif line.startswith("| `"):
            rows.append((group, _cells(line)))
    assert [name.strip("`") for _, (name, *_) in rows] == sorted(figures, key=lambda n: (
        list(record_benchmarks.GROUPS).index(expected_group[n]), n))
    for group, (name, value, peers, device, day, command) in rows:
        figure = figures[name.strip("`")]
        assert group == expected_group[name.strip("`")] == record_benchmarks.group_of(name.strip("`"))
        assert value == f"{record_benchmarks.format_number(figure['value'])} {figure['unit']}"
        assert (device, day) == (figure["device"], figure["date"][:10])
        assert _code_span(command) == " ".join(figure["command"].split())
        for key, peer in figure["peer"].items():
            assert f"{key} {record_benchmarks.format_number(peer)}" in peers
    assert "do not edit by hand" in text and "--markdown BENCHMARKS.md" in text


def test_values_are_rounded_for_reading():
    assert [record_benchmarks.format_number(v) for v in (40299.38785, 257.4488, 98.0769, 1.031064, 0.7026548, 3253,
                                                         True, 6.848912)] == [
        "40,299", "257.4", "98.08", "1.031", "0.7027", "3,253", "true", "6.849"]
