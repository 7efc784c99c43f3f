#!/usr/bin/env bash
# Phase 11 on the GPU, in one device call on a two-GPU host (two lanes at once, one per GPU):
#   GPU 0: every single-process `cuda` test (the 8B checks and the perf gate aside), the physical
#          floors (copy, cuBLAS matmul chain, prefill GEMMs), the host cost of a step's bookkeeping
#          at 256 sequences, Qwen3-8B B=1 latency with graphs
#          against transformers eager and static cache + compile, DeepSeek-V2-Lite B=1 with
#          graphs against transformers eager;
#   GPU 1: the perf gate: record phases/11_performance/baseline.json with the short benchmark,
#          then run the gate's tests against it (a second run of the benchmark).
# On a one-GPU host set LANES=1 to run the lanes one after the other. JSON and logs go to $OUT.
#
#   bash scripts/gpu_phase11.sh
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" build
if ls .whl/*.whl > /dev/null 2>&1; then  # the openai client (phase 10's server tests), absent from the GPU image
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

lane0() {
    export CUDA_VISIBLE_DEVICES=0
    timeout 200 python3 -m pytest -m cuda phases -q -rfE -p no:cacheprovider \
        --deselect phases/07_weight_loading/test_cuda_qwen3_8b.py \
        --deselect phases/09_engine_integration/test_cuda_qwen3_8b_engine.py \
        --deselect phases/11_performance/test_perf_gate.py > "$OUT/cuda_tests.log" 2>&1
    echo "cuda tests rc=$?" >> "$OUT/lanes.log"
    timeout 60 python3 scripts/bench_floors.py --json "$OUT/floors.json" > /dev/null 2> "$OUT/floors.log"
    echo "floors rc=$?" >> "$OUT/lanes.log"
    timeout 90 python3 scripts/bench_runner_host.py > "$OUT/runner_host.json" 2>> "$OUT/floors.log"
    echo "runner host rc=$?" >> "$OUT/lanes.log"
    timeout 200 python3 -m engine bench latency --preset qwen3-8b --random-weights --compare hf --max-model-len 4160 \
        --prompt-lens 128,4096 --decode-tokens 256 --output "$OUT/latency_qwen3_8b.json" > /dev/null 2> "$OUT/bench.log"
    echo "qwen3 latency rc=$?" >> "$OUT/lanes.log"
    timeout 120 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights --compare hf-eager \
        --prompt-lens 128 --max-model-len 2048 --decode-tokens 128 --output "$OUT/latency_dsv2_lite.json" \
        > /dev/null 2>> "$OUT/bench.log"
    echo "deepseek latency rc=$?" >> "$OUT/lanes.log"
}

lane1() {
    export CUDA_VISIBLE_DEVICES=1
    [ "${LANES:-2}" = 1 ] && export CUDA_VISIBLE_DEVICES=0
    timeout 250 python3 -m engine.bench.short --write-baseline phases/11_performance/baseline.json \
        --output "$OUT/short_baseline.json" > /dev/null 2> "$OUT/perf_gate.log"
    echo "baseline rc=$?" >> "$OUT/lanes.log"
    timeout 300 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/11_performance/test_perf_gate.py \
        >> "$OUT/perf_gate.log" 2>&1
    echo "perf gate rc=$?" >> "$OUT/lanes.log"
    cp phases/11_performance/baseline.json build/perf-short.json "$OUT/" 2>/dev/null
}

if [ "${LANES:-2}" = 1 ]; then lane0; lane1; else lane0 & lane1 & wait; fi

cat "$OUT/lanes.log"
tail -3 "$OUT/cuda_tests.log"; tail -3 "$OUT/perf_gate.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
floors = load("floors.json")
print("floors", json.dumps(floors))
host = out / "runner_host.json"
print("runner host", host.read_text().strip() if host.exists() else None)
for name in ("latency_qwen3_8b.json", "latency_dsv2_lite.json"):
    r = load(name)
    if r:
        print(name, json.dumps({"tok_s": r["decode"]["tok_s"], "ttft": [(t["prompt_len"], round(t["ms"], 1))
              for t in r["ttft"]], "hf": r.get("compare_hf")})[:900])
base = load("baseline.json")
if base:
    print("baseline", json.dumps({k: round(v["value"], 1) for k, v in base["figures"].items()}))
PY
