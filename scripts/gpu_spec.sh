#!/usr/bin/env bash
# Speculative decoding (n-gram drafts, k = 4) on one H200, in one device call (about 4 minutes):
#   1. phase 13's `cuda` tests (graphed verify steps give plain decoding's tokens);
#   2. the verify step of a Qwen3-8B-shaped model (random bf16 weights) at B=1: a decode step
#      with 4 drafted tokens (5 rows, CUDA graph captured for that row count) against a plain
#      graphed decode step, 512 tokens of context, median of 100 steps (target ratio <= 1.15);
#   3. the demo model at B=1, greedy, on the code-editing and plain-completion workloads, with
#      and without speculation (tokens per target forward, tok/s; the plain engine overlaps steps);
#   4. record: benchmarks.json ($OUT/benchmarks.json) from both reports.
# JSON reports and logs go to $OUT; a summary table is printed last. No network needed.
#
#   bash scripts/gpu_spec.sh                 # or: bash scripts/gpu_spec.sh verify demo summary
source "$(dirname "$0")/gpu_common.sh"  # strict mode, $OUT, PYTHONPATH, logged
SECTIONS=${*:-tests verify demo record summary}

for section in $SECTIONS; do
    case $section in
    tests)
        logged cuda_tests 60 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider phases/13_speculative ;;
    verify)
        logged spec_verify_qwen3_8b 100 python3 -m engine bench spec --preset qwen3-8b --random-weights \
            --num-speculative-tokens 4 --verify-context 512 --verify-steps 100 --output "$OUT/spec_verify_qwen3_8b.json" ;;
    demo)
        logged spec_demo 80 python3 -m engine bench spec --num-speculative-tokens 4 --output "$OUT/spec_demo.json" ;;
    record)
        cp benchmarks.json "$OUT/benchmarks.json" 2>/dev/null
        logged record 30 python3 scripts/record_benchmarks.py "$OUT/spec_verify_qwen3_8b.json" "$OUT/spec_demo.json" \
            --into "$OUT/benchmarks.json" ;;
    summary)
        cat "$OUT/sections.log"
        [ -f "$OUT/cuda_tests.log" ] && tail -3 "$OUT/cuda_tests.log"
        python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else {}
for name in ("spec_verify_qwen3_8b.json", "spec_demo.json"):
    v = load(name).get("verify_step")
    if v:
        print(f"{name}: verify step k={v['num_drafts']} ctx={v['context_len']} graphs={v['graphs']}: "
              f"decode {v['decode_ms']:.3f} ms, verify {v['verify_ms']:.3f} ms, ratio {v['ratio']:.3f} (target <= 1.15)")
print(f"{'demo B=1 workload':<22}{'plain tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'tok/fwd':>9}{'accept':>8}{'same':>6}")
for workload, r in load("spec_demo.json").get("workloads", {}).items():
    p, s = r["plain"], r["spec"]
    print(f"{workload:<22}{p['tok_s']:>12.1f}{s['tok_s']:>12.1f}{r['speedup']:>9.2f}{s['tokens_per_forward']:>9.2f}"
          f"{s['acceptance_rate']:>8.2f}{str(r['same_tokens']):>6}")
PY
        ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
    esac
done
