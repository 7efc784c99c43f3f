#!/usr/bin/env bash
# Issue 33's serving steps on the H200: piecewise CUDA graphs for steps that carry prefill chunks.
# Sections run in order, each skipped (with a line saying so) when fewer than its estimated seconds
# are left of BUDGET_S (default 580):
#
#   tests     phase 11's cuda tests of the graphs (piecewise and decode), then the cuda tests of 09 and
#             10 (every engine there captures both by default)
#   profile   scripts/mixed_step_profile.py on Qwen3-8B: host dispatch against GPU kernels of a step with
#             a 128/512/2,048-token prompt alone and beside 64 decodes, piecewise graphs on, then off
#   ttft      python -m engine bench latency, Qwen3-8B: TTFT of 128 and 4,096 tokens and B=1 decode
#   serve     python -m engine bench serve --launch, Qwen3-8B, 64 concurrent, 512 in / 128 out, 256 requests
#   budgets   the same at each prefill budget per step (--max-num-batched-tokens) of $BUDGETS
#   besides   the same at each cap on prompt tokens beside decodes (--prefill-tokens-beside-decodes) of $BESIDES
#   throughput python -m engine bench throughput, Qwen3-8B (nano-vllm's shape): the default (offline work runs
#             uncapped), then with serve's cap of 384 prompt tokens beside decodes
#   gate11    python -m gates run --only 11
#   summary   one line per figure
source "$(dirname "$0")/gpu_common.sh"  # strict mode, $OUT, PYTHONPATH, fits, logged

tests() {
    fits 200 tests || return
    logged tests 190 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/11_performance/test_piecewise_graphs.py \
        phases/11_performance/test_cuda_graphs.py
    echo "phase 11 cuda tests at $SECONDS s: $(tail -1 "$OUT/tests.log")"
}

tests0910() {
    fits 300 tests0910 || return
    logged tests0910 290 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/09_engine_integration \
        phases/10_e2e_acceptance
    echo "phase 09/10 cuda tests at $SECONDS s: $(tail -1 "$OUT/tests0910.log")"
}

profile() {
    fits 150 profile || return
    logged profile_on 140 python3 scripts/mixed_step_profile.py --preset qwen3-8b --max-model-len 4096 --repeat 3 \
        --output "$OUT/profile_on.json"
    fits 100 profile_off || return
    logged profile_off 90 python3 scripts/mixed_step_profile.py --preset qwen3-8b --max-model-len 4096 --repeat 3 \
        --prefill-graph-tokens 0 --output "$OUT/profile_off.json"
}

ttft() {
    fits 120 ttft || return
    logged ttft 110 python3 -m engine bench latency --preset qwen3-8b --random-weights --max-model-len 4400 \
        --prompt-lens 128,4096 --decode-tokens 256 --output "$OUT/latency_qwen3_8b.json"
}

serve_run() {  # NAME SECONDS [FLAGS...]: bench serve --launch, Qwen3-8B load; report $OUT/serve_qwen3_8b_c64NAME.json
    local name=$1 seconds=$2
    shift 2
    logged "serve$name" "$seconds" python3 -m engine bench serve --launch --preset qwen3-8b --random-weights \
        --max-concurrency 64 --num-prompts 256 --input-len 512 --output-len 128 "$@" \
        --output "$OUT/serve_qwen3_8b_c64$name.json"
}

serve() {
    fits 200 serve || return
    serve_run "" 190
}

budgets() {  # serve at each prefill budget per step of $BUDGETS (default 512 1024 2048)
    for tokens in ${BUDGETS:-512 1024 2048}; do
        fits 60 "serve $tokens" || return
        serve_run "_budget_$tokens" 120 --max-num-batched-tokens "$tokens"
    done
}

besides() {  # serve at each cap on prompt tokens beside decodes of $BESIDES (default 256 512 0)
    for tokens in ${BESIDES:-256 512 0}; do
        fits 60 "serve beside $tokens" || return
        serve_run "_beside_$tokens" 120 --prefill-tokens-beside-decodes "$tokens"
    done
}

throughput() {  # the offline default (no cap on prompt tokens beside decodes), then serve's cap
    fits 170 throughput || return
    logged throughput 160 python3 -m engine bench throughput --preset qwen3-8b --random-weights \
        --output "$OUT/throughput_qwen3_8b.json"
    fits 170 "throughput beside 384" || return
    logged throughput_beside_384 160 python3 -m engine bench throughput --preset qwen3-8b --random-weights \
        --prefill-tokens-beside-decodes 384 --output "$OUT/throughput_qwen3_8b_beside_384.json"
}

gate11() {
    fits 150 gate11 || return
    logged gate11 140 python3 -m gates run --only 11 --report "$OUT/gate-report-11.json"
}

summary() {
    python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
for name in ("profile_on.json", "profile_off.json"):
    report = load(name)
    for case in (report or {}).get("cases", []):
        print(f"{name[:-5]:12} decodes {case['decodes']:3} prompt {case['prompt_len']:5}: wall {case['wall_ms']:6.1f} ms"
              f"  launch {case['launch_ms']:6.1f} ms  kernels {case['kernel_ms']:6.1f} ms")
latency = load("latency_qwen3_8b.json")
if latency:
    print("latency: decode", round(latency["decode"]["tok_s"], 1), "tok/s; TTFT",
          {t["prompt_len"]: round(t["ms"], 1) for t in latency["ttft"]})
for path in sorted(out.glob("throughput_qwen3_8b*.json")):
    print(path.stem, json.loads(path.read_text())["throughput"])
for path in sorted(out.glob("serve_qwen3_8b_c64*.json")):
    s = json.loads(path.read_text())["serve"]
    print(path.stem, json.dumps({k: s.get(k) for k in ("completed", "failed", "output_throughput", "ttft_ms",
                                                       "itl_ms")}))
EOF
    cat "$OUT/sections.log" 2>/dev/null
}

for section in "$@"; do
    "$section"
done
