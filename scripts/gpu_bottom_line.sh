#!/usr/bin/env bash
# The end-to-end figures on one GPU, in one device call: the cuda tests of the phases the
# engine path touches, then (random bf16 weights made on the GPU, no checkpoint) Qwen3-8B B=1
# latency, eager (phase 10) against transformers eager and with CUDA graphs (phase 11), the
# OpenAI server (eager) under `bench serve` at concurrency 1 and 16, and DeepSeek-V2-Lite B=1
# eager latency against transformers eager.
# JSON reports and logs go to $OUT (default ./out).
#
#   bash scripts/gpu_bottom_line.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
status=0

echo "== cuda tests"
timeout 150 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/01_numeric_primitives \
    phases/09_engine_integration phases/10_e2e_acceptance phases/11_performance \
    --deselect phases/09_engine_integration/test_cuda_qwen3_8b_engine.py \
    --deselect phases/10_e2e_acceptance/test_bench.py > "$OUT/cuda.log" 2>&1 || status=1
tail -3 "$OUT/cuda.log"

echo "== Qwen3-8B latency (eager) vs transformers eager"
timeout 110 python3 -m engine bench latency --preset qwen3-8b --random-weights --enforce-eager --compare hf-eager \
    --max-model-len 4160 --output "$OUT/latency_qwen3_8b.json" > /dev/null 2> "$OUT/bench.log" || status=1

echo "== Qwen3-8B latency with CUDA-graph decode"
timeout 80 python3 -m engine bench latency --preset qwen3-8b --random-weights --max-model-len 4160 \
    --output "$OUT/latency_qwen3_8b_graphs.json" > /dev/null 2>> "$OUT/bench.log" || status=1

echo "== Qwen3-8B server: bench serve, 100 prompts, concurrency 1 and 16"
python3 -m engine.bench.preset_server --preset qwen3-8b --port 8011 --max-model-len 4096 --device cuda \
    --enforce-eager > "$OUT/server.log" 2>&1 &
server=$!
for c in 1 16; do
    timeout 100 python3 -m engine bench serve --preset qwen3-8b --random-weights --url http://127.0.0.1:8011 --num-prompts 100 \
        --max-concurrency $c --input-len 128 --output-len 16 --health-timeout 60 \
        --output "$OUT/serve_qwen3_8b_c$c.json" > /dev/null 2>> "$OUT/bench.log" || status=1
done
kill -TERM $server; wait $server

echo "== DeepSeek-V2-Lite latency (eager) vs transformers eager"
timeout 130 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights --enforce-eager \
    --compare hf-eager --prompt-lens 128,1024 --max-model-len 2048 --decode-tokens 64 --split-steps 8 --output "$OUT/latency_dsv2_lite.json" > /dev/null 2>> "$OUT/bench.log" || status=1

python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def show(name, pick):
    path = out / name
    if not path.exists():
        print(f"{name}: missing"); return
    r = json.loads(path.read_text())
    print(name, json.dumps(pick(r)))
lat = lambda r: {"decode_tok_s": r["decode"]["tok_s"], "ttft_ms": [t["ms"] for t in r["ttft"]],
                 "split": r["step_split"], "hf": r.get("compare_hf"), "gpu": r.get("gpu_monitor")}
show("latency_qwen3_8b.json", lat)
show("latency_qwen3_8b_graphs.json", lat)
show("latency_dsv2_lite.json", lat)
for c in (1, 16):
    show(f"serve_qwen3_8b_c{c}.json", lambda r: {k: v for k, v in r["serve"].items() if k != "url"})
PY
exit $status
