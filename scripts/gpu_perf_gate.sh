#!/usr/bin/env bash
# Issue 30's device calls: the performance gate's baseline and its check, each call naming its host.
#   bash scripts/gpu_perf_gate.sh record   record phases/11_performance/baseline.json (normalised + raw figures)
#   bash scripts/gpu_perf_gate.sh check    python -m gates run --only 11 against the committed baseline
#                                          (the unchanged tree must pass; the injected 15 % slowdown must be flagged)
# Each prints the host's identity first (GPU UUID, CPU model, boot id), so two calls can say whether
# they ran on one host or two. Logs and reports go to $OUT.
source scripts/gpu_common.sh
{
    nvidia-smi --query-gpu=name,uuid,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
    grep -m1 "model name" /proc/cpuinfo
    echo "cores $(nproc); boot $(cat /proc/sys/kernel/random/boot_id)"
} | tee "$OUT/host.txt"
case "${1:-}" in
    record)
        logged record 560 python3 -m engine.bench.short --write-baseline phases/11_performance/baseline.json \
            --output "$OUT/short_baseline.json"
        cp phases/11_performance/baseline.json "$OUT/"
        tail -14 "$OUT/record.log" ;;
    check)
        logged gate11 570 python3 -m gates run --only 11 --report "$OUT/gate-report.json"
        cp build/perf-short.json "$OUT/" 2>/dev/null
        grep -E "PASS|FAIL|SKIP|BLOCK|passed|failed|regress|qwen3_decode_b1_per_chain" "$OUT/gate11.log" | tail -30 ;;
    *) echo "usage: $0 record|check" >&2; exit 2 ;;
esac
cat "$OUT/sections.log"
echo "elapsed ${SECONDS}s"
