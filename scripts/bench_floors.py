"""The physical floors the phase-11 targets are stated against, measured on this GPU.

    python scripts/bench_floors.py [--preset qwen3-8b] [--json out.json]

For a preset's dense shapes (random bf16 weights, no model code):
- ``copy_gb_s``: device-to-device copy bandwidth (read + write) of a 2 GiB buffer;
- ``weight_bytes``: the bytes a B=1 decode step must read (every decoder linear + lm_head);
- ``copy_floor_tok_s``: decode tokens/s if those bytes streamed at copy speed;
- ``matmul_chain_ms`` / ``matmul_chain_tok_s``: one B=1 token through a CUDA-graphed chain of
  plain cuBLAS matmuls over those weights (each layer: qkv, o, gate_up, down; then lm_head) —
  the best a decode step built from cuBLAS linears can do, with no attention or norms;
- ``prefill_gemm_ms`` / ``prefill_gemm_tok_s`` / ``gemm_tflops``: the same chain for a
  ``--prefill-len``-token prompt (lm_head on the last row only), i.e. the prefill floor at the
  GEMM throughput cuBLAS reaches on these shapes.
Timings: CUDA events around graph replays, median of ``--repeats``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.models import PRESETS  # noqa: E402


def linear_shapes(config: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([(out, in)] of one decoder layer's linears, (vocab, hidden) of lm_head)."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer, (config["vocab_size"], hidden)


def graph_ms(fn, repeats: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gb_s(repeats: int) -> float:
    src = torch.empty(1 << 28, dtype=torch.float64, device="cuda")  # 2 GiB in 8-byte words
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b", choices=[p for p in PRESETS if "deepseek" not in p])
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    config = PRESETS[args.preset]
    layer, head = linear_shapes(config)
    torch.manual_seed(0)
    weights = [[torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02 for shape in layer]
               for _ in range(config["num_hidden_layers"])]
    lm_head = torch.randn(head, dtype=torch.bfloat16, device="cuda") * 0.02
    weight_bytes = sum(w.numel() * 2 for ws in weights for w in ws) + lm_head.numel() * 2

    def chain(x: torch.Tensor) -> torch.Tensor:
        for qkv, o, gate_up, down in weights:
            h = F.linear(F.linear(x, qkv)[:, :o.shape[1]], o)
            x = F.linear(F.linear(h, gate_up)[:, :down.shape[1]], down)
        return F.linear(x[-1:], lm_head)

    decode_x = torch.randn(1, config["hidden_size"], dtype=torch.bfloat16, device="cuda")
    prefill_x = torch.randn(args.prefill_len, config["hidden_size"], dtype=torch.bfloat16, device="cuda")
    decode_ms = graph_ms(lambda: chain(decode_x), args.repeats)
    prefill_ms = graph_ms(lambda: chain(prefill_x), max(3, args.repeats // 4))
    flops = 2 * args.prefill_len * sum(o * i for o, i in layer) * config["num_hidden_layers"] + 2 * head[0] * head[1]
    bandwidth = copy_gb_s(args.repeats)
    report = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gb_s": bandwidth, "weight_bytes": weight_bytes,
              "copy_floor_tok_s": bandwidth * 1e9 / weight_bytes,
              "matmul_chain_ms": decode_ms, "matmul_chain_tok_s": 1e3 / decode_ms,
              "prefill_len": args.prefill_len, "prefill_gemm_ms": prefill_ms,
              "prefill_gemm_tok_s": args.prefill_len / prefill_ms * 1e3, "gemm_tflops": flops / prefill_ms / 1e9}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
