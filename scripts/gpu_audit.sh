#!/usr/bin/env bash
# Issues 30 and 31 on the device, in calls of at most ~10 minutes:
#   bash scripts/gpu_audit.sh gate   the performance gate alone on a quiet host (python -m gates run --only 11),
#                                    then every `cuda` test of the phases beside the mutation audit of the
#                                    first phases on the CPU cores (CUDA hidden from it)
#   bash scripts/gpu_audit.sh audit  the mutation audit of the phases the first call left
# The audit is CPU work: the device host has 16 cores, the development machine 2, and a full audit
# runs each of ~100 mutations through its phase's gate. Each phase's audit writes its own report
# ($OUT/audit-NN.json), so a call cut short keeps what finished; $OUT/sections.log lists what ran.
source scripts/gpu_common.sh
{
    nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
    grep -m1 "model name" /proc/cpuinfo
    echo "cores $(nproc); boot $(cat /proc/sys/kernel/random/boot_id)"
} | tee "$OUT/host.txt"

audit_phases() {  # audit_phases NN... : each phase's mutations, 6 at once, while the budget lasts
    for phase in "$@"; do
        fits 60 "audit $phase" || break
        CUDA_VISIBLE_DEVICES= logged "audit-$phase" $(( ${BUDGET_S:-580} - SECONDS - 10 )) \
            python3 -m gates audit --phase "$phase" --jobs 6 --report "$OUT/audit-$phase.json"
        tail -n 4 "$OUT/audit-$phase.log"
    done
}

case "${1:-}" in
    gate)
        logged gate11 300 python3 -m gates run --only 11 --report "$OUT/gate11.json"
        grep -E "^11 |passed|failed|regress" "$OUT/gate11.log" | tail -8
        logged cuda_tests 420 python3 -m pytest -m cuda -n 3 --dist loadfile -q -rfE -p no:cacheprovider phases \
            --deselect phases/11_performance/test_perf_gate.py &
        audit_phases 02 03 04 05 06 10
        wait
        tail -n 15 "$OUT/cuda_tests.log" ;;
    audit)
        audit_phases 07 08 09 12 13 01 ;;
    *) echo "usage: $0 gate|audit" >&2; exit 2 ;;
esac
cat "$OUT/sections.log"
echo "elapsed ${SECONDS}s"
tar czf /tmp/gpu_audit.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_audit.tgz "$OUT/"  # one file comes back
