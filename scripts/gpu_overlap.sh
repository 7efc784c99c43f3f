#!/usr/bin/env bash
# The overlapped engine step on one H200, in one device call (about 9 minutes): each figure beside
# its same-run synchronous (--no-overlap) peer and the physical floors.
#   1. the single-process `cuda` tests of phases 09-11 (graphs fed by the previous step's ids on
#      the device, steady decode allocating nothing, the perf gate aside);
#   2. the floors (copy, cuBLAS matmul chain over Qwen3-8B's weights, prefill GEMMs);
#   3. Qwen3-8B B=1 decode with graphs, overlapped and not, with a profiler trace of a few steps
#      (GPU kernel time per step: the host gap between replays is ms/token minus that);
#   4. offline throughput, nano-vllm's shape (256 sequences, 100-1,024 in and out, T = 0.6),
#      overlapped and not: output tok/s, NVML GPU busy (mean), host ms per step;
#   5. bench serve --launch, 64 concurrent, 512 in / 128 out, overlapped and not: TTFT, ITL;
#   6. record: benchmarks.json ($OUT/benchmarks.json) from the overlapped reports and the floors.
# JSON reports and logs go to $OUT; a summary table is printed last.
#
#   bash scripts/gpu_overlap.sh              # or: bash scripts/gpu_overlap.sh latency throughput summary
source "$(dirname "$0")/gpu_common.sh"  # strict mode, wheels, $OUT, PYTHONPATH, logged
SECTIONS=${*:-tests floors latency throughput serve record summary}
Q8B=(--preset qwen3-8b --random-weights)

for section in $SECTIONS; do
    case $section in
    tests)
        logged cuda_tests 240 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/09_engine_integration \
            phases/10_e2e_acceptance phases/11_performance --deselect phases/11_performance/test_perf_gate.py ;;
    floors)
        logged floors 90 python3 scripts/bench_floors.py --json "$OUT/floors.json" ;;
    latency)
        for mode in overlap no-overlap; do
            extra=(); [ $mode = no-overlap ] && extra=(--no-overlap)
            logged "latency_$mode" 200 python3 -m engine bench latency "${Q8B[@]}" "${extra[@]}" --prompt-lens 128,4096 \
                --max-model-len 4160 --decode-tokens 256 --profile "$OUT/trace_$mode.json" --profile-steps 20 \
                --output "$OUT/latency_$mode.json"
        done ;;
    throughput)
        for mode in overlap no-overlap; do
            extra=(); [ $mode = no-overlap ] && extra=(--no-overlap)
            logged "throughput_$mode" 150 python3 -m engine bench throughput "${Q8B[@]}" "${extra[@]}" \
                --output "$OUT/throughput_$mode.json"
        done ;;
    serve)
        for mode in overlap no-overlap; do
            extra=(); [ $mode = no-overlap ] && extra=(--no-overlap)
            logged "serve_$mode" 200 python3 -m engine bench serve --launch "${Q8B[@]}" "${extra[@]}" --max-model-len 1024 \
                --num-prompts 256 --max-concurrency 64 --input-len 512 --output-len 128 --output "$OUT/serve_$mode.json"
        done ;;
    record)
        cp benchmarks.json "$OUT/benchmarks.json" 2>/dev/null
        logged record 60 python3 scripts/record_benchmarks.py "$OUT/latency_overlap.json" "$OUT/throughput_overlap.json" \
            "$OUT/floors.json" --into "$OUT/benchmarks.json" ;;
    summary)
        cat "$OUT/sections.log"
        [ -f "$OUT/cuda_tests.log" ] && tail -3 "$OUT/cuda_tests.log"
        python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
floors = load("floors.json") or {}
print("floors", json.dumps(floors)[:600])
print(f"{'figure':<44}{'overlap':>12}{'no-overlap':>12}")
rows = []
for mode in ("overlap", "no-overlap"):
    lat, thr, srv = load(f"latency_{mode}.json"), load(f"throughput_{mode}.json"), load(f"serve_{mode}.json")
    figures = {}
    if lat:
        figures["B=1 decode, graphs (tok/s)"] = lat["decode"]["tok_s"]
        figures["B=1 ms per token"] = lat["decode"]["ms_per_token"]
        kernel_us = (lat.get("profile") or {}).get("gpu_kernel_us_per_step")
        if kernel_us:
            figures["B=1 host gap between steps (ms)"] = lat["decode"]["ms_per_token"] - kernel_us / 1e3
        figures["TTFT 4096 (ms)"] = next((t["ms"] for t in lat["ttft"] if t["prompt_len"] >= 4096), float("nan"))
    if thr:
        figures["throughput (output tok/s)"] = thr["throughput"]["output_tok_s"]
        figures["throughput host ms per step"] = thr["throughput"]["host_ms_per_step"]
        devices = (thr.get("gpu_monitor") or {}).get("devices") or [{}]
        figures["throughput GPU busy (NVML mean %)"] = devices[0].get("util_pct_mean", float("nan"))
    if srv:
        s = srv["serve"]
        figures["serve 64 conc: output tok/s"] = s["output_throughput"]
        for metric in ("ttft_ms", "itl_ms"):
            for stat in ("median", "p99"):
                figures[f"serve 64 conc: {metric} {stat}"] = s[metric].get(stat, float("nan"))
    rows.append(figures)
for name in dict.fromkeys(k for r in rows for k in r):
    print(f"{name:<44}" + "".join(f"{r.get(name, float('nan')):>12.2f}" for r in rows))
PY
        ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
    esac
done
