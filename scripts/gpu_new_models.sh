#!/usr/bin/env bash
# Issue 25's H200 figures in one device call (one GPU, random bf16 weights, ours and transformers
# in the same process on the same weights), in sections run in the order given, each skipped
# (with a line saying so) when fewer than its estimated seconds are left of BUDGET_S (default 580):
#
#   bash scripts/gpu_new_models.sh                 # llama qwen3moe summary
#   bash scripts/gpu_new_models.sh llama summary   # or one model per call
#
#   llama     Llama-3-8B shape: the cuBLAS matmul-chain floor (scripts/bench_floors.py), then B=1
#             decode with CUDA graphs against transformers eager and static cache + compile
#   qwen3moe  Qwen3-30B-A3B shape (61 GB bf16; ours and transformers' copy fit one H200 together):
#             B=1 decode with graphs and TTFT of a 1,024-token prompt, against transformers eager
#   summary   $OUT/benchmarks.json: llama3_8b_b1_graphs_tok_s, qwen3_30b_a3b_b1_graphs_tok_s and the
#             ratios the targets are stated in (merged with a benchmarks.json already in $OUT)
source "$(dirname "$0")/gpu_common.sh"  # strict mode, $OUT, PYTHONPATH, fits

llama() {
    fits 300 llama || return
    timeout 60 python3 scripts/bench_floors.py --preset llama3-8b --json "$OUT/floors_llama3_8b.json" \
        > /dev/null 2> "$OUT/llama.log"
    echo "llama floors rc=$? at $SECONDS s"
    timeout 240 python3 -m engine bench latency --preset llama3-8b --random-weights --compare hf \
        --max-model-len 2048 --prompt-lens 128,1024 --decode-tokens 256 --output "$OUT/latency_llama3_8b.json" \
        > /dev/null 2>> "$OUT/llama.log"
    echo "llama latency rc=$? at $SECONDS s"
}

qwen3moe() {
    fits 240 qwen3moe || return
    timeout 230 python3 -m engine bench latency --preset qwen3-30b-a3b --random-weights --compare hf-eager \
        --max-model-len 2048 --prompt-lens 1024 --decode-prompt-len 1024 --decode-tokens 64 --repeats 3 \
        --output "$OUT/latency_qwen3_30b_a3b.json" > /dev/null 2> "$OUT/qwen3moe.log"
    echo "qwen3moe latency rc=$? at $SECONDS s"
}

summary() {
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
figures = load("benchmarks.json") or {}
floors, llama, moe = load("floors_llama3_8b.json"), load("latency_llama3_8b.json"), load("latency_qwen3_30b_a3b.json")
if llama:
    ours, hf = llama["decode"]["tok_s"], llama.get("compare_hf", {})
    figures["llama3_8b_b1_graphs_tok_s"] = ours
    figures["llama3_8b_hf_eager_tok_s"] = hf.get("eager", {}).get("tok_s")
    figures["llama3_8b_hf_static_compile_tok_s"] = hf.get("static_compile", {}).get("tok_s")
    figures["llama3_8b_vs_hf_static_compile"] = hf.get("ratios", {}).get("ours_vs_static_compile")  # target >= 1.6
    figures["llama3_8b_ttft_ms"] = {t["prompt_len"]: t["ms"] for t in llama["ttft"]}
if floors:
    figures["llama3_8b_matmul_chain_tok_s"] = floors["matmul_chain_tok_s"]
    if llama:
        figures["llama3_8b_vs_matmul_chain"] = llama["decode"]["tok_s"] / floors["matmul_chain_tok_s"]  # >= 0.9
if moe:
    eager = moe.get("compare_hf", {}).get("eager", {})
    figures["qwen3_30b_a3b_b1_graphs_tok_s"] = moe["decode"]["tok_s"]  # target >= 150
    figures["qwen3_30b_a3b_hf_eager_tok_s"] = eager.get("tok_s")
    figures["qwen3_30b_a3b_vs_hf_eager"] = moe.get("compare_hf", {}).get("ratios", {}).get("ours_vs_eager")  # >= 5
    figures["qwen3_30b_a3b_ttft_1024_ms"] = next((t["ms"] for t in moe["ttft"] if t["prompt_len"] == 1024), None)
    figures["qwen3_30b_a3b_hf_eager_ttft_1024_ms"] = eager.get("ttft_ms")
(out / "benchmarks.json").write_text(json.dumps(figures, indent=1))
print(json.dumps(figures))
PY
}

for s in ${*:-llama qwen3moe summary}; do
    case $s in llama | qwen3moe | summary) "$s" ;; *) echo "unknown section $s (llama, qwen3moe, summary)"; exit 2 ;; esac
done
