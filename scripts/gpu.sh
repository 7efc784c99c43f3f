#!/usr/bin/env bash
# Every device run of the project, by section. On a GPU machine, from the repository root:
#
#   bash scripts/gpu.sh SECTION [SECTION ...]    # e.g. bash scripts/gpu.sh tests decode summary
#   bash scripts/gpu.sh                          # the sections, one line each
#   DRY_RUN=1 bash scripts/gpu.sh decode fp8     # the parts and commands those sections run; runs nothing
#   ONLY='fp8w|fp8kv' bash scripts/gpu.sh fp8    # only the parts whose names match
#
# A section is a list of parts, each one command under a timeout: its output in $OUT/PART.log, its
# JSON report (if any) in $OUT/PART.json and a row in $OUT/parts.tsv (section, part, rc, seconds).
# A part is skipped, with a line saying so, when fewer seconds than its limit are left of BUDGET_S
# (default 580: a device call's 10 minutes less a margin); a section too long for one call is run
# over several with ONLY. A part two named sections share (the bf16 peer of an FP8 run) runs once.
# At the end of every run, `summary`: the reports that scripts/record_benchmarks.py reads are recorded
# into $OUT/benchmarks.json (a copy of the repository's; $OUT/BENCHMARKS.md beside it), and one table
# is printed (scripts/gpu_summary.py). At exit every file of $OUT is packed into $OUT/00-bundle.tgz,
# which sorts first: the device tool returns only a call's first files by name, and reports were lost
# that way. Unpack it where the files came back: tar xzf 00-bundle.tgz
set -uo pipefail

SECTIONS="\
tests       every cuda test: the rest under pytest -n 4, then the memory-heavy 8B files alone (perf gate: gate11)
decode      Qwen3-8B B=1: floors, graphs (TTFT 4,096), eager and graphs beside transformers, --no-overlap, bf16 GEMV
models      Llama-3-8B, DeepSeek-V2-Lite and Qwen3-30B-A3B at B=1, beside transformers and the matmul floor
fp8         FP8 beside bf16: its cuda tests, B=1 and throughput (Qwen3-8B, V2-Lite, 30B-A3B), FP8 KV, serve, gate 12
prefill     the prefill kernels beside SDPA, Qwen3-8B TTFT of 128 and 4,096 tokens, TTFT 4,096 beside transformers
throughput  Qwen3-8B offline throughput (nano-vllm's shape): default, 384 prompt tokens beside decodes, --no-overlap
serve       the demo server through every API (the smoke), then bench serve c=64: default, step budgets, caps
structured  bench serve --structured json_schema,tools at c=64: constrained beside plain (TOKENIZER: its vocabulary)
spec        phase 13's cuda tests, the Qwen3-8B verify step of k=4 drafts (and drafting by a random EAGLE-3 head), the demo model's drafters
kernels     bench_kernels.py, bench_dispatch.py, bench_floors.py, bench_runner_host.py, bench_fp8.py gemm/gemv/sweep
gate11      python -m gates run --only 11: the perf gate against the committed baseline (alone on the host)
baseline    phases/11_performance/baseline.json recorded by the short benchmark, then the perf gate's tests on it
hostcheck   the host reference's premise: the short benchmark's eager section on one core, alone, then beside a busy one
tp          needs 2+ GPUs: the 2-rank NCCL gates, Qwen3-8B TP=2 and V2-Lite EP=2 beside TP=1 / EP=1 (never recorded)
audit       the mutation audit of PHASES (default every phase) on the host's CPU cores, CUDA hidden
summary     always last: record the reports into \$OUT/benchmarks.json, print the table (alone: an earlier \$OUT's)"

usage() {
    echo "usage: bash scripts/gpu.sh SECTION [SECTION ...]   (on a GPU machine, from the repository root)"
    local line
    while read -r line; do echo "  $line"; done <<< "$SECTIONS"
    echo "env: OUT (default ./out), BUDGET_S (default 580), ONLY=REGEX (parts by name), DRY_RUN=1 (print, run nothing);"
    echo "     BUDGETS, BESIDES (serve), TOKENIZER (structured), PHASES (audit)"
}

if [ $# -eq 0 ]; then usage; exit 0; fi
for section in "$@"; do
    if ! awk '{print $1}' <<< "$SECTIONS" | grep -qxF -- "$section"; then
        echo "unknown section: $section" >&2; usage >&2; exit 2
    fi
done

export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
OUT=${OUT:-$PWD/out}
DRY=${DRY_RUN:-}
MEASURES=  # a section other than summary: the wheels and the host's identity
for section in "$@"; do [ "$section" = summary ] || MEASURES=1; done
if [ -z "$DRY" ]; then
    # the wheels carried in .whl/ (the openai client of phase 10's server tests, absent from the GPU image)
    if [ -n "$MEASURES" ] && ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    mkdir -p "$OUT" build
    bundle() { tar czf "$OUT/00-bundle.tgz" -C "$OUT" --exclude 00-bundle.tgz . 2> /dev/null || true; }
    trap bundle EXIT
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECONDS=0
SECTION=
declare -A RAN=()

quoted() {  # the words of a command as a shell reads them back
    local word words=()
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then words+=("$word"); else words+=("$(printf '%q' "$word")"); fi
    done
    echo "${words[*]}"
}

row() {  # row PART RC SECONDS: a line of $OUT/parts.tsv (NORECORD set: the report is not recorded)
    printf '%s\t%s\t%s\t%s\t%s\n' "$SECTION" "$1" "$2" "$3" "$([ -n "${NORECORD:-}" ] && echo no || echo yes)" \
        >> "$OUT/parts.tsv"
}

begin() {  # begin PART LIMIT WHAT: true when PART is to run now (not filtered out, not run, LIMIT s left)
    local name=$1 limit=$2 left
    [[ -z ${ONLY:-} || $name =~ $ONLY ]] || return 1
    if [ -n "${RAN[$name]:-}" ]; then  # a part two named sections share runs once
        [ -z "$DRY" ] || printf '  %-34s (its run above)\n' "$name"
        return 1
    fi
    RAN[$name]=1
    if [ -n "$DRY" ]; then
        printf '  %-34s %4s s  %s%s\n' "$name" "$limit" "$3" "${NORECORD:+  [not recorded]}"
        return 1
    fi
    left=$(( ${BUDGET_S:-580} - SECONDS ))
    if (( left < limit )); then echo "skip $name: $limit s needed, $left s left"; row "$name" skip 0; return 1; fi
    STARTED=$SECONDS
}

end() {  # end PART RC: its row and a line
    row "$1" "$2" $(( SECONDS - STARTED ))
    echo "$1 rc=$2 in $(( SECONDS - STARTED )) s ($SECONDS s used)"
}

part() {  # part NAME LIMIT CMD...: CMD under a timeout of LIMIT s, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    begin "$name" "$limit" "$(quoted "$@")" || return 0
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    end "$name" $?
}

rest() {  # rest MIN: the seconds left of the budget less a margin, at least MIN (a part that takes what is left)
    local left=$(( ${BUDGET_S:-580} - SECONDS - 10 ))
    echo $(( left > $1 ? left : $1 ))
}

host() {  # the host's identity first, so two calls can say whether they ran on one host or two
    {
        nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
        grep -m1 "model name" /proc/cpuinfo
        echo "cores $(nproc); boot $(cat /proc/sys/kernel/random/boot_id)"
        python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
                                                             'transformers', transformers.__version__)"
    } 2>&1 | tee "$OUT/host.txt"
}

# The commands several parts share: B=1 latency of a preset, offline throughput, serving at 64 concurrent.
Q8B_B1=(python3 -m engine bench latency --preset qwen3-8b --random-weights --max-model-len 4400 --prompt-lens 4096
        --decode-tokens 256)
DSV2_B1=(python3 -m engine bench latency --preset deepseek-v2-lite --random-weights --max-model-len 2048
         --prompt-lens 128 --decode-tokens 128)
MOE_B1=(python3 -m engine bench latency --preset qwen3-30b-a3b --random-weights --max-model-len 2048
        --prompt-lens 1024 --decode-tokens 128)
Q8B_THROUGHPUT=(python3 -m engine bench throughput --preset qwen3-8b --random-weights)
SERVE_C64=(python3 -m engine bench serve --launch --preset qwen3-8b --random-weights --max-concurrency 64
           --num-prompts 256 --input-len 512 --output-len 128)
PYTEST=(python3 -m pytest -m cuda -q -rfE -p no:cacheprovider)
# The cuda tests that hold an 8B model beside transformers' copies: beside the rest under -n 4 they ran
# out of an 80 GB GPU, so each runs alone.
ALONE=(phases/07_weight_loading/test_cuda_qwen3_8b.py phases/09_engine_integration/test_cuda_qwen3_8b_engine.py)

# Parts that two sections share, one definition each.
floors() { part floors 110 python3 scripts/bench_floors.py --json "$OUT/floors.json"; }
q8b_bf16() { part latency_qwen3_8b_bf16 200 "${Q8B_B1[@]}" --output "$OUT/latency_qwen3_8b_bf16.json"; }
dsv2_bf16() { part latency_dsv2_lite_bf16 130 "${DSV2_B1[@]}" --output "$OUT/latency_dsv2_lite_bf16.json"; }
moe_bf16() { part latency_qwen3_30b_a3b_bf16 160 "${MOE_B1[@]}" --output "$OUT/latency_qwen3_30b_a3b_bf16.json"; }
q8b_throughput() { part throughput_qwen3_8b 160 "${Q8B_THROUGHPUT[@]}" --output "$OUT/throughput_qwen3_8b.json"; }
serve_c64() { part serve_qwen3_8b_c64 190 "${SERVE_C64[@]}" --output "$OUT/serve_qwen3_8b_c64.json"; }

sec_tests() {
    local file deselect=()
    for file in "${ALONE[@]}" phases/11_performance/test_perf_gate.py; do deselect+=(--deselect "$file"); done
    # 300 s ran 87% of it on an H200 host (2026-12-06): a call of its own
    part cuda_tests 480 "${PYTEST[@]}" -n 4 --dist loadfile phases "${deselect[@]}"
    part cuda_qwen3_8b 300 "${PYTEST[@]}" -s "${ALONE[0]}"        # prints QWEN3_8B_FIGURES
    part cuda_qwen3_8b_engine 240 "${PYTEST[@]}" -s "${ALONE[1]}"  # prints the engine loop's eager speed
}

sec_decode() {
    floors
    q8b_bf16
    part latency_qwen3_8b_eager 180 python3 -m engine bench latency --max-model-len 4160 --enforce-eager \
        --preset qwen3-8b --random-weights --compare hf-eager --prompt-lens 128 --decode-tokens 64 \
        --output "$OUT/latency_qwen3_8b_eager.json"
    part latency_qwen3_8b 220 python3 -m engine bench latency --preset qwen3-8b --random-weights --compare hf \
        --max-model-len 4160 --prompt-lens 128,4096 --decode-tokens 256 --output "$OUT/latency_qwen3_8b.json"
    local mode extra
    for mode in overlap no-overlap; do  # each with a profiler trace: the host gap is ms/token less kernel time
        # the overlapped run's figure is the headline's name: q8b_bf16 above records it, this one does not
        extra=(); local NORECORD=1; [ $mode = no-overlap ] && extra=(--no-overlap) && NORECORD=
        part "latency_qwen3_8b_${mode/-/_}" 200 python3 -m engine bench latency --preset qwen3-8b --random-weights \
            "${extra[@]}" --prompt-lens 128,4096 --max-model-len 4160 --decode-tokens 256 \
            --profile "$OUT/trace_$mode.json" --profile-steps 20 --output "$OUT/latency_qwen3_8b_${mode/-/_}.json"
    done
    # AGENT_INFER_DECODE_GEMV=1 is in no figure's name: its runs are not recorded
    NORECORD=1 part latency_qwen3_8b_bf16_gemv 200 env AGENT_INFER_DECODE_GEMV=1 "${Q8B_B1[@]}" \
        --output "$OUT/latency_qwen3_8b_bf16_gemv.json"
    NORECORD=1 part latency_qwen3_8b_eager_gemv 110 env AGENT_INFER_DECODE_GEMV=1 python3 -m engine bench latency \
        --random-weights --preset qwen3-8b --enforce-eager --max-model-len 4160 --prompt-lens 128 --decode-tokens 64 \
        --output "$OUT/latency_qwen3_8b_eager_gemv.json"
}

sec_models() {
    part floors_llama3_8b 60 python3 scripts/bench_floors.py --preset llama3-8b --json "$OUT/floors_llama3_8b.json"
    part latency_llama3_8b 240 python3 -m engine bench latency --preset llama3-8b --random-weights --compare hf \
        --max-model-len 2048 --prompt-lens 128,1024 --decode-tokens 256 --output "$OUT/latency_llama3_8b.json"
    dsv2_bf16
    part latency_dsv2_lite_hf 240 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights \
        --compare hf --max-model-len 2048 --prompt-lens 128,1024 --decode-tokens 128 \
        --output "$OUT/latency_dsv2_lite_hf.json"
    part latency_dsv2_lite_eager 130 python3 -m engine bench latency --preset deepseek-v2-lite --random-weights \
        --enforce-eager --compare hf-eager --prompt-lens 128,1024 --max-model-len 2048 --decode-tokens 64 \
        --split-steps 8 --output "$OUT/latency_dsv2_lite_eager.json"
    moe_bf16
    # decoding after a 1,024-token prompt: its B=1 figure would be named as if after 128, so it is not recorded
    NORECORD=1 part latency_qwen3_30b_a3b_hf 230 python3 -m engine bench latency --preset qwen3-30b-a3b \
        --random-weights --compare hf-eager --max-model-len 2048 --prompt-lens 1024 --decode-prompt-len 1024 \
        --decode-tokens 64 --repeats 3 --output "$OUT/latency_qwen3_30b_a3b_hf.json"
    NORECORD=1 part latency_dsv2_lite_gemv 60 env AGENT_INFER_DECODE_GEMV=1 python3 -m engine bench latency \
        --random-weights --preset deepseek-v2-lite --prompt-lens 128 --max-model-len 2048 --decode-tokens 128 \
        --output "$OUT/latency_dsv2_lite_gemv.json"
}

sec_fp8() {
    part fp8_tests 140 "${PYTEST[@]}" phases/01_numeric_primitives/test_decode_gemv.py \
        phases/01_numeric_primitives/test_fp8_kv_cache.py phases/12_quantization/test_fp8_kernels.py \
        phases/12_quantization/test_fp8_decode.py phases/12_quantization/test_fp8_gemv.py \
        phases/12_quantization/test_fp8_mma_gemv.py
    q8b_bf16
    part latency_qwen3_8b_fp8 200 "${Q8B_B1[@]}" --quantization fp8 --output "$OUT/latency_qwen3_8b_fp8.json"
    part fp8_agreement 140 python3 scripts/bench_fp8.py agreement --json "$OUT/fp8_agreement.json"
    q8b_throughput
    part throughput_qwen3_8b_fp8w 240 "${Q8B_THROUGHPUT[@]}" --quantization fp8 \
        --output "$OUT/throughput_qwen3_8b_fp8w.json"
    part throughput_qwen3_8b_fp8kv 160 "${Q8B_THROUGHPUT[@]}" --kv-cache-dtype fp8 \
        --output "$OUT/throughput_qwen3_8b_fp8kv.json"
    dsv2_bf16
    part latency_dsv2_lite_fp8 130 "${DSV2_B1[@]}" --quantization fp8 --output "$OUT/latency_dsv2_lite_fp8.json"
    moe_bf16
    part latency_qwen3_30b_a3b_fp8 160 "${MOE_B1[@]}" --quantization fp8 \
        --output "$OUT/latency_qwen3_30b_a3b_fp8.json"
    serve_c64
    part serve_qwen3_8b_c64_fp8 190 "${SERVE_C64[@]}" --quantization fp8 --output "$OUT/serve_qwen3_8b_c64_fp8.json"
    part gate12 470 python3 -m gates run --only 12 --report "$OUT/gate12.json"  # 271 s with cold Triton caches
}

sec_prefill() {
    part prefill_kernels 190 python3 scripts/bench_kernels.py --only prefill_sweep prefill \
        --json "$OUT/prefill_kernels.json"
    part latency_qwen3_8b_ttft 110 python3 -m engine bench latency --preset qwen3-8b --random-weights \
        --max-model-len 4400 --prompt-lens 128,4096 --decode-tokens 256 --output "$OUT/latency_qwen3_8b_ttft.json"
    # decoding after a 4,096-token prompt: its B=1 figure would be named as if after 128, so it is not recorded
    NORECORD=1 part latency_qwen3_8b_ttft4096_hf 240 python3 -m engine bench latency --preset qwen3-8b \
        --random-weights --compare hf --max-model-len 4160 --prompt-lens 4096 --decode-prompt-len 4096 \
        --decode-tokens 32 --output "$OUT/latency_qwen3_8b_ttft4096_hf.json"
}

sec_throughput() {
    q8b_throughput
    part throughput_qwen3_8b_beside_384 160 "${Q8B_THROUGHPUT[@]}" --prefill-tokens-beside-decodes 384 \
        --output "$OUT/throughput_qwen3_8b_beside_384.json"
    part throughput_qwen3_8b_no_overlap 150 "${Q8B_THROUGHPUT[@]}" --no-overlap \
        --output "$OUT/throughput_qwen3_8b_no_overlap.json"
}

smoke() {  # the demo model served in bfloat16, asked through every API, the shortest prompts and hostile bodies
    local port=8123 server rc api="$OUT/serve_smoke_api.log"
    begin serve_smoke 240 "python3 -m engine serve --port $port --dtype bfloat16 --served-model-name demo \
--chat-template engine/entrypoints/bench/hermes_tools.jinja, then 11 requests and /health (curl)" || return 0
    python3 -m engine serve --port $port --dtype bfloat16 --served-model-name demo \
        --chat-template engine/entrypoints/bench/hermes_tools.jinja > "$OUT/serve_smoke.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
    ask() {  # ask NAME PATH JSON|@FILE: the answer's status and body, one line each
        {
            printf '== %s\n' "$1"
            curl -s -m 60 -o "$OUT/body.tmp" -w '%{http_code}\n' -H 'content-type: application/json' \
                -d "$3" "localhost:$port$2"
            head -c 600 "$OUT/body.tmp"; echo
        } >> "$api"
    }
    local tool='{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}'
    ask one_token_text /v1/completions '{"model":"demo","prompt":"x","max_tokens":4,"temperature":0}'
    ask one_token_id /v1/completions '{"model":"demo","prompt":[7],"max_tokens":4,"temperature":0}'
    ask two_tokens /v1/completions '{"model":"demo","prompt":[7,8],"max_tokens":4,"temperature":0}'
    ask chat /v1/chat/completions '{"model":"demo","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
    ask tool_required /v1/chat/completions "{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"tools\":[$tool],\"tool_choice\":\"required\",\"max_tokens\":64}"
    ask json_schema /v1/chat/completions '{"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":64,"response_format":{"type":"json_schema","json_schema":{"name":"o","schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}}}'
    ask responses /v1/responses '{"model":"demo","input":"hi","max_output_tokens":8}'
    ask messages /v1/messages '{"model":"demo","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}'
    ask count_tokens /v1/messages/count_tokens '{"model":"demo","messages":[{"role":"user","content":"hi"}]}'
    python3 -c 'import json; print(json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2,
                                               "bad_words": [f"w{i}" for i in range(40000)]}))' > "$OUT/hostile.tmp"
    ask bad_words_40k /v1/completions "@$OUT/hostile.tmp"
    ask nan /v1/completions '{"model":"demo","prompt":"x","temperature":NaN}'
    curl -s -m 60 -o /dev/null -w 'health %{http_code} %{time_total}s\n' localhost:$port/health >> "$api"
    kill -TERM "$server"; wait "$server"; rc=$?
    rm -f "$OUT/body.tmp" "$OUT/hostile.tmp"
    grep -E '^(== |[0-9]{3}$|health)' "$api" | paste - - | head -20
    # the table's line for this part: the log's last line
    echo "answers $(grep -E '^[0-9]{3}$' "$api" | tr '\n' ' '); $(grep -ciE 'traceback|error' "$OUT/serve_smoke.log") \
error lines in the server's log" >> "$OUT/serve_smoke.log"
    end serve_smoke $rc
}

sec_serve() {
    smoke
    serve_c64
    local tokens
    for tokens in ${BUDGETS:-512 1024 2048}; do  # the prefill budget of a step
        part "serve_qwen3_8b_c64_budget_$tokens" 120 "${SERVE_C64[@]}" --max-num-batched-tokens "$tokens" \
            --output "$OUT/serve_qwen3_8b_c64_budget_$tokens.json"
    done
    for tokens in ${BESIDES:-256 512 0}; do  # the cap on prompt tokens beside decodes
        part "serve_qwen3_8b_c64_beside_$tokens" 120 "${SERVE_C64[@]}" --prefill-tokens-beside-decodes "$tokens" \
            --output "$OUT/serve_qwen3_8b_c64_beside_$tokens.json"
    done
}

sec_structured() {
    # The preset has no tokenizer: the grammars are built over TOKENIZER (default the demo model's, 8,192
    # tokens; a Qwen3 tokenizer directory carried to the device gives Qwen3's vocabulary and mask costs).
    part structured 480 python3 -m engine bench serve --launch --preset qwen3-8b --random-weights \
        --tokenizer "${TOKENIZER:-engine/default_model}" --chat-template engine/entrypoints/bench/hermes_tools.jinja \
        --structured json_schema,tools --max-model-len 2048 --num-prompts 128 --max-concurrency 64 --input-len 512 \
        --output-len 128 --output "$OUT/structured.json"
}

sec_spec() {
    part spec_tests 120 "${PYTEST[@]}" phases/13_speculative
    part spec_verify_qwen3_8b 100 python3 -m engine bench spec --preset qwen3-8b --random-weights \
        --num-speculative-tokens 4 --verify-context 512 --verify-steps 100 --output "$OUT/spec_verify_qwen3_8b.json"
    part spec_eagle3_head_qwen3_8b 90 python3 scripts/random_eagle3_head.py --preset qwen3-8b \
        --out build/eagle3_qwen3_8b
    part spec_eagle3_qwen3_8b 120 python3 -m engine bench spec --preset qwen3-8b --random-weights --method eagle3 \
        --draft-model build/eagle3_qwen3_8b --num-speculative-tokens 4 --verify-context 512 --verify-steps 100 \
        --output "$OUT/spec_eagle3_qwen3_8b.json"
    part spec_demo 80 python3 -m engine bench spec --num-speculative-tokens 4 --output "$OUT/spec_demo.json"
    part spec_demo_draft 80 python3 -m engine bench spec --method draft --num-speculative-tokens 4 \
        --output "$OUT/spec_demo_draft.json"
    part spec_demo_eagle3 80 python3 -m engine bench spec --method eagle3 --num-speculative-tokens 4 \
        --output "$OUT/spec_demo_eagle3.json"
}

sec_kernels() {
    part kernels 300 python3 scripts/bench_kernels.py --json "$OUT/kernels.json"
    part dispatch 60 python3 scripts/bench_dispatch.py --calls 500 --json "$OUT/dispatch.json"
    floors
    part runner_host 90 python3 scripts/bench_runner_host.py  # prints its JSON: the log's last line
    part fp8_gemm 170 python3 scripts/bench_fp8.py gemm --json "$OUT/fp8_gemm.json"
    part fp8_gemm_decode 150 python3 scripts/bench_fp8.py gemm --rows 1 4 8 --json "$OUT/fp8_gemm_decode.json"
    part fp8_gemv 240 python3 scripts/bench_fp8.py gemv --rows 1 8 --json "$OUT/fp8_gemv.json"
    part fp8_batch 200 python3 scripts/bench_fp8.py gemv --rows 128 192 256 --sweep --json "$OUT/fp8_batch.json"
}

sec_gate11() {
    part gate11 540 python3 -m gates run --only 11 --report "$OUT/gate11.json"
    [ -n "$DRY" ] || cp build/perf-short.json "$OUT/" 2> /dev/null
}

sec_baseline() {
    part short_baseline 300 python3 -m engine.entrypoints.bench.short --write-baseline phases/11_performance/baseline.json \
        --output "$OUT/short_baseline.json"
    part perf_gate 270 "${PYTEST[@]}" phases/11_performance/test_perf_gate.py
    [ -n "$DRY" ] || cp phases/11_performance/baseline.json build/perf-short.json "$OUT/" 2> /dev/null
}

sec_hostcheck() {  # raw eager tok/s about halves on a shared core; the normalised figure must stay in tolerance
    local NORECORD=1 busy
    part eager_alone 90 taskset -c 0 python3 -m engine.entrypoints.bench.short --sections qwen3_eager \
        --output "$OUT/eager_alone.json"
    begin eager_loaded 130 "taskset -c 0 python3 -c 'while True: pass' & then taskset -c 0 python3 -m \
engine.entrypoints.bench.short --sections qwen3_eager --output $OUT/eager_loaded.json" || return 0
    taskset -c 0 python3 -c 'while True: pass' &
    busy=$!
    timeout 130 taskset -c 0 python3 -m engine.entrypoints.bench.short --sections qwen3_eager --output "$OUT/eager_loaded.json" \
        > "$OUT/eager_loaded.log" 2>&1
    end eager_loaded $?
    kill "$busy"
}

sec_tp() {  # record_benchmarks.py's names say neither TP nor EP: nothing here is recorded
    local NORECORD=1 gpus
    gpus=$(nvidia-smi -L 2> /dev/null | wc -l)
    if [ -z "$DRY" ] && (( gpus < 2 )); then
        echo "skip tp: it needs 2 GPUs, this host has $gpus"; row tp skip 0; return 0
    fi
    local torchrun=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
    local gpu0=(env CUDA_VISIBLE_DEVICES=0 python3)
    local q8b=(--preset qwen3-8b --random-weights --max-model-len 4160 --max-num-seqs 8 --prompt-lens 128 --repeats 1
               --decode-tokens 128 --split-steps 5)
    local dsv2=(--preset deepseek-v2-lite --random-weights --max-model-len 2048 --max-num-seqs 8 --prompt-lens 128
                --repeats 1 --decode-tokens 128 --split-steps 5)
    part gates_torchrun_nccl "$(rest 300)" env GATES_TORCHRUN_DEVICE=cuda python3 -m gates run --mode torchrun \
        --from 02 --upto 11 --nproc 2 --report "$OUT/gates_torchrun_nccl.json"
    part latency_tp1_graphs 120 "${gpu0[@]}" -m engine bench latency "${q8b[@]}" --output "$OUT/latency_tp1_graphs.json"
    part latency_tp2_graphs 120 "${torchrun[@]}" -m engine bench latency "${q8b[@]}" \
        --output "$OUT/latency_tp2_graphs.json"
    part latency_tp2_graphs_nccl 120 "${torchrun[@]}" -m engine bench latency --disable-custom-all-reduce "${q8b[@]}" \
        --output "$OUT/latency_tp2_graphs_nccl.json"
    part latency_tp1_eager 120 "${gpu0[@]}" -m engine bench latency --enforce-eager "${q8b[@]}" \
        --output "$OUT/latency_tp1_eager.json"
    part latency_tp2_eager 120 "${torchrun[@]}" -m engine bench latency --enforce-eager \
        --profile "$OUT/trace_tp2_eager.json" "${q8b[@]}" --output "$OUT/latency_tp2_eager.json"
    part latency_tp2_eager_nccl 120 "${torchrun[@]}" -m engine bench latency --enforce-eager \
        --disable-custom-all-reduce "${q8b[@]}" --output "$OUT/latency_tp2_eager_nccl.json"
    part throughput_tp1 200 "${gpu0[@]}" -m engine bench throughput --preset qwen3-8b --random-weights \
        --max-model-len 2048 --compare hf-eager --hf-num-seqs 16 --output "$OUT/throughput_tp1.json"
    part throughput_tp2 150 "${torchrun[@]}" -m engine bench throughput --preset qwen3-8b --random-weights \
        --max-model-len 2048 --output "$OUT/throughput_tp2.json"
    part latency_ep1_graphs 120 "${gpu0[@]}" -m engine bench latency "${dsv2[@]}" \
        --output "$OUT/latency_ep1_graphs.json"
    part latency_ep2_graphs 120 "${torchrun[@]}" -m engine bench latency "${dsv2[@]}" \
        --output "$OUT/latency_ep2_graphs.json"
}

sec_audit() {  # CPU work: each phase's mutations through its gate, 6 at once; a report per phase
    local phase
    for phase in ${PHASES:-01 02 03 04 05 06 07 08 09 10 11 12 13 14}; do
        part "audit_$phase" "$(rest 60)" env CUDA_VISIBLE_DEVICES= python3 -m gates audit --phase "$phase" \
            --jobs 6 --report "$OUT/audit_$phase.json"
    done
}

summary() {  # every report record_benchmarks.py reads, recorded into $OUT/benchmarks.json; then the table
    local reports=()
    if [ -n "$DRY" ]; then
        echo "summary: cp benchmarks.json \$OUT/benchmarks.json"
        echo "  python3 scripts/record_benchmarks.py \$(python3 scripts/gpu_summary.py recordable \$OUT) \
--into \$OUT/benchmarks.json"
        echo "  python3 scripts/gpu_summary.py table \$OUT"
        return 0
    fi
    cp benchmarks.json "$OUT/benchmarks.json"
    rm -f "$OUT/record.log"
    mapfile -t reports < <(python3 scripts/gpu_summary.py recordable "$OUT")
    if [ ${#reports[@]} -gt 0 ]; then
        python3 scripts/record_benchmarks.py "${reports[@]}" --into "$OUT/benchmarks.json" > "$OUT/record.log" 2>&1
    fi
    python3 scripts/gpu_summary.py table "$OUT"
}

[ -z "$DRY" ] && [ -n "$MEASURES" ] && host
for SECTION in "$@"; do
    [ "$SECTION" = summary ] && continue
    [ -n "$DRY" ] && echo "$SECTION:"
    "sec_$SECTION"
done
summary
