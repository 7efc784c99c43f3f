"""Host cost of the engine's step bookkeeping, the part of a step that is not the model:
preparing a decode step's inputs (block tables, static buffers) at 256 running sequences, and
sampling at B=256 over a 151,936-token vocabulary (greedy, and top-k/top-p/temperature).

    python scripts/bench_runner_host.py [--device cuda] [--context 4096] [--block-size 16]

Prints one JSON object. The model is a tiny random Qwen3 (its forward is not timed); the
sequences' KV blocks are allocated through the BlockManager as the scheduler would.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def timed(fn, device, repeat: int = 20) -> float:
    """Median wall milliseconds of ``fn()`` with the device synced around each call."""
    times = []
    for _ in range(repeat + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[3:])[repeat // 2]


def main() -> None:
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams, Sequence
    from phases.checkpoints import make_tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp), "Qwen3ForCausalLM", seed=0,
                                    max_position_embeddings=args.context + 64)
        engine = LLMEngine(path, device=device, block_size=args.block_size, max_num_seqs=args.num_seqs,
                           max_model_len=args.context + 8, mem_utilization=0.5, progress=False)
    runner, bm = engine.runner, engine.block_manager
    seqs = []
    for i in range(args.num_seqs):
        seq = Sequence([(i * 7 + j) % 500 + 2 for j in range(args.context)], SamplingParams(max_tokens=8))
        bm.allocate(seq)
        seq.output_token_ids.append(3)
        bm.append_slot(seq)
        seqs.append(seq)
    runner._sync_block_tables(seqs)  # first sight of each table: written once

    def decode_step_inputs():
        runner._sync_block_tables(seqs)
        runner.prepare_decode(seqs)

    vocab = 151936
    logits = torch.randn(args.num_seqs, vocab, device=device, dtype=torch.bfloat16)
    greedy = [Sequence([1], SamplingParams(temperature=0.0)) for _ in range(args.num_seqs)]
    mixed = [Sequence([1], SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i))
             for i in range(args.num_seqs)]
    top_p_only = [Sequence([1], SamplingParams(temperature=0.8, top_p=0.9, seed=i)) for i in range(args.num_seqs)]
    with torch.inference_mode():
        result = {
            "device": str(device), "num_seqs": args.num_seqs, "context": args.context, "block_size": args.block_size,
            "prepare_decode_ms": round(timed(decode_step_inputs, device), 3),
            "sample_greedy_ms": round(timed(lambda: runner.sample(logits, greedy), device), 3),
            "sample_top_k_top_p_ms": round(timed(lambda: runner.sample(logits, mixed), device), 3),
            "sample_top_p_only_ms": round(timed(lambda: runner.sample(logits, top_p_only), device), 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
