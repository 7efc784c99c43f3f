#!/usr/bin/env bash
# Issue 13 on a two-GPU host (NCCL; NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# as the machine sets them). Two device calls, each under 10 minutes:
#
#   bash scripts/gpu_x2.sh gates   # every 2-rank torchrun gate of phases 02-11 on NCCL
#                                  # (GATES_TORCHRUN_DEVICE=cuda), the openai client included;
#                                  # then scripts/decode_breakdown.py for Qwen3-8B and V2-Lite
#   bash scripts/gpu_x2.sh bench   # Qwen3-8B random at TP=1 vs TP=2: greedy tokens, weight
#                                  # memory per rank, B=1 decode eager/graphs x custom AR/NCCL,
#                                  # the all-reduce's share of an eager step, offline throughput;
#                                  # DeepSeek-V2-Lite random at EP=1 vs EP=2: tokens, B=1 decode
#
# The openai client travels as wheels in .whl/ (absent from the GPU image). JSON and logs: $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2"

gates() {
    GATES_TORCHRUN_DEVICE=cuda timeout 540 python3 -m gates run --mode torchrun --from 02 --upto 11 --nproc 2 \
        --report "$OUT/gate-torchrun-nccl.json" > "$OUT/gates.log" 2>&1
    echo "gates rc=$?"
    grep -E "^(0[0-9]|1[01]) " "$OUT/gates.log" | tail -12
    grep -E "FAILED|Error|all-reduce over" "$OUT/gates.log" | head -20
    # one GPU each: where a graphed B=1 decode step goes (engine step vs replay, kernels of a replay)
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 scripts/decode_breakdown.py --preset qwen3-8b --max-model-len 4160 \
        --max-num-seqs 1 > "$OUT/breakdown_qwen3.json" 2> "$OUT/breakdown.log" &
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 scripts/decode_breakdown.py --preset deepseek-v2-lite \
        --max-model-len 2048 --max-num-seqs 1 > "$OUT/breakdown_dsv2.json" 2>> "$OUT/breakdown.log" &
    wait
    cat "$OUT/breakdown_qwen3.json" "$OUT/breakdown_dsv2.json"; tail -3 "$OUT/breakdown.log"
}

latency() {  # latency NAME [extra options...]: B=1 decode figures of the Qwen3-8B preset
    local name=$1; shift
    timeout 120 "$@" --preset qwen3-8b --random-weights --max-model-len 4160 --max-num-seqs 8 --prompt-lens 128 \
        --repeats 1 --decode-tokens 128 --split-steps 5 --output "$OUT/$name.json" > /dev/null 2>> "$OUT/bench.log"
    echo "$name rc=$?"
}

bench() {
    local tok="python3 scripts/tp_tokens.py"
    # TP=1 on GPU 0 while DeepSeek EP=1 runs on GPU 1
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout 120 $tok generate --preset qwen3-8b --max-model-len 1024 --max-num-seqs 8 --out "$OUT/tokens_tp1.json" \
            2>> "$OUT/bench.log"
        latency latency_tp1_eager python3 -m engine bench latency --enforce-eager
        latency latency_tp1_graphs python3 -m engine bench latency
        timeout 150 python3 -m engine bench throughput --preset qwen3-8b --random-weights --max-model-len 2048 \
            --output "$OUT/throughput_tp1.json" > /dev/null 2>> "$OUT/bench.log"
        echo "throughput_tp1 rc=$?"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout 150 $tok generate --preset deepseek-v2-lite --max-model-len 1024 --max-num-seqs 8 \
            --out "$OUT/tokens_ep1.json" 2>> "$OUT/bench_ds.log"
        timeout 120 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights --max-model-len 2048 \
            --max-num-seqs 8 --prompt-lens 128 --repeats 1 --decode-tokens 128 --split-steps 5 \
            --output "$OUT/latency_ep1_graphs.json" > /dev/null 2>> "$OUT/bench_ds.log"
        echo "latency_ep1_graphs rc=$?"
    ) &
    wait
    timeout 150 $TORCHRUN scripts/tp_tokens.py generate --preset qwen3-8b --max-model-len 1024 --max-num-seqs 8 \
        --out "$OUT/tokens_tp2.json" 2>> "$OUT/bench.log"
    latency latency_tp2_eager $TORCHRUN -m engine bench latency --enforce-eager --profile /tmp/tp2_eager_trace.json
    latency latency_tp2_eager_nccl $TORCHRUN -m engine bench latency --enforce-eager --disable-custom-all-reduce
    latency latency_tp2_graphs $TORCHRUN -m engine bench latency
    latency latency_tp2_graphs_nccl $TORCHRUN -m engine bench latency --disable-custom-all-reduce
    timeout 150 $TORCHRUN -m engine bench throughput --preset qwen3-8b --random-weights --max-model-len 2048 \
        --output "$OUT/throughput_tp2.json" > /dev/null 2>> "$OUT/bench.log"
    echo "throughput_tp2 rc=$?"
    timeout 150 $TORCHRUN scripts/tp_tokens.py generate --preset deepseek-v2-lite --max-model-len 1024 \
        --max-num-seqs 8 --out "$OUT/tokens_ep2.json" 2>> "$OUT/bench_ds.log"
    timeout 120 $TORCHRUN -m engine bench latency --preset deepseek-v2-lite --random-weights --max-model-len 2048 \
        --max-num-seqs 8 --prompt-lens 128 --repeats 1 --decode-tokens 128 --split-steps 5 \
        --output "$OUT/latency_ep2_graphs.json" > /dev/null 2>> "$OUT/bench_ds.log"
    echo "latency_ep2_graphs rc=$?"
    timeout 60 python3 scripts/tp_tokens.py compare "$OUT/tokens_tp1.json" "$OUT/tokens_tp2.json" \
        > "$OUT/compare_tp.json" 2>> "$OUT/bench.log"
    timeout 60 python3 scripts/tp_tokens.py compare "$OUT/tokens_ep1.json" "$OUT/tokens_ep2.json" \
        > "$OUT/compare_ep.json" 2>> "$OUT/bench_ds.log"
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None
for name in ("compare_tp", "compare_ep"):
    print(name, json.dumps(load(name))[:700])
rows = {}
for name in ("latency_tp1_eager", "latency_tp1_graphs", "latency_tp2_eager", "latency_tp2_eager_nccl",
             "latency_tp2_graphs", "latency_tp2_graphs_nccl", "latency_ep1_graphs", "latency_ep2_graphs"):
    r = load(name)
    rows[name] = r and {"tok_s": round(r["decode"]["tok_s"], 1), "ttft_ms": round(r["ttft"][0]["ms"], 1),
                        "split": r.get("step_split"), "mem": r.get("gpu_monitor")}
    print(name, json.dumps(rows[name])[:600])
for name in ("throughput_tp1", "throughput_tp2"):
    r = load(name)
    print(name, json.dumps(r and r.get("throughput"))[:400])
trace = pathlib.Path("/tmp/tp2_eager_trace.json")
if trace.exists():
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    total = sum(e["dur"] for e in kernels)
    names = ("all_reduce", "allreduce", "nccl", "one_shot", "two_shot", "multimem")
    ar = [e for e in kernels if any(n in e["name"].lower() for n in names)]
    print("tp2 eager trace: kernels", len(kernels), "total us", round(total), "all-reduce kernels", len(ar),
          "us", round(sum(e["dur"] for e in ar)), "share", round(sum(e["dur"] for e in ar) / max(total, 1), 4),
          "names", sorted({e["name"][:60] for e in ar})[:4])
PY
}

"$1"
