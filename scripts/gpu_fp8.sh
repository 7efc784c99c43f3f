#!/usr/bin/env bash
# Issue 24's H200 runs (FP8 W8A8) in sections, each skipped (with a line saying so) when fewer
# than its estimated seconds are left of BUDGET_S (default 580). Four device calls cover it:
#
#   bash scripts/gpu_fp8.sh tests                          # correctness on the GPU (a whole call when cold)
#   bash scripts/gpu_fp8.sh kernels agreement              # GEMM timings, FP8 against bf16
#   bash scripts/gpu_fp8.sh qwen3 v2lite                   # B=1 decode and prefill, FP8 beside bf16
#   bash scripts/gpu_fp8.sh throughput summary             # offline throughput; benchmarks.json
#
#   tests      the whole phase through its gate (its single run holds the cuda tests: Triton kernels in
#              bf16, CUDA-graph replay, the scaled_mm switch)
#   decode     the decode launches' cuda tests (the GEMM's split-K, the FMA and MMA GEMVs), then
#              scripts/bench_fp8.py gemv: Qwen3-8B shapes at M = 1 and 8 as a decode step meets them
#              (weights from HBM), bf16 cuBLAS vs every FP8 decode launch vs the one decode_plan chose
#   batch      scripts/bench_fp8.py gemv --sweep at 128, 192 and 256 rows: bf16 cuBLAS, the plan's
#              launches (scaled_mm among them) and every Triton GEMM launch of its SWEEP, weights from HBM
#   kernels    scripts/bench_fp8.py gemm: Qwen3-8B shapes at M = 1, 8, 16, 256, 4096, bf16 cuBLAS vs FP8 Triton
#              (and its unsplit GEMM up to 16 rows) vs FP8 scaled_mm
#   agreement  scripts/bench_fp8.py agreement: FP8 vs bf16 on the same random Qwen3-8B weights
#              (greedy first divergence, the bf16 logit gap there, relative logits error)
#   qwen3      Qwen3-8B random, bf16 then FP8 (online): B=1 decode with graphs, TTFT of 4,096 tokens
#   throughput Qwen3-8B random, offline throughput (nano-vllm shape), bf16 then FP8
#   v2lite     DeepSeek-V2-Lite random, bf16 then FP8: B=1 decode with graphs
#   summary    $OUT/benchmarks.json: qwen3_8b_fp8_b1_graphs_tok_s beside qwen3_8b_bf16_b1_graphs_tok_s,
#              and the ratios the targets are stated in
source "$(dirname "$0")/gpu_common.sh"  # strict mode, $OUT, PYTHONPATH, fits

tests() {  # the gate's single run holds the cuda tests: 271 s on a fresh machine (cold Triton caches)
    fits 480 tests || return
    timeout 470 python3 -m gates run --only 12 --report "$OUT/gate-report-12.json" > "$OUT/gate12.log" 2>&1
    echo "gate 12 rc=$? at $SECONDS s: $(grep -m1 '^12 ' "$OUT/gate12.log")"
}

decode() {
    fits 300 decode || return
    timeout 150 python3 -m pytest phases/12_quantization/test_fp8_mma_gemv.py phases/12_quantization/test_fp8_gemv.py \
        phases/12_quantization/test_fp8_decode.py -m cuda -q -p no:cacheprovider > "$OUT/decode_tests.log" 2>&1
    echo "decode cuda tests rc=$? at $SECONDS s: $(tail -1 "$OUT/decode_tests.log")"
    timeout 240 python3 scripts/bench_fp8.py gemv --rows 1 8 --json "$OUT/fp8_gemv.json" > /dev/null \
        2> "$OUT/gemv.log"
    echo "fp8 gemv rc=$? at $SECONDS s"
}

batch() {
    fits 210 batch || return
    timeout 200 python3 scripts/bench_fp8.py gemv --rows 128 192 256 --sweep --json "$OUT/fp8_batch.json" \
        > /dev/null 2> "$OUT/batch.log"
    echo "fp8 batch sweep rc=$? at $SECONDS s"
}

kernels() {
    fits 180 kernels || return   # the FP8 decode plan times its launch shapes (compiles) for M = 1, 8, 16
    timeout 170 python3 scripts/bench_fp8.py gemm --json "$OUT/fp8_gemm.json" > /dev/null 2> "$OUT/kernels.log"
    echo "fp8 gemm rc=$? at $SECONDS s"
}

agreement() {
    fits 150 agreement || return
    timeout 140 python3 scripts/bench_fp8.py agreement --json "$OUT/fp8_agreement.json" > /dev/null \
        2> "$OUT/agreement.log"
    echo "agreement rc=$? at $SECONDS s"
}

latency() {  # latency NAME PRESET EXTRA...: one B=1 latency run into $OUT/latency_NAME.json
    local name=$1 preset=$2; shift 2
    timeout 200 python3 -m engine bench latency --preset "$preset" --random-weights "$@" \
        --output "$OUT/latency_$name.json" > /dev/null 2>> "$OUT/$name.log"
    echo "$name latency rc=$? at $SECONDS s"
}

qwen3() {
    fits 300 qwen3 || return
    for q in bf16 fp8; do
        extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
        latency "qwen3_8b_$q" qwen3-8b --max-model-len 4400 --prompt-lens 4096 --decode-tokens 256 "${extra[@]}"
    done
}

throughput() {
    fits 330 throughput || return
    for q in bf16 fp8; do
        extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
        timeout 240 python3 -m engine bench throughput --preset qwen3-8b --random-weights "${extra[@]}" \
            --output "$OUT/throughput_qwen3_8b_$q.json" > /dev/null 2>> "$OUT/throughput.log"
        echo "qwen3 $q throughput rc=$? at $SECONDS s"
    done
}

v2lite() {
    fits 200 v2lite || return
    latency deepseek_v2_lite_bf16 deepseek-v2-lite --max-model-len 2048 --prompt-lens 128 --decode-tokens 128
    latency deepseek_v2_lite_fp8 deepseek-v2-lite --max-model-len 2048 --prompt-lens 128 --decode-tokens 128 \
        --quantization fp8
}

summary() {
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
figures = load("benchmarks.json") or {}
def ratio(a, b):
    return a / b if a and b else None
for name in ("qwen3_8b", "deepseek_v2_lite"):
    runs = {q: load(f"latency_{name}_{q}.json") for q in ("bf16", "fp8")}
    decode = {q: r["decode"]["tok_s"] if r else None for q, r in runs.items()}
    figures[f"{name}_bf16_b1_graphs_tok_s"], figures[f"{name}_fp8_b1_graphs_tok_s"] = decode["bf16"], decode["fp8"]
    figures[f"{name}_fp8_vs_bf16_decode"] = ratio(decode["fp8"], decode["bf16"])   # V2-Lite target >= 1.4
    if name == "qwen3_8b":
        prefill = {q: 4096 / (r["ttft"][0]["ms"] / 1000) if r else None for q, r in runs.items()}
        figures["qwen3_8b_bf16_prefill_4096_tok_s"], figures["qwen3_8b_fp8_prefill_4096_tok_s"] = prefill.values()
        figures["qwen3_8b_fp8_vs_bf16_prefill"] = ratio(prefill["fp8"], prefill["bf16"])   # target >= 1.5
thr = {q: load(f"throughput_qwen3_8b_{q}.json") for q in ("bf16", "fp8")}
out_tok = {q: r["throughput"]["output_tok_s"] if r else None for q, r in thr.items()}
figures["qwen3_8b_bf16_throughput_output_tok_s"], figures["qwen3_8b_fp8_throughput_output_tok_s"] = out_tok.values()
figures["qwen3_8b_fp8_vs_bf16_throughput"] = ratio(out_tok["fp8"], out_tok["bf16"])      # target >= 1.3
agreement = load("fp8_agreement.json")
if agreement:
    figures["qwen3_8b_fp8_agreement"] = agreement["agreement"]
(out / "benchmarks.json").write_text(json.dumps(figures, indent=1))
print(json.dumps(figures))
PY
}

for s in ${*:-tests kernels agreement summary}; do
    case $s in tests | decode | batch | kernels | agreement | qwen3 | throughput | v2lite | summary) "$s" ;;
        *) echo "unknown section $s (tests, decode, batch, kernels, agreement, qwen3, throughput, v2lite, summary)"; exit 2 ;; esac
done
