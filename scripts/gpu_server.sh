#!/usr/bin/env bash
# The server's front door on a GPU, in one device call: the one- and two-row prompts through the
# cuDNN prefill route on sm90 (phase 01), then the demo model served in bfloat16 on the GPU and
# asked through every API with the shortest prompts (one token by text and by id), a tool call,
# /v1/responses, /v1/messages, a json_schema request and two hostile bodies, then the `cuda`
# tests of phases 01 and 14 (every phase's: scripts/gpu_check.sh). Logs go to $OUT (default ./out).
#
#   bash scripts/gpu_server.sh            # on a CUDA machine, from the repo root
source scripts/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

logged cudnn 240 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
    phases/01_numeric_primitives/test_attention.py::test_one_causal_sequence_through_cudnn \
    "phases/01_numeric_primitives/test_dispatch.py::test_wrappers_do_no_host_sync_copy_or_per_token_work[cuda]"
tail -3 "$OUT/cudnn.log"

PORT=8123
python3 -m engine serve --port $PORT --dtype bfloat16 --served-model-name demo \
    --chat-template engine/bench/hermes_tools.jinja > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
ask() {  # ask NAME PATH JSON|@FILE: the answer's status and body, one line each, into $OUT/api.log
    printf '== %s\n' "$1" >> "$OUT/api.log"
    curl -s -o "$OUT/body.tmp" -w '%{http_code}\n' -H 'content-type: application/json' \
        -d "$3" "localhost:$PORT$2" >> "$OUT/api.log"
    head -c 600 "$OUT/body.tmp" >> "$OUT/api.log"; echo >> "$OUT/api.log"
}
TOOL='{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}'
ask one_token_text /v1/completions '{"model":"demo","prompt":"x","max_tokens":4,"temperature":0}'
ask one_token_id /v1/completions '{"model":"demo","prompt":[7],"max_tokens":4,"temperature":0}'
ask two_tokens /v1/completions '{"model":"demo","prompt":[7,8],"max_tokens":4,"temperature":0}'
ask chat /v1/chat/completions '{"model":"demo","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
ask tool_required /v1/chat/completions "{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"tools\":[$TOOL],\"tool_choice\":\"required\",\"max_tokens\":64}"
ask json_schema /v1/chat/completions '{"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":64,"response_format":{"type":"json_schema","json_schema":{"name":"o","schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}}}'
ask responses /v1/responses '{"model":"demo","input":"hi","max_output_tokens":8}'
ask messages /v1/messages '{"model":"demo","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}'
ask count_tokens /v1/messages/count_tokens '{"model":"demo","messages":[{"role":"user","content":"hi"}]}'
python3 - > "$OUT/hostile.json" <<'EOF'
import json
print(json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2, "bad_words": [f"w{i}" for i in range(40000)]}))
EOF
ask bad_words_40k /v1/completions "@$OUT/hostile.json"
ask nan /v1/completions '{"model":"demo","prompt":"x","temperature":NaN}'
curl -s -o /dev/null -w 'health %{http_code} %{time_total}s\n' localhost:$PORT/health >> "$OUT/api.log"
kill -TERM $SERVER; wait $SERVER; echo "serve rc=$?" >> "$OUT/sections.log"
rm -f "$OUT/body.tmp" "$OUT/hostile.json"
grep -E '^(== |[0-9]{3}$|health)' "$OUT/api.log" | paste - - | head -20
grep -ciE 'traceback|error' "$OUT/serve.log" | sed 's/^/serve.log error lines: /'

fits 120 cuda_01_14 && logged cuda_01_14 $(( ${BUDGET_S:-580} - SECONDS - 10 )) python3 -m pytest -m cuda -q \
    -rfE -p no:cacheprovider -n 4 phases/01_numeric_primitives phases/14_structured_outputs
tail -15 "$OUT/cuda_01_14.log"
cat "$OUT/sections.log"
