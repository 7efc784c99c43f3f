"""``python -m engine bench serve --structured json_schema,tools`` on the demo model (CPU, short
settings): the report is complete (every documented key, finite numbers), every request of both
sides completes, every constrained answer validates against its schema (checked by the bench with
jsonschema, failures counted), and the tools workload is skipped, not failed, on a server whose
tokenizer has no chat template. No speed is asserted."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from engine.__main__ import main
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.entrypoints.bench import structured
from engine.entrypoints.bench.serve import RequestResult

TEMPLATE = Path(structured.__file__).with_name("hermes_tools.jinja")
SIDE_KEYS = ("completed", "failed", "output_tokens", "output_throughput", "ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")
WORKLOAD_KEYS = ("plain", "constrained", "constrained_valid", "constrained_invalid", "first_invalid",
                 "structured_vs_plain_throughput_ratio", "itl_p99_ratio", "compile_ms_cold", "compile_ms_cached",
                 "mask_fill_us_per_step", "mask_rows", "mask_steps", "note")
NUM_PROMPTS, OUTPUT_LEN = 2, 128  # the longest answer of either schema is about 110 tokens


def bench_structured(capsys, *extra) -> dict:
    assert main(["bench", "serve", "--launch", "--device", "cpu", "--num-prompts", str(NUM_PROMPTS), "--input-len",
                 "12", "--output-len", str(OUTPUT_LEN), "--max-concurrency", "2", "--mask-steps", "20", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_structured_report_is_complete_and_every_answer_validates(capsys):
    report = bench_structured(capsys, "--structured", "json_schema,tools", "--chat-template", str(TEMPLATE))
    assert report["bench"] == "serve"
    workloads = report["serve"]["structured"]
    assert set(workloads) == {"json_schema", "tools"}
    for name, w in workloads.items():
        assert w["workload"] == name and all(k in w for k in WORKLOAD_KEYS), (name, sorted(w))
        for side in ("plain", "constrained"):
            s = w[side]
            assert all(k in s for k in SIDE_KEYS), (name, side, sorted(s))
            assert s["completed"] == NUM_PROMPTS and s["failed"] == 0, (name, side, s["first_error"])
            assert finite(s["output_throughput"]) and s["output_throughput"] > 0
            assert all(finite(s[m][q]) for m in ("ttft_ms", "itl_ms") for q in ("median", "p99")), (name, side)
        assert w["plain"]["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: every plain answer runs out
        assert 0 < w["constrained"]["output_tokens"] < NUM_PROMPTS * OUTPUT_LEN  # ended by the grammar
        assert w["constrained_valid"] == NUM_PROMPTS and w["constrained_invalid"] == 0, w["first_invalid"]
        for key in ("structured_vs_plain_throughput_ratio", "itl_p99_ratio", "compile_ms_cold", "compile_ms_cached",
                    "mask_fill_us_per_step"):
            assert finite(w[key]) and w[key] > 0, (name, key, w[key])
        assert w["structured_vs_plain_throughput_ratio"] == pytest.approx(
            w["constrained"]["output_throughput"] / w["plain"]["output_throughput"])
        assert w["mask_rows"] == 64 and w["mask_steps"] == 20


def test_tools_are_skipped_without_a_chat_template(capsys, tmp_path):
    """The demo model with its chat template taken out of tokenizer_config.json: the tools workload
    says so and the bench ends well."""
    plain = Path(shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "no-template"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tools = bench_structured(capsys, "--model", str(plain), "--structured", "tools")["serve"]["structured"]["tools"]
    assert set(tools) == {"workload", "skipped"} and "no chat template" in tools["skipped"]


def test_invalid_answers_are_caught_and_counted():
    """validate names why an answer breaks its schema (bad JSON, a wrong field, a cut-off answer,
    a wrong tool or argument, no call or two); compare counts them."""
    good = {"name": "Ada", "age": 36, "status": "active", "tags": ["math"], "verified": True}

    def answer(text="", calls=(), finish="stop"):
        return RequestResult(1, ok=True, text=text, tool_calls=list(calls), finish_reason=finish)

    def call(name="get_weather", **arguments):
        return {"name": name, "arguments": json.dumps(arguments or {"city": "Paris", "unit": "celsius"})}

    assert structured.validate("json_schema", answer(json.dumps(good))) is None
    assert structured.validate("tools", answer(calls=[call()], finish="tool_calls")) is None
    bad = {"json_schema": [answer('{"name": "Ada"'), answer(json.dumps({**good, "age": 121})),
                           answer(json.dumps({**good, "status": "gone"})), answer(json.dumps({**good, "x": 1})),
                           answer(json.dumps(good), finish="length")],
           "tools": [answer(), answer(calls=[call(), call()]), answer(calls=[call("delete_all")]),
                     answer(calls=[call(city="Paris", unit="kelvin")]), answer(calls=[call(city="Paris")])]}
    for workload, answers in bad.items():
        reasons = [structured.validate(workload, a) for a in answers]
        assert all(reasons), (workload, reasons)
    side = {"completed": 5, "output_throughput": 10.0, "itl_ms": {"p99": 2.0}}
    summary = structured.compare("tools", side, {**side, "output_throughput": 5.0}, ["why"], {})
    assert (summary["constrained_valid"], summary["constrained_invalid"], summary["first_invalid"]) == (4, 1, "why")
    assert summary["structured_vs_plain_throughput_ratio"] == 0.5 and summary["itl_p99_ratio"] == 1.0


def test_a_preset_needs_a_tokenizer_for_structured_outputs(capsys):
    """A preset's one-word tokenizer spells no JSON: --structured asks for --tokenizer, before any
    load; --tokenizer without a preset and --chat-template without --launch are refused too."""
    preset = ["--preset", "tiny-qwen3", "--random-weights"]
    for argv, message in ((preset, "--structured with --preset needs --tokenizer DIR"),
                          (["--tokenizer", "engine/default_model"], "--tokenizer is for a --preset"),
                          (["--chat-template", str(TEMPLATE)], "--chat-template is passed to the server --launch")):
        assert main(["bench", "serve", *argv, "--structured", "json_schema", "--url", "http://127.0.0.1:9"]) != 0
        assert message in capsys.readouterr().err
