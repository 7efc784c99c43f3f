#!/usr/bin/env bash
# Decode GEMVs on one H200 (issues 33 and 34), in sections, each skipped (with a line saying so)
# when fewer than its estimated seconds are left of BUDGET_S (default 580). Two device calls:
#
#   bash scripts/gpu_decode.sh tests kernels fp8 bf16 summary    # correctness, per-linear timings, B=1 FP8 and bf16
#   bash scripts/gpu_decode.sh throughput v2lite floors summary  # FP8 KV cache throughput, V2-Lite, floors
#   bash scripts/gpu_decode.sh launcher eager summary            # the cached Triton launcher: tests, host us, eager
#   bash scripts/gpu_decode.sh bf16 prefill summary              # B=1 and prefill 4,096 end to end; prefill kernels
#
#   tests    the cuda tests of the decode GEMVs and the FP8 KV cache (phase 01's kernels, phase 12's FP8 kernels;
#            TESTS_K: a pytest -k expression to run fewer)
#   kernels  scripts/bench_fp8.py gemm at M = 1, 4, 8 (ROWS) (Qwen3-8B linears: bf16 cuBLAS, the FP8 decode
#            plan's choice among the GEMM's split-K shapes and the FP8 GEMV, TB/s of weight bytes);
#            scripts/bench_kernels.py --only gemv (the bf16 GEMV's best config against cuBLAS; GEMV_BENCH=0: not)
#   attention scripts/bench_kernels.py --only decode_fp8: decode attention at the offline throughput's 256
#            sequences over bf16 and e4m3 caches: the default launch and other key tiles, fp16 or bf16 dots
#   fp8      Qwen3-8B random, online FP8: B=1 decode with graphs, TTFT of 4,096 tokens
#   bf16     Qwen3-8B random, bf16: the same, with cuBLAS linears (the default)
#   bf16gemv the same with AGENT_INFER_DECODE_GEMV=1 (the bf16 GEMV planned per shape against cuBLAS)
#   throughput  Qwen3-8B random, offline throughput (nano-vllm shape), bf16 cache then --kv-cache-dtype fp8
#   fp8throughput  the same with online FP8 weights (--quantization fp8), bf16 cache
#   agreement   scripts/bench_fp8.py agreement (Qwen3-8B: FP8 against bf16 on the same random weights)
#   qwen3moe Qwen3-30B-A3B random, bf16 then online FP8: B=1 decode with graphs, TTFT of 1,024 tokens
#   v2lite   DeepSeek-V2-Lite random, bf16 then online FP8: B=1 decode with graphs (the FP8 expert GEMV)
#   launcher phase 01's cuda tests (the cached Triton launcher's among them, every kernel launched through it),
#            then scripts/bench_dispatch.py (host us a call: our wrapper, the whole call, Triton's JIT launch, the
#            compiled kernel's launcher)
#   eager    Qwen3-8B random, --enforce-eager, B=1 decode beside transformers eager (qwen3_8b_b1_eager_tok_s),
#            then scripts/eager_host_profile.py (where the eager step's host time goes)
#   prefill  scripts/bench_kernels.py --only prefill_sweep prefill (the Triton prefill kernel's launch shapes
#            beside torch SDPA's backends; the op)
#   floors   scripts/bench_floors.py: copy floor, cuBLAS matmul chain, prefill GEMM floor
#   summary  the figures side by side; $OUT/benchmarks.json from the reports (record_benchmarks.py)
source "$(dirname "$0")/gpu_common.sh"  # strict mode, wheels, $OUT, PYTHONPATH, fits, logged

latency() {  # latency NAME EXTRA...: Qwen3-8B B=1 latency into $OUT/latency_NAME.json
    local name=$1; shift
    timeout 200 python3 -m engine bench latency --preset qwen3-8b --random-weights --max-model-len 4400 \
        --prompt-lens 4096 --decode-tokens 256 "$@" --output "$OUT/latency_$name.json" > /dev/null \
        2>> "$OUT/latency.log"
    echo "$name latency rc=$? at $SECONDS s"
}

for section in ${*:-tests kernels fp8 bf16 summary}; do
    case $section in
    tests)
        fits 150 tests || continue
        timeout 140 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
            phases/01_numeric_primitives/test_decode_gemv.py phases/01_numeric_primitives/test_fp8_kv_cache.py \
            phases/12_quantization/test_fp8_kernels.py phases/12_quantization/test_fp8_decode.py phases/12_quantization/test_fp8_gemv.py \
            phases/12_quantization/test_fp8_mma_gemv.py -k "${TESTS_K:-not nothing}" \
            > "$OUT/tests.log" 2>&1
        echo "cuda tests rc=$? at $SECONDS s: $(tail -1 "$OUT/tests.log")" ;;
    kernels)
        fits 260 kernels || continue
        timeout 150 python3 scripts/bench_fp8.py gemm --rows ${ROWS:-1 4 8} --json "$OUT/fp8_gemm.json" > /dev/null \
            2> "$OUT/kernels.log"
        echo "fp8 gemm rc=$? at $SECONDS s"
        [ "${GEMV_BENCH:-1}" = 0 ] && continue
        timeout 110 python3 scripts/bench_kernels.py --only gemv --json "$OUT/gemv.json" > "$OUT/gemv.txt" \
            2>> "$OUT/kernels.log"
        echo "bf16 gemv rc=$? at $SECONDS s" ;;
    attention)
        fits 200 attention || continue
        timeout 190 python3 scripts/bench_kernels.py --only decode_fp8 --json "$OUT/decode_attention.json" \
            > "$OUT/decode_attention.txt" 2> "$OUT/attention.log"
        echo "decode attention rc=$? at $SECONDS s" ;;
    launcher)
        fits 300 launcher || continue
        timeout 240 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/01_numeric_primitives \
            > "$OUT/launcher_tests.log" 2>&1
        echo "phase 01 cuda tests rc=$? at $SECONDS s: $(tail -1 "$OUT/launcher_tests.log")"
        timeout 50 python3 scripts/bench_dispatch.py --calls 500 --json "$OUT/dispatch.json" > /dev/null \
            2> "$OUT/dispatch.log"
        echo "dispatch rc=$? at $SECONDS s"; cat "$OUT/dispatch.log" ;;
    eager)
        fits 260 eager || continue
        timeout 180 python3 -m engine bench latency --max-model-len 4160 --enforce-eager --preset qwen3-8b \
            --random-weights --compare hf-eager --prompt-lens 128 --decode-tokens 64 \
            --output "$OUT/latency_qwen3_8b_eager.json" > /dev/null 2>> "$OUT/latency.log"
        echo "eager latency rc=$? at $SECONDS s"
        timeout 70 python3 scripts/eager_host_profile.py --steps 20 --json "$OUT/eager_profile.json" \
            > "$OUT/eager_profile.txt" 2>&1
        echo "eager profile rc=$? at $SECONDS s: $(sed -n 2p "$OUT/eager_profile.txt")" ;;
    prefill)
        fits 200 prefill || continue
        timeout 190 python3 scripts/bench_kernels.py --only prefill_sweep prefill --json "$OUT/prefill.json" \
            > "$OUT/prefill.txt" 2> "$OUT/prefill.log"
        echo "prefill kernels rc=$? at $SECONDS s"; tail -4 "$OUT/prefill.txt" ;;
    fp8)
        fits 200 fp8 || continue
        latency qwen3_8b_fp8 --quantization fp8 ;;
    bf16)
        fits 160 bf16 || continue
        latency qwen3_8b_bf16 ;;
    bf16gemv)
        fits 160 bf16gemv || continue
        AGENT_INFER_DECODE_GEMV=1 latency qwen3_8b_bf16_gemv ;;
    throughput)
        fits 330 throughput || continue
        for kv in auto fp8; do
            timeout 160 python3 -m engine bench throughput --preset qwen3-8b --random-weights --kv-cache-dtype $kv \
                --output "$OUT/throughput_qwen3_8b_$kv.json" > /dev/null 2>> "$OUT/throughput.log"
            echo "qwen3 throughput kv $kv rc=$? at $SECONDS s"
        done ;;
    fp8throughput)
        fits 250 fp8throughput || continue
        timeout 240 python3 -m engine bench throughput --preset qwen3-8b --random-weights --quantization fp8 \
            --output "$OUT/throughput_qwen3_8b_fp8w.json" >> "$OUT/throughput.log" 2>&1
        echo "qwen3 fp8 throughput rc=$? at $SECONDS s" ;;
    agreement)
        fits 150 agreement || continue
        timeout 140 python3 scripts/bench_fp8.py agreement --json "$OUT/agreement.json" > /dev/null \
            2>> "$OUT/agreement.log"
        echo "fp8 agreement rc=$? at $SECONDS s" ;;
    qwen3moe)
        fits 330 qwen3moe || continue
        for q in bf16 fp8; do
            extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
            timeout 160 python3 -m engine bench latency --preset qwen3-30b-a3b --random-weights \
                --max-model-len 2048 --prompt-lens 1024 --decode-tokens 128 "${extra[@]}" \
                --output "$OUT/latency_qwen3_30b_a3b_$q.json" > /dev/null 2>> "$OUT/latency.log"
            echo "qwen3_30b_a3b $q latency rc=$? at $SECONDS s"
        done ;;
    v2lite)
        fits 260 v2lite || continue
        for q in bf16 fp8; do
            extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
            timeout 130 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights \
                --max-model-len 2048 --prompt-lens 128 --decode-tokens 128 "${extra[@]}" \
                --output "$OUT/latency_dsv2_lite_$q.json" > /dev/null 2>> "$OUT/latency.log"
            echo "dsv2_lite $q latency rc=$? at $SECONDS s"
        done ;;
    floors)
        fits 120 floors || continue
        timeout 110 python3 scripts/bench_floors.py --json "$OUT/floors.json" > /dev/null 2> "$OUT/floors.log"
        echo "floors rc=$? at $SECONDS s" ;;
    summary)
        python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
gemm = load("fp8_gemm.json")
if gemm:
    print(f"{'linear N x K':>14} {'M':>4} {'bf16 us':>8} {'fp8 us':>8} {'scaled_mm':>9} {'fp8 TB/s':>8}  fp8 plan")
    for r in gemm["gemm"]:
        print(f"{r['n']:>6} x {r['k']:<6} {r['m']:>4} {r['bf16_us']:8.1f} {r['fp8_triton_us']:8.1f} "
              f"{r.get('fp8_scaled_mm_us') or float('nan'):9.1f} "
              f"{r.get('fp8_triton_tb_s', float('nan')):8.2f}  {r.get('fp8_triton_config')}")
attention = load("decode_attention.json")
if attention:
    for label in ("bf16", "e4m3"):
        rows = sorted((r for r in attention["results"] if label in r["op"]), key=lambda r: r["ours_us"])
        for r in rows[:3] + [r for r in rows if "tile=default" in r["shape"]]:
            print(f"{r['op']:24} {r['shape']:44} {r['ours_us']:7.1f} us {r['gbps']:6.0f} GB/s")
gemv = load("gemv.json")
if gemv:
    for r in gemv["results"]:
        print(f"bf16 gemv {r['shape']:34} ours {r['ours_us']:7.1f} us  cuBLAS {r.get('cublas_us', float('nan')):7.1f} us  "
              f"best {r.get('best_config')}")
for name in ("qwen3_8b_bf16", "qwen3_8b_eager", "qwen3_8b_bf16_gemv", "qwen3_8b_fp8", "dsv2_lite_bf16", "dsv2_lite_fp8",
             "qwen3_30b_a3b_bf16", "qwen3_30b_a3b_fp8"):
    r = load(f"latency_{name}.json")
    if r:
        print(f"{name:22} decode {r['decode']['tok_s']:7.1f} tok/s   TTFT {r['ttft'][0]['prompt_len']} "
              f"{r['ttft'][0]['ms']:7.1f} ms")
for kind in ("auto", "fp8", "fp8w"):
    r = load(f"throughput_qwen3_8b_{kind}.json")
    if r:
        print(f"throughput {dict(auto='bf16', fp8='bf16, fp8 KV', fp8w='fp8 weights')[kind]:14} "
              f"{r['throughput']['output_tok_s']:8.1f} out tok/s")
agreement = load("agreement.json")
if agreement:
    print("agreement", json.dumps(agreement["agreement"])[:800])
floors = load("floors.json")
if floors:
    print("floors", json.dumps({k: floors[k] for k in ("copy_floor_tok_s", "matmul_chain_tok_s",
                                                       "prefill_gemm_tok_s") if k in floors}))
PY
        reports=$(ls "$OUT"/latency_qwen3_8b_bf16.json "$OUT"/latency_qwen3_8b_eager.json "$OUT"/latency_qwen3_8b_fp8.json "$OUT"/latency_dsv2_lite_*.json \
            "$OUT"/latency_qwen3_30b_a3b_*.json \
            "$OUT"/throughput_qwen3_8b_*.json "$OUT"/floors.json 2>/dev/null)
        cp benchmarks.json "$OUT/benchmarks.json"
        [ -n "$reports" ] && python3 scripts/record_benchmarks.py $reports --into "$OUT/benchmarks.json" \
            > /dev/null 2>> "$OUT/latency.log" ;;
    *) echo "unknown section $section (tests, kernels, attention, launcher, eager, prefill, fp8, bf16, bf16gemv, throughput,"
       echo "fp8throughput, agreement, v2lite,"
       echo "qwen3moe, floors, summary)"
       exit 2 ;;
    esac
done
