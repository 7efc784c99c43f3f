#!/usr/bin/env bash
# Everything the GPU must confirm, in one device call: every `cuda` test of the
# phases, the Qwen3-8B-shaped comparison with its figures, then the kernel
# benchmark, whose table prints last. Logs and JSON go to $OUT (default ./out).
#
#   bash scripts/gpu_check.sh            # on a CUDA machine, from the repo root
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
status=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

echo "== cuda tests"
timeout 420 python3 -m pytest -m cuda phases -q -rfE -p no:cacheprovider \
    --deselect phases/07_weight_loading/test_cuda_qwen3_8b.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -40 || status=1

echo "== Qwen3-8B shape vs HF"
timeout 300 python3 -m pytest -m cuda -q -s -p no:cacheprovider phases/07_weight_loading/test_cuda_qwen3_8b.py \
    2>&1 | tee "$OUT/qwen3_8b.log" | grep -E "QWEN3_8B_FIGURES|passed|failed|Error" || status=1

echo "== layer-by-layer drift vs HF"
timeout 200 python3 scripts/compare_hf_layers.py 2>&1 | tee "$OUT/layers.log" | tail -40 || status=1

echo "== kernel benchmark"
timeout 300 python3 scripts/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
