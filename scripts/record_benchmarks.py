"""Record the GPU figures of benchmark reports in ``benchmarks.json`` (the repository's figures,
written from the benchmarks' JSON, never typed in).

    python scripts/record_benchmarks.py REPORT.json [REPORT.json ...] [--into benchmarks.json] [--only REGEX]

Each report is the JSON of ``python -m engine bench latency | throughput | spec``, of
``python -m engine.bench.short`` (full scale) or of ``scripts/bench_floors.py``. Its figures are
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
``spec_ngram_<workload>_tokens_per_forward`` (bench spec
on a checkpoint, greedy: output tokens per target-model forward with n-gram drafts, the plain
engine's forwards as peer), ``demo_spec_ngram_<workload>_b1_tok_s`` (the same run's tok/s, on a
GPU) and ``<model>_spec_verify_k<K>_ratio`` (a B=1 verify step of K drafts over a decode step);
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

    from engine.bench import add_bench_command
    from engine.engine_args import EngineArgs

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
    figures = {}
    for workload, run in report.get("workloads", {}).items():
        spec, plain = run["spec"], run["plain"]
        peer = {"plain_forwards": plain["forwards"], "spec_forwards": spec["forwards"],
                "output_tokens": spec["output_tokens"], "acceptance_rate": spec["acceptance_rate"],
                "same_tokens": run["same_tokens"]}
        figures[f"spec_ngram_{workload}_tokens_per_forward"] = _figure(
            spec["tokens_per_forward"], "tokens/forward", f"workloads.{workload}.spec.tokens_per_forward", peer)
        figures[f"demo_spec_ngram_{workload}_b1_tok_s"] = _figure(
            spec["tok_s"], "tok/s", f"workloads.{workload}.spec.tok_s", {"plain_tok_s": plain["tok_s"]})
    verify = report["verify_step"]
    if report["model"]["source"].startswith("preset "):
        figures[f"{model_name(_preset(report))}_spec_verify_k{verify['num_drafts']}_ratio"] = _figure(
            verify["ratio"], "x", "verify_step.ratio", {k: verify[k] for k in ("decode_ms", "verify_ms", "graphs",
                                                                               "context_len")})
    return figures


STRUCTURED_NAMES = {"json_schema": "structured", "tools": "tools"}
STRUCTURED_PEERS = ("itl_p99_ratio", "compile_ms_cold", "compile_ms_cached", "mask_fill_us_per_step", "mask_rows")


def _plain_serve(report: dict) -> dict:
    """A plain load's output tok/s, ITL median and p99, TTFT p99, named by the preset, the
    concurrency and what is not the default: the step's token budget (``_budget{N}``), an FP8 KV
    cache, ``--enforce-eager``, ``--prefill-graph-tokens``, ``--prefill-tokens-beside-decodes``."""
    from engine.engine_args import EngineArgs

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
DEVICE_FREE = re.compile(r"spec_ngram_\w+_tokens_per_forward")


def figures_of(report: dict) -> dict:
    """The named figures of one report, each with its command, date, device and peers."""
    kind = report.get("bench")
    if kind not in MAPPERS:
        raise ValueError(f"not a report this script reads (bench = {kind!r}; expected one of {', '.join(MAPPERS)})")
    command = report.get("command") or bench_command(report)
    machine = report["machine"]
    return {name: {**figure, "command": command, "date": machine["time"], "device": machine["device"]}
            for name, figure in MAPPERS[kind](report).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", metavar="REPORT.json")
    parser.add_argument("--into", default=str(Path(__file__).resolve().parents[1] / "benchmarks.json"),
                        help="the file to update (default: benchmarks.json at the repository root)")
    parser.add_argument("--only", metavar="REGEX", type=re.compile,
                        help="record only the figures whose name matches (a report's other figures are left as "
                             "they are, e.g. a headline measured under other settings elsewhere)")
    args = parser.parse_args(argv)
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
    data = json.loads(into.read_text()) if into.is_file() else {"figures": {}}
    data["figures"].update(recorded)
    data["figures"] = dict(sorted(data["figures"].items()))
    into.write_text(json.dumps(data, indent=1) + "\n")
    for name, figure in recorded.items():
        print(f"{name:<36} {figure['value']:>12.4g} {figure['unit']:<6} {figure['device']} {figure['date']}")
    print(f"wrote {len(recorded)} figure(s) to {into}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
