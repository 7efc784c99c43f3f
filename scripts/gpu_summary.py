"""The end of every device run (``scripts/gpu.sh``): which reports to record, and one table.

    python3 scripts/gpu_summary.py recordable OUT  # the reports record_benchmarks.py reads, one a line
    python3 scripts/gpu_summary.py table OUT       # a row per part: section, part, rc, seconds, headline

``OUT/parts.tsv`` has a row per part run (section, part, rc or ``skip``, seconds, ``yes``/``no``:
whether its report may be recorded). Part NAME leaves its output in ``OUT/NAME.log`` and its JSON
report, if any, in ``OUT/NAME.json`` (a script that prints its JSON leaves it as a line of the log).
A report is recordable when its part passed, may be recorded, and ``record_benchmarks.figures_of``
reads it (a CPU report only for the figures no device changes). Standard library only: an empty
OUT gives an empty table on any machine.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_benchmarks  # noqa: E402

PEERS = {  # part: the part its main figure is compared with in the table
    "latency_qwen3_8b_fp8": "latency_qwen3_8b_bf16", "latency_dsv2_lite_fp8": "latency_dsv2_lite_bf16",
    "latency_qwen3_30b_a3b_fp8": "latency_qwen3_30b_a3b_bf16", "latency_qwen3_8b_bf16_gemv": "latency_qwen3_8b_bf16",
    "latency_qwen3_8b_eager_gemv": "latency_qwen3_8b_eager", "latency_dsv2_lite_gemv": "latency_dsv2_lite_bf16",
    "latency_qwen3_8b_no_overlap": "latency_qwen3_8b_overlap", "throughput_qwen3_8b_fp8w": "throughput_qwen3_8b",
    "throughput_qwen3_8b_fp8kv": "throughput_qwen3_8b", "throughput_qwen3_8b_beside_384": "throughput_qwen3_8b",
    "throughput_qwen3_8b_no_overlap": "throughput_qwen3_8b", "serve_qwen3_8b_c64_fp8": "serve_qwen3_8b_c64",
    "latency_tp2_graphs": "latency_tp1_graphs", "latency_tp2_graphs_nccl": "latency_tp1_graphs",
    "latency_tp2_eager": "latency_tp1_eager", "latency_tp2_eager_nccl": "latency_tp1_eager",
    "throughput_tp2": "throughput_tp1", "latency_ep2_graphs": "latency_ep1_graphs", "eager_loaded": "eager_alone",
}


def parts(out: Path) -> list[dict]:
    path = out / "parts.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.is_file() else []
    return [dict(zip(("section", "part", "rc", "seconds", "record"), row)) for row in rows if len(row) == 5]


def report(out: Path, name: str) -> dict | None:
    """Part NAME's JSON report: NAME.json, else the last line of NAME.log that is a JSON object."""
    path, log = out / f"{name}.json", out / f"{name}.log"
    lines = [path.read_text()] if path.is_file() else (log.read_text(errors="replace").splitlines()[::-1]
                                                        if log.is_file() else [])
    for text in lines:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def recordable(out: Path) -> list[Path]:
    latest = {row["part"]: row for row in parts(out) if row["rc"] != "skip"}
    found = []
    for name, row in latest.items():
        path = out / f"{name}.json"
        if row["rc"] != "0" or row["record"] != "yes" or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
            figures = record_benchmarks.figures_of(data)
        except Exception:  # noqa: BLE001 - a report it cannot read is simply not one of these
            continue
        cpu = str(data.get("machine", {}).get("device", "")).startswith("cpu")
        if not cpu or any(record_benchmarks.DEVICE_FREE.fullmatch(figure) for figure in figures):
            found.append(path)
    return found


def main_figure(r: dict) -> tuple[float, str] | None:
    """The figure a part is compared by: B=1 decode, offline or serving output tok/s."""
    if r.get("bench") == "latency":
        return r["decode"]["tok_s"], "decode tok/s"
    if r.get("bench") == "throughput":
        return r["throughput"]["output_tok_s"], "output tok/s"
    if r.get("bench") == "serve" and "structured" not in r["serve"]:
        return r["serve"]["output_throughput"], "output tok/s"
    if r.get("bench") == "short" and "qwen3_eager_decode_b1_tok_s" in r.get("raw_figures", {}):
        return r["raw_figures"]["qwen3_eager_decode_b1_tok_s"]["value"], "eager tok/s"
    return None


def headline(r: dict, floors: dict[str, float]) -> str:
    """The report's figures in a line, by the kind of report."""
    bench = r.get("bench")
    if bench == "latency":
        line = f"decode {r['decode']['tok_s']:.1f} tok/s"
        floor = floors.get(str(r.get("model", {}).get("source", "")).removeprefix("preset "))
        if floor and not r["settings"].get("enforce_eager"):
            line += f" ({r['decode']['tok_s'] / floor:.2f} of the matmul floor)"
        line += "; TTFT " + ", ".join(f"{t['prompt_len']}: {t['ms']:.1f} ms" for t in r.get("ttft", []))
        hf = {k: v["tok_s"] for k, v in r.get("compare_hf", {}).items() if isinstance(v, dict) and "tok_s" in v}
        if hf:
            line += "; transformers " + ", ".join(f"{k} {v:.1f}" for k, v in hf.items())
        kernel_us = (r.get("profile") or {}).get("gpu_kernel_us_per_step")
        if kernel_us:
            line += f"; host gap {r['decode']['ms_per_token'] - kernel_us / 1e3:.2f} ms/step"
        return line
    if bench == "throughput":
        t, monitor = r["throughput"], r.get("gpu_monitor") or {}
        devices = monitor.get("timed_run", {}).get("devices") or monitor.get("devices") or [{}]
        line = f"output {t['output_tok_s']:.0f} tok/s; GPU busy {devices[0].get('util_pct_mean', float('nan')):.0f} %"
        if "host_ms_per_step" in t:
            line += f"; host {t['host_ms_per_step']:.2f} ms/step"
        ratios = r.get("compare_hf", {}).get("ratios")
        return line + (f"; vs transformers {json.dumps(ratios)}" if ratios else "")
    if bench == "serve":
        s = r["serve"]
        if "structured" in s:
            return "; ".join(f"{name} skipped" if "skipped" in w else
                             f"{name} {w['structured_vs_plain_throughput_ratio']:.3f} x plain, "
                             f"{w['constrained_valid']} valid, {w['constrained_invalid']} invalid"
                             for name, w in s["structured"].items())
        return (f"output {s['output_throughput']:.0f} tok/s; TTFT p99 {s['ttft_ms']['p99']:.0f} ms; ITL p50 "
                f"{s['itl_ms']['median']:.1f}, p99 {s['itl_ms']['p99']:.1f} ms; {s['completed']} done, "
                f"{s.get('failed', 0)} failed")
    if bench == "spec":
        v = r.get("verify_step") or {}
        line = f"verify k={v['num_drafts']}: {v['ratio']:.3f} x a decode step; " if v else ""
        return line + "; ".join(f"{name} {w['speedup']:.2f} x plain, {w['spec']['tokens_per_forward']:.2f} tok/fwd"
                                for name, w in r.get("workloads", {}).items())
    if bench == "short":
        return ", ".join(f"{k} {v['value']:.4g}" for k, v in r["raw_figures"].items())
    if bench == "floors":
        return (f"copy {r['copy_gb_s']:.0f} GB/s; matmul chain {r['matmul_chain_tok_s']:.0f} tok/s; "
                f"prefill GEMM {r['prefill_gemm_tok_s']:.0f} tok/s")
    if "phases" in r:  # python -m gates run --report
        return "; ".join(f"{p['id']} {p['status']} ({p['counts']['passed']} passed, {p['counts']['failed']} failed)"
                         for p in r["phases"])
    if "mutations" in r:  # python -m gates audit --report
        return ", ".join(f"{k} {v}" for k, v in r["summary"].items() if v) or "no mutation"
    if "results" in r:  # bench_kernels.py
        return f"{len(r['results'])} timings of {len({row['op'] for row in r['results']})} ops"
    for key, fp8 in (("gemm", "fp8_triton_us"), ("gemv", "fp8_plan_us")):  # bench_fp8.py
        if key in r:
            ratios = [row[fp8] / row["bf16_us"] for row in r[key] if row.get(fp8) and row.get("bf16_us")]
            return f"{len(r[key])} {key} shapes" + (f"; FP8 time / bf16 cuBLAS, median {statistics.median(ratios):.2f}"
                                                     if ratios else "")
    if "agreement" in r:
        return json.dumps(r["agreement"].get("relative_logits_error", r["agreement"]))[:150]
    if "ours_us" in r:  # bench_dispatch.py
        return "host us " + ", ".join(f"{k} {v:.1f}" for k, v in list(r["ours_us"].items())[:4])
    return ", ".join(f"{k} {v}" for k, v in r.items() if k.endswith("_ms"))  # bench_runner_host.py


def last_line(out: Path, name: str) -> str:
    log = out / f"{name}.log"
    lines = [line.strip(" =") for line in log.read_text(errors="replace").splitlines() if line.strip(" =")] \
        if log.is_file() else []
    return lines[-1] if lines else ""


def table(out: Path) -> None:
    rows = parts(out)
    reports = {row["part"]: report(out, row["part"]) for row in rows if row["rc"] != "skip"}
    floors = {r["preset"]: r["matmul_chain_tok_s"] for r in reports.values() if r and r.get("bench") == "floors"}
    print(f"\n{'section':<11}{'part':<34}{'rc':>5}{'s':>6}  headline (the part's report, else its log's last line)")
    for row in rows:
        name, r = row["part"], reports.get(row["part"])
        if row["rc"] == "skip":
            line = "skipped: not enough of BUDGET_S left"
        else:
            try:
                line = headline(r, floors) if r else last_line(out, name)
                peer, mine = reports.get(PEERS.get(name, "")), main_figure(r) if r else None
                theirs = main_figure(peer) if peer else None
                if mine and theirs:
                    line += f" [{mine[0] / theirs[0]:.2f} x {PEERS[name]}'s {mine[1]}]"
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                line = f"report not read ({type(e).__name__} {e}): {last_line(out, name)}"
            if row["rc"] != "0" and r and last_line(out, name):
                line += f" | log: {last_line(out, name)}"
            if row["record"] != "yes":
                line += " (not recorded)"
        print(f"{row['section']:<11}{name:<34}{row['rc']:>5}{row['seconds']:>6}  {line[:300]}")
    if not rows:
        print("(no part has run into this OUT)")
    log = out / "record.log"
    written = [line for line in log.read_text().splitlines() if line.startswith("wrote") or "error" in line] \
        if log.is_file() else ["no report to record"]
    print("record:", "; ".join(written), f"({out / 'benchmarks.json'}, {out / 'record.log'})")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("recordable", "table"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    if argv[0] == "recordable":
        for path in recordable(out):
            print(path)
    else:
        table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
