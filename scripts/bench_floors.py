"""The physical floors the phase-11 targets are stated against, measured on this GPU.

    python scripts/bench_floors.py [--preset qwen3-8b] [--copy-gib 4] [--json out.json]

For a preset's dense shapes (random bf16 weights, no model code; ``engine.entrypoints.bench.floors``):
- ``copy_gb_s``: device copy bandwidth, read + write bytes, of ``dst.copy_(src)`` over a
  ``--copy-gib`` buffer (4 GiB: 8.6 GB moved per copy), timed eagerly;
- ``weight_bytes``: the bytes a B=1 decode step must read (every decoder linear + lm_head);
- ``copy_floor_tok_s``: decode tokens/s if those bytes streamed at copy speed;
- ``matmul_chain_ms`` / ``matmul_chain_tok_s``: one B=1 token through a CUDA-graphed chain of
  plain cuBLAS matmuls over those weights (each layer: qkv, o, gate_up, down; then lm_head) —
  the best a decode step built from cuBLAS linears can do, with no attention or norms;
- ``prefill_gemm_ms`` / ``prefill_gemm_tok_s`` / ``gemm_tflops``: the same chain for a
  ``--prefill-len``-token prompt (lm_head on the last row only), i.e. the prefill floor at the
  GEMM throughput cuBLAS reaches on these shapes;
- ``host_ref_us``: the host reference of the performance gate (a fixed dispatch mix).
Timings: CUDA events, median of ``--repeats``. The report (one JSON line) carries the command,
the machine and the time, for ``scripts/record_benchmarks.py``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.entrypoints.bench import machine  # noqa: E402
from engine.entrypoints.bench.floors import device_floors, host_ref_us  # noqa: E402
from engine.entrypoints.bench.models import PRESETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b", choices=[p for p in PRESETS if "deepseek" not in p])
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--copy-gib", type=float, default=4.0, help="bytes of each copy buffer, GiB (default 4)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the floors are a GPU's: no CUDA device here")
    device = torch.device("cuda")
    floors = device_floors(PRESETS[args.preset], args.prefill_len, int(args.copy_gib * 2**30), args.repeats, device,
                           torch.bfloat16)
    report = {"bench": "floors", "command": "python " + shlex.join(sys.argv), "machine": machine(),
              "preset": args.preset, **floors, "host_ref_us": host_ref_us(device)}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
