"""``python -m engine bench spec`` on the demo model (two requests per workload, CPU): both
engines give the same tokens, tokens per forward is output tokens over target forwards, the
speculative engine needs fewer forwards on the editing workload; ``scripts/record_benchmarks.py``
records from a CPU report only the figures no device changes (tokens per forward), and from a
GPU report the tok/s and, for a preset, the verify-step ratio too."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.__main__ import main as engine_main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import record_benchmarks  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "spec.json"
    assert engine_main(["bench", "spec", "--num-requests", "2", "--verify-context", "64", "--verify-steps", "2",
                        "--output", str(path)]) == 0
    return json.loads(path.read_text())


def test_the_workloads_give_plain_tokens_in_fewer_forwards(report):
    edit = report["workloads"]["edit"]
    for run in report["workloads"].values():
        assert run["same_tokens"]
        for figures in (run["plain"], run["spec"]):
            assert figures["tokens_per_forward"] == figures["output_tokens"] / figures["forwards"]
        assert run["plain"]["output_tokens"] == run["spec"]["output_tokens"]
        assert 0 <= run["spec"]["accepted_tokens"] <= run["spec"]["draft_tokens"]
    assert edit["spec"]["forwards"] < edit["plain"]["forwards"] and edit["plain"]["tokens_per_forward"] == 1.0
    verify = report["verify_step"]
    assert verify["num_drafts"] == 4 and verify["ratio"] == verify["verify_ms"] / verify["decode_ms"]


def test_record_keeps_device_free_figures_of_a_cpu_report(report, tmp_path):
    path, into = tmp_path / "spec.json", tmp_path / "benchmarks.json"
    path.write_text(json.dumps(report))
    assert record_benchmarks.main([str(path), "--into", str(into)]) == 0
    figures = json.loads(into.read_text())["figures"]
    assert sorted(figures) == ["spec_ngram_edit_tokens_per_forward", "spec_ngram_plain_tokens_per_forward"]
    edit = figures["spec_ngram_edit_tokens_per_forward"]
    assert edit["value"] == report["workloads"]["edit"]["spec"]["tokens_per_forward"]
    assert edit["peer"]["plain_forwards"] == report["workloads"]["edit"]["plain"]["forwards"]
    assert edit["command"].startswith("python -m engine bench spec --num-requests 2")
    gpu = {**report, "machine": {**report["machine"], "device": "NVIDIA H200"},
           "model": {"source": "preset qwen3-8b"}}
    named = record_benchmarks.figures_of(gpu)
    assert named["qwen3_8b_spec_verify_k4_ratio"]["value"] == report["verify_step"]["ratio"]
    assert named["demo_spec_ngram_edit_b1_tok_s"]["value"] == report["workloads"]["edit"]["spec"]["tok_s"]
