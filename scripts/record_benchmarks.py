"""Record the GPU figures of benchmark reports in ``benchmarks.json`` (the repository's figures,
written from the benchmarks' JSON, never typed in), and render them as ``BENCHMARKS.md``.

    python scripts/record_benchmarks.py REPORT.json [REPORT.json ...] [--into benchmarks.json] [--only REGEX]
    python scripts/record_benchmarks.py                          # BENCHMARKS.md again from benchmarks.json
    python scripts/record_benchmarks.py --markdown BENCHMARKS.md # the same, naming the file

``BENCHMARKS.md`` is generated (``render_markdown``), never edited by hand: every run rewrites the
``BENCHMARKS.md`` beside the ``--into`` file (``--markdown PATH`` names another, ``--no-markdown``
writes none), so recording figures updates both, and a run without reports only renders the file
again. ``phases/11_performance/test_record_benchmarks.py`` fails when the checked-in file differs
from the rendering of the checked-in ``benchmarks.json``.

Each report is the JSON of ``python -m engine bench latency | throughput | spec``, of
``python -m engine.entrypoints.bench.short`` (full scale) or of ``scripts/bench_floors.py``. Its figures are
mapped to the project's names (``figures_of``), each stored as ``{"value", "unit", "command",
"date", "device", "peer", "from"}``: the command that reproduces it, the report's date and
device, the peers measured in the same run (transformers, floors), and the report field it was
read from. Figures already in the file and not in these reports are kept. Reports measured on a
CPU are refused (benchmarks.json holds GPU figures), but for the figures no device changes
(``DEVICE_FREE``: tokens per target forward of speculative decoding, a count).

Names: ``<model>_b1_graphs_tok_s`` / ``_b1_eager_tok_s`` (B=1 decode), ``<model>_prefill_<N>_tok_s``
(one N-token prompt: N / TTFT), ``<model>_matmul_chain_tok_s`` (the cuBLAS floor),
``<model>_throughput_out_tok_s`` and ``_throughput_gpu_busy_pct`` (nano-vllm's shape only: 256
sequences, lengths 100-1024; busy = NVML utilisation, mean over the run; ``_throughput_fp8kv_...``
and ``_b1_graphs_fp8kv_...`` with an FP8 KV cache), with ``<model>`` the
preset: ``qwen3_8b``, ``dsv2_lite``, ... and ``_fp8`` after it for an FP8 run
(``qwen3_8b_fp8_b1_graphs_tok_s``); a run with synchronous steps (``--no-overlap``, the peer of
the overlapped default) adds ``_no_overlap`` before the unit (``qwen3_8b_b1_graphs_no_overlap_tok_s``);
``spec_<method>_<workload>_tokens_per_forward`` (bench spec
on a checkpoint, greedy: output tokens per target-model forward with the method's drafts — ngram,
draft, eagle3, mtp — the plain engine's forwards as peer), ``demo_spec_<method>_<workload>_b1_tok_s``
(the same run's tok/s, on a GPU), ``<model>_spec_verify_k<K>_ratio`` (a B=1 verify step of K drafts
over a decode step) and, for a model drafter, ``<model>_spec_<method>_draft_verify_k<K>_ratio``
(drafting K tokens plus the verify step, over a decode step);
from ``bench serve --structured`` (a preset, every request of both sides completed and every
constrained answer valid): ``<model>_structured_vs_plain_throughput_ratio`` (json_schema) and
``<model>_tools_vs_plain_throughput_ratio`` (a forced tool call), constrained over plain output
tok/s under the same load, with each side's tok/s, the ITL p99 ratio and the grammar's compile
and mask costs as peers; from a plain ``bench serve`` (a preset, ``--max-concurrency N``, every
request completed): ``<model>_serve_cN_out_tok_s``, ``_itl_p50_ms``, ``_itl_p99_ms`` and
``_ttft_p99_ms`` (``_serve_cN_budget<B>_...`` when the step's token budget is not the default,
then ``_beside<N>`` (``--prefill-tokens-beside-decodes``, on throughput figures too), ``_fp8kv``,
``_eager``, ``_prefill_graphs<N>`` likewise). Latency reports also give
``<model>_ttft_<N>_ms``, the TTFT of one N-token prompt (``_prefill_graphs<N>`` after N when set).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_NAMES = {"deepseek-v2-lite": "dsv2_lite"}
NANO_VLLM_SHAPE = {"num_seqs": 256, "min_len": 100, "max_len": 1024}


def model_name(preset: str) -> str:
    """The figure-name prefix of a preset: qwen3-8b -> qwen3_8b, deepseek-v2-lite -> dsv2_lite."""
    return MODEL_NAMES.get(preset, re.sub(r"[^0-9a-z]+", "_", preset.lower()))


def bench_command(report: dict) -> str:
    """The ``python -m engine bench MODE ...`` command line of a bench report: every setting that
    differs from the parser's default, as its option (the engine's through EngineArgs, whose
    flags may be negative, ``--no-overlap``; the rest as ``--name-with-dashes``)."""
    from dataclasses import fields

    from engine.core.engine_args import EngineArgs
    from engine.entrypoints.bench import add_bench_command

    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers(dest="command"))
    defaults = vars(parser.parse_args(["bench", report["bench"]]))
    settings = report["settings"]
    engine_fields = {f.name for f in fields(EngineArgs)}
    words = ["python", "-m", "engine", "bench", report["bench"]]
    words += EngineArgs(**{k: v for k, v in settings.items() if k in engine_fields}).to_cli_args()
    for dest, value in settings.items():
        if dest == "mode" or dest in engine_fields or value == defaults.get(dest):
            continue
        option = "--" + dest.replace("_", "-")
        if value is True:
            words.append(option)
        else:
            words += [option, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return shlex.join(words)


def _preset(report: dict) -> str:
    if "model" not in report:  # bench serve: the model is the server's, named by the settings
        if not report["settings"].get("preset"):
            raise ValueError("the report's server model is a checkpoint: only presets have names in benchmarks.json")
        return report["settings"]["preset"]
    source = report["model"]["source"]
    if not source.startswith("preset "):
        raise ValueError(f"the report's model is {source!r}: only presets have names in benchmarks.json")
    return source.removeprefix("preset ")


def _figure(value: float, unit: str, source: str, peer: dict | None = None) -> dict:
    return {"value": value, "unit": unit, "peer": peer or {}, "from": source}


def _variant(report: dict) -> tuple[str, str]:
    """(the model's name with ``_fp8`` for an FP8 run, ``_no_overlap`` for synchronous steps or "")."""
    settings = report["settings"]
    quantized = "_fp8" if settings.get("quantization") == "fp8" else ""
    return model_name(_preset(report)) + quantized, "" if settings.get("overlap", True) else "_no_overlap"


def _kv(report: dict) -> str:
    """``_fp8kv`` for a run with an FP8 KV cache (``--kv-cache-dtype fp8``), else ""."""
    return "" if report["settings"].get("kv_cache_dtype", "auto") == "auto" else "_fp8kv"


def _prefill_graphs(report: dict) -> str:
    """``_prefill_graphs<N>`` for a run that set ``--prefill-graph-tokens N``, else "" (the default)."""
    tokens = report["settings"].get("prefill_graph_tokens")
    return "" if tokens is None else f"_prefill_graphs{tokens}"


def _beside(report: dict) -> str:
    """``_beside<N>`` for a run that set ``--prefill-tokens-beside-decodes N``, else "" (the default)."""
    tokens = report["settings"].get("prefill_tokens_beside_decodes")
    return "" if tokens is None else f"_beside{tokens}"


def _latency(report: dict) -> dict:
    model, steps = _variant(report)
    mode = ("eager" if report["settings"]["enforce_eager"] else "graphs") + _kv(report)
    peer = {f"transformers_{name}_tok_s": run["tok_s"] for name, run in report.get("compare_hf", {}).items()
            if isinstance(run, dict) and "tok_s" in run}
    figures = {f"{model}_b1_{mode}{steps}_tok_s": _figure(report["decode"]["tok_s"], "tok/s", "decode.tok_s", peer)}
    for ttft in report["ttft"]:
        length, kv = ttft["prompt_len"], _kv(report) + _prefill_graphs(report)
        figures[f"{model}_prefill_{length}{kv}{steps}_tok_s"] = _figure(
            length / ttft["ms"] * 1e3, "tok/s", f"ttft[prompt_len={length}]: prompt_len / ms")
        figures[f"{model}_ttft_{length}{kv}{steps}_ms"] = _figure(ttft["ms"], "ms", f"ttft[prompt_len={length}].ms")
    return figures


def _throughput(report: dict) -> dict:
    shape = {k: report["settings"][k] for k in NANO_VLLM_SHAPE}
    if shape != NANO_VLLM_SHAPE:
        raise ValueError(f"throughput names are for nano-vllm's shape {NANO_VLLM_SHAPE}; this run is {shape}")
    model, steps = _variant(report)
    peer = report.get("compare_hf", {}).get("ratios", {})
    name = f"{model}_throughput{_beside(report)}{_kv(report)}_out{steps}_tok_s"
    figures = {name: _figure(report["throughput"]["output_tok_s"], "tok/s", "throughput.output_tok_s", peer)}
    monitor = report.get("gpu_monitor", {})
    timed = monitor.get("timed_run", {}).get("devices")  # the timed run alone, without load and warm-up
    devices, source = (timed, "gpu_monitor.timed_run") if timed else (monitor.get("devices"), "gpu_monitor")
    if devices:
        figures[f"{model}_throughput{_beside(report)}{_kv(report)}_gpu_busy{steps}_pct"] = _figure(
            devices[0]["util_pct_mean"], "%", f"{source}.devices[0].util_pct_mean (NVML)")
    return figures


def _short(report: dict) -> dict:
    scale = report["scale"]
    if scale["name"] != "full":
        raise ValueError(f"a {scale['name']} short benchmark has no H200 figures")
    raw = {name: figure["value"] for name, figure in report["raw_figures"].items()}
    qwen3, deepseek = model_name(scale["qwen3"]), model_name(scale["deepseek"])
    chain = {"matmul_chain_tok_s": raw["matmul_chain_tok_s"]} if "matmul_chain_tok_s" in raw else {}
    mapping = {  # raw figure: (name, peer)
        "qwen3_decode_b1_tok_s": (f"{qwen3}_b1_graphs_tok_s", chain),
        "qwen3_eager_decode_b1_tok_s": (f"{qwen3}_b1_eager_tok_s", {"host_ref_us": raw.get("host_ref_us")}),
        "qwen3_prefill_tok_s": (f"{qwen3}_prefill_{scale['prefill_len']}_tok_s",
                                {"prefill_gemm_tok_s": raw.get("prefill_gemm_tok_s")}),
        "matmul_chain_tok_s": (f"{qwen3}_matmul_chain_tok_s", {"copy_gb_s": raw.get("copy_gb_s")}),
        "deepseek_decode_b1_tok_s": (f"{deepseek}_b1_graphs_tok_s", chain),
    }
    return {name: _figure(raw[figure], report["raw_figures"][figure]["unit"], f"raw_figures.{figure}",
                          {k: v for k, v in peer.items() if v is not None})
            for figure, (name, peer) in mapping.items() if figure in raw}


def _floors(report: dict) -> dict:
    peer = {k: report[k] for k in ("copy_gb_s", "copy_floor_tok_s", "prefill_gemm_tok_s", "gemm_tflops")}
    return {f"{model_name(report['preset'])}_matmul_chain_tok_s": _figure(report["matmul_chain_tok_s"], "tok/s",
                                                                         "matmul_chain_tok_s", peer)}


def _spec(report: dict) -> dict:
    method = report["settings"].get("speculative") or "ngram"
    figures = {}
    for workload, run in report.get("workloads", {}).items():
        spec, plain = run["spec"], run["plain"]
        peer = {"plain_forwards": plain["forwards"], "spec_forwards": spec["forwards"],
                "output_tokens": spec["output_tokens"], "acceptance_rate": spec["acceptance_rate"],
                "same_tokens": run["same_tokens"]}
        figures[f"spec_{method}_{workload}_tokens_per_forward"] = _figure(
            spec["tokens_per_forward"], "tokens/forward", f"workloads.{workload}.spec.tokens_per_forward", peer)
        figures[f"demo_spec_{method}_{workload}_b1_tok_s"] = _figure(
            spec["tok_s"], "tok/s", f"workloads.{workload}.spec.tok_s", {"plain_tok_s": plain["tok_s"]})
    verify = report["verify_step"]
    if report["model"]["source"].startswith("preset "):
        model, k = model_name(_preset(report)), verify["num_drafts"]
        peer = {key: verify[key] for key in ("decode_ms", "verify_ms", "graphs", "context_len")}
        figures[f"{model}_spec_verify_k{k}_ratio"] = _figure(verify["ratio"], "x", "verify_step.ratio", peer)
        if "draft_ms" in verify:  # a model drafter: drafting k tokens and verifying them, over a decode step
            figures[f"{model}_spec_{method}_draft_verify_k{k}_ratio"] = _figure(
                verify["draft_and_verify_ratio"], "x", "verify_step.draft_and_verify_ratio",
                {**peer, "draft_ms": verify["draft_ms"]})
    return figures


STRUCTURED_NAMES = {"json_schema": "structured", "tools": "tools"}
STRUCTURED_PEERS = ("itl_p99_ratio", "compile_ms_cold", "compile_ms_cached", "mask_fill_us_per_step", "mask_rows")


def _plain_serve(report: dict) -> dict:
    """A plain load's output tok/s, ITL median and p99, TTFT p99, named by the preset, the
    concurrency and what is not the default: the step's token budget (``_budget{N}``), an FP8 KV
    cache, ``--enforce-eager``, ``--prefill-graph-tokens``, ``--prefill-tokens-beside-decodes``."""
    from engine.core.engine_args import EngineArgs

    settings, serve = report["settings"], report["serve"]
    if settings.get("max_concurrency") is None:
        raise ValueError("a plain serve figure needs --max-concurrency (its name says the concurrency)")
    if serve["completed"] != settings["num_prompts"]:
        raise ValueError(f"{serve['completed']} of {settings['num_prompts']} requests completed: no figure from "
                         "a run with failures")
    model, steps = _variant(report)
    budget = settings.get("max_num_batched_tokens", EngineArgs.max_num_batched_tokens)
    name = f"{model}_serve_c{settings['max_concurrency']}" + (
        "" if budget == EngineArgs.max_num_batched_tokens else f"_budget{budget}") + _beside(report) + _kv(report) + (
        "_eager" if settings.get("enforce_eager") else "") + _prefill_graphs(report)
    peer = {"input_len": settings["input_len"], "output_len": settings["output_len"],
            "num_prompts": settings["num_prompts"], "max_num_batched_tokens": budget,
            "ttft_p50_ms": serve["ttft_ms"]["median"]}
    return {f"{name}_out{steps}_tok_s": _figure(serve["output_throughput"], "tok/s", "serve.output_throughput", peer),
            f"{name}_itl_p50{steps}_ms": _figure(serve["itl_ms"]["median"], "ms", "serve.itl_ms.median", peer),
            f"{name}_itl_p99{steps}_ms": _figure(serve["itl_ms"]["p99"], "ms", "serve.itl_ms.p99", peer),
            f"{name}_ttft_p99{steps}_ms": _figure(serve["ttft_ms"]["p99"], "ms", "serve.ttft_ms.p99", peer)}


def _serve(report: dict) -> dict:
    workloads = report["serve"].get("structured")
    if workloads is None:
        return _plain_serve(report)
    model, steps = _variant(report)
    figures = {}
    for workload, run in workloads.items():
        if "skipped" in run:
            continue
        wanted = report["settings"]["num_prompts"]
        done = (run["plain"]["completed"], run["constrained_valid"])
        if done != (wanted, wanted):
            raise ValueError(f"{workload}: {done[0]} plain requests completed and {done[1]} constrained answers "
                             f"valid of {wanted}: no figure from a run with failures")
        peer = {"plain_out_tok_s": run["plain"]["output_throughput"],
                "constrained_out_tok_s": run["constrained"]["output_throughput"],
                "max_concurrency": report["settings"]["max_concurrency"], **{k: run[k] for k in STRUCTURED_PEERS}}
        figures[f"{model}_{STRUCTURED_NAMES[workload]}_vs_plain_throughput{steps}_ratio"] = _figure(
            run["structured_vs_plain_throughput_ratio"], "x",
            f"serve.structured.{workload}.structured_vs_plain_throughput_ratio", peer)
    return figures


MAPPERS = {"latency": _latency, "throughput": _throughput, "short": _short, "floors": _floors, "spec": _spec,
           "serve": _serve}
DEVICE_FREE = re.compile(r"spec_(ngram|draft|eagle3|mtp)_\w+_tokens_per_forward")


def figures_of(report: dict) -> dict:
    """The named figures of one report, each with its command, date, device and peers."""
    kind = report.get("bench")
    if kind not in MAPPERS:
        raise ValueError(f"not a report this script reads (bench = {kind!r}; expected one of {', '.join(MAPPERS)})")
    command = report.get("command") or bench_command(report)
    machine = report["machine"]
    return {name: {**figure, "command": command, "date": machine["time"], "device": machine["device"]}
            for name, figure in MAPPERS[kind](report).items()}


# BENCHMARKS.md: the figures grouped by what they measure. A figure goes to the first group of
# GROUP_MATCH_ORDER whose pattern matches its whole name (speculative and serving names also hold
# ``_b1_`` or ``_throughput``), else to "other"; the groups print in GROUPS' order, each figure
# sorted by name, so the file depends on the figures alone, never on their order in the JSON.
GROUPS = {  # key: (heading, what it holds and how it is measured)
    "decode": ("Decode at B=1", "Output tok/s of one sequence (`python -m engine bench latency`): `graphs` with CUDA "
               "graphs (the default), `eager` with `--enforce-eager`, `_fp8` FP8 weights, `_fp8kv` an FP8 KV "
               "cache, `_no_overlap` synchronous steps; peers: transformers on the same weights in the same run. "
               "Device runs: `bash scripts/gpu.sh decode`, `models`, `fp8`."),
    "prefill": ("Prefill and time to first token", "One N-token prompt from the same latency runs: "
                "`_prefill_<N>_tok_s` is N / TTFT, `_ttft_<N>_ms` the TTFT itself (`_prefill_graphs<N>` when "
                "`--prefill-graph-tokens` is set). Device runs: `bash scripts/gpu.sh prefill` and those of B=1 "
                "decode."),
    "throughput": ("Offline throughput", "nano-vllm's shape (`python -m engine bench throughput`: 256 sequences, "
                   "100-1,024 tokens in and out): output tok/s and NVML GPU busy, the mean over the timed run. "
                   "Device runs: `bash scripts/gpu.sh throughput`, `fp8`."),
    "serve": ("Serving under load", "`python -m engine bench serve --launch` at N concurrent requests (`_cN`): output "
              "tok/s, ITL median and p99, TTFT p99; `_budget<B>` a step token budget other than the default, "
              "`_beside<N>` a cap of N prompt tokens beside decodes. Device runs: `bash scripts/gpu.sh serve`, "
              "`fp8`."),
    "speculative": ("Speculative decoding", "`python -m engine bench spec --method M` (k = 4; `spec_<M>_`: n-gram, "
                    "draft model, EAGLE-3 head): tokens per target forward (no device changes them, so a CPU run "
                    "records them), B=1 tok/s with the plain engine's as peer, a verify step's cost over a decode "
                    "step, and for a model drafter drafting plus verifying over a decode step. Device run: "
                    "`bash scripts/gpu.sh spec`."),
    "structured": ("Structured outputs under load", "`python -m engine bench serve --structured`: constrained over "
                   "plain output tok/s under the same load (`structured`: a json_schema, `tools`: a forced tool "
                   "call), with the grammar's costs as peers. Device run: `bash scripts/gpu.sh structured`."),
    "floors": ("Device floors", "`scripts/bench_floors.py`: a cuBLAS matmul chain over the model's weights (the B=1 "
               "decode floor), with the copy bandwidth and prefill GEMMs as peers. Device runs: `bash scripts/gpu.sh "
               "decode`, `models`, `kernels`."),
    "other": ("Other figures", "Figures of no group above."),
}
GROUP_PATTERNS = {
    "speculative": r"(demo_)?spec_(ngram|draft|eagle3|mtp)_\w+|\w+_spec_(\w+_draft_)?verify_k\d+_ratio",
    "structured": r"\w+_(structured|tools)_vs_plain_throughput\w*_ratio",
    "serve": r"\w+_serve_c\d+\w*",
    "throughput": r"\w+_throughput\w*",
    "floors": r"\w+_matmul_chain\w*",
    "prefill": r"\w+_(prefill|ttft)_\d+\w*",
    "decode": r"\w+_b1_\w+",
}
GROUP_MATCH_ORDER = tuple(GROUP_PATTERNS)


def group_of(name: str) -> str:
    """The BENCHMARKS.md group of a figure's name (a key of GROUPS)."""
    return next((group for group in GROUP_MATCH_ORDER if re.fullmatch(GROUP_PATTERNS[group], name)), "other")


def format_number(value) -> str:
    """A figure's value as BENCHMARKS.md shows it: four significant digits, whole numbers from 1,000 on
    (with thousands separators), ints whole, booleans as JSON spells them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if value is None:
        return "—"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _cell(text: str) -> str:
    """Text that stays in its table cell: pipes escaped, line breaks as spaces."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    """A code span around text (longer fences when the text holds backticks), for a table cell."""
    text = " ".join(str(text).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if fence != "`" else ""
    return _cell(f"{fence}{pad}{text}{pad}{fence}")


def _day(date: str) -> str:
    return date[:10] if re.match(r"\d{4}-\d\d-\d\d", date or "") else (date or "—")


def render_markdown(figures: dict) -> str:
    """BENCHMARKS.md for ``figures`` (``benchmarks.json``'s ``"figures"``: name -> {"value", "unit",
    "command", "date", "device", "peer"}): a header saying it is generated and how to reproduce the
    figures, then a table per group of GROUPS (figure, value with its unit, same-run peers, device,
    day, command), each figure sorted by name."""
    devices: dict[str, int] = {}
    for figure in figures.values():
        devices[figure.get("device", "?")] = devices.get(figure.get("device", "?"), 0) + 1
    days = sorted(_day(figure.get("date", "")) for figure in figures.values())
    measured = (f"{len(figures)} figures, measured from {days[0]} to {days[-1]} on "
                + ", ".join(f"{device} ({count})" for device, count in sorted(devices.items())) + "."
                if figures else "No figures recorded yet.")
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/record_benchmarks.py from benchmarks.json: do not edit by hand. -->",
        "",
        "**Generated from `benchmarks.json` by `scripts/record_benchmarks.py`: do not edit by hand.** "
        "Recording figures (`python scripts/record_benchmarks.py REPORT.json ...`) rewrites this file; "
        "`python scripts/record_benchmarks.py --markdown BENCHMARKS.md` renders it again from "
        "`benchmarks.json` alone. A test (`phases/11_performance/test_record_benchmarks.py`) fails when "
        "the two differ.",
        "",
        measured,
        "",
        "**Reproducing a figure.** Its command, run from the repository root with `PYTHONPATH=.` on the "
        "device named, writes the JSON report it was read from; `python scripts/record_benchmarks.py "
        "REPORT.json` records it here. Models named by a preset (`qwen3_8b`, `llama3_8b`, `dsv2_lite`, ...) are "
        "full-size configurations with random bf16 weights made on the GPU (`--preset NAME --random-weights`; "
        "`_fp8`: quantized at load); the `demo_` and `spec_<method>_` figures are the shipped demo model's. "
        "On a GPU machine `bash scripts/gpu.sh SECTION ...` runs the commands, a section per topic "
        "(`bash scripts/gpu.sh` lists them, `DRY_RUN=1` prints their commands), and records its reports "
        "into `$OUT/benchmarks.json` (and `$OUT/BENCHMARKS.md`) to copy back. How the figures are measured, "
        "and what they say: "
        "[docs/performance.md](docs/performance.md); kernel-level notes: "
        "[docs/performance-notes.md](docs/performance-notes.md); the dated session logs that were this file "
        "before it was generated: `git show 17e792a:BENCHMARKS.md`.",
    ]
    grouped: dict[str, list[str]] = {group: [] for group in GROUPS}
    for name in sorted(figures):
        grouped[group_of(name)].append(name)
    for group, names in grouped.items():
        if not names:
            continue
        heading, about = GROUPS[group]
        lines += ["", f"## {heading}", "", about, "",
                  "| figure | value | peers (same run) | device | date | command |", "|---|---|---|---|---|---|"]
        for name in names:
            figure = figures[name]
            peer = figure.get("peer") or {}
            peers = "; ".join(f"{key} {format_number(value)}" for key, value in sorted(peer.items())) or "—"
            value = f"{format_number(figure['value'])} {figure.get('unit', '')}".strip()
            lines.append("| " + " | ".join([_code(name), _cell(value), _cell(peers), _cell(figure.get("device", "—")),
                                             _cell(_day(figure.get("date", ""))), _code(figure.get("command", ""))])
                         + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", metavar="REPORT.json",
                        help="benchmark reports to record (none: only render BENCHMARKS.md again)")
    parser.add_argument("--into", default=str(Path(__file__).resolve().parents[1] / "benchmarks.json"),
                        help="the file to update (default: benchmarks.json at the repository root)")
    parser.add_argument("--only", metavar="REGEX", type=re.compile,
                        help="record only the figures whose name matches (a report's other figures are left as "
                             "they are, e.g. a headline measured under other settings elsewhere)")
    markdown = parser.add_mutually_exclusive_group()
    markdown.add_argument("--markdown", metavar="PATH",
                          help="where to write the rendered figures (default: BENCHMARKS.md beside --into)")
    markdown.add_argument("--no-markdown", action="store_true", help="write no markdown")
    args = parser.parse_args(argv)
    if not args.reports and args.no_markdown:
        parser.error("nothing to do: no report to record and --no-markdown")
    recorded = {}
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        device = report.get("machine", {}).get("device", "")
        try:
            figures = figures_of(report)
        except (KeyError, ValueError) as e:
            parser.error(f"{path}: {e}")
        if device.startswith("cpu"):
            figures = {name: figure for name, figure in figures.items() if DEVICE_FREE.fullmatch(name)}
            if not figures:
                parser.error(f"{path} was measured on {device}: benchmarks.json holds GPU figures only")
        if args.only is not None:
            figures = {name: figure for name, figure in figures.items() if args.only.fullmatch(name)}
        recorded.update(figures)
    into = Path(args.into)
    if not args.reports and not into.is_file():
        parser.error(f"{into} does not exist: nothing to render")
    data = json.loads(into.read_text()) if into.is_file() else {"figures": {}}
    if args.reports:
        data["figures"].update(recorded)
        data["figures"] = dict(sorted(data["figures"].items()))
        into.write_text(json.dumps(data, indent=1) + "\n")
        for name, figure in recorded.items():
            print(f"{name:<36} {figure['value']:>12.4g} {figure['unit']:<6} {figure['device']} {figure['date']}")
        print(f"wrote {len(recorded)} figure(s) to {into}", file=sys.stderr)
    if not args.no_markdown:
        markdown_path = Path(args.markdown) if args.markdown else into.with_name("BENCHMARKS.md")
        markdown_path.write_text(render_markdown(data["figures"]))
        print(f"wrote {len(data['figures'])} figure(s) to {markdown_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
