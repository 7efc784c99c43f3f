#!/usr/bin/env bash
# Structured outputs under load on one H200, in one device call (about 6 minutes; issue 32):
#   1. bench serve --launch --structured json_schema,tools: the Qwen3-8B preset with random weights,
#      64 concurrent, 128 prompts of 512 tokens, max_tokens 128; per workload the plain load, then
#      the constrained one under the same load (response_format json_schema on /v1/completions; tools
#      with tool_choice "required" on /v1/chat/completions); every constrained answer validated;
#      the grammar's compile ms (cold, cached) and host us per 64-row mask fill;
#   2. record: $OUT/benchmarks.json (qwen3_8b_structured_vs_plain_throughput_ratio and the tools one);
#   3. summary: the table.
# The preset has no tokenizer of its own: the grammars are built over $TOKENIZER (default the demo
# model's, 8,192 tokens, the rest of Qwen3's 151,936 ids never allowed; a Qwen3 tokenizer directory
# carried to the device gives Qwen3's vocabulary and mask costs) and the chat template that renders
# the tools is engine/bench/hermes_tools.jinja (Qwen's hermes <tool_call> format).
#
#   bash scripts/gpu_structured.sh            # or: TOKENIZER=DIR bash scripts/gpu_structured.sh serve summary
source "$(dirname "$0")/gpu_common.sh"  # strict mode, wheels, $OUT, PYTHONPATH, logged
SECTIONS=${*:-serve record summary}
TOKENIZER=${TOKENIZER:-engine/default_model}

for section in $SECTIONS; do
    case $section in
    serve)
        logged structured 480 python3 -m engine bench serve --launch --preset qwen3-8b --random-weights \
            --tokenizer "$TOKENIZER" --chat-template engine/bench/hermes_tools.jinja --structured json_schema,tools \
            --max-model-len 2048 --num-prompts 128 --max-concurrency 64 --input-len 512 --output-len 128 \
            --output "$OUT/structured.json" ;;
    record)
        cp benchmarks.json "$OUT/benchmarks.json" 2>/dev/null
        logged record 60 python3 scripts/record_benchmarks.py "$OUT/structured.json" --into "$OUT/benchmarks.json" ;;
    summary)
        cat "$OUT/sections.log"
        python3 - "$OUT/structured.json" <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
if not path.exists():
    sys.exit(f"no report at {path}: see structured.log")
for name, w in json.loads(path.read_text())["serve"]["structured"].items():
    if "skipped" in w:
        print(f"{name}: skipped ({w['skipped']})")
        continue
    print(f"\n{name}: {w['constrained_valid']} constrained answers valid, {w['constrained_invalid']} invalid"
          f"{'' if not w['first_invalid'] else ' (' + w['first_invalid'] + ')'}")
    print(f"{'figure':<28}{'plain':>12}{'constrained':>14}")
    rows = {"completed": lambda s: s["completed"], "output tokens": lambda s: s["output_tokens"],
            "output tok/s": lambda s: s["output_throughput"]}
    for metric in ("ttft_ms", "itl_ms"):
        for stat, label in (("median", "p50"), ("p99", "p99")):
            rows[f"{metric.split('_')[0].upper()} {label} (ms)"] = lambda s, m=metric, q=stat: s[m][q]
    for label, get in rows.items():
        print(f"{label:<28}{get(w['plain']):>12.2f}{get(w['constrained']):>14.2f}")
    for key in ("structured_vs_plain_throughput_ratio", "itl_p99_ratio", "compile_ms_cold", "compile_ms_cached",
                "mask_fill_us_per_step"):
        print(f"{key:<40}{w[key]:>12.4g}")
    print(w["note"])
PY
        ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
    esac
done
