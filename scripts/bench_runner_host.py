"""Host cost of the engine's step bookkeeping, the part of a step that is not the model:
planning and staging a decode step's inputs (rows, block tables, static buffers, the previous
step's ids fed on the device) at 256 running sequences, and sampling at B=256 over a
151,936-token vocabulary (greedy, and top-k/top-p/temperature).

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
    from engine.core.llm_engine import LLMEngine
    from engine.scheduling.sequence import SamplingParams, Sequence
    from engine.scheduling.step import ScheduledBatch
    from engine.worker.model_runner import LaunchedStep
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
        seq.num_pending_tokens = 1  # its newest token was sampled by the previous step, still on the device
        bm.append_slot(seq)
        seqs.append(seq)
    n = args.num_seqs
    previous = LaunchedStep(ScheduledBatch(seqs, [args.context - 1] * n, [1] * n, [True] * n),
                            torch.zeros(n, dtype=torch.int64, device=device))
    batch = ScheduledBatch(seqs, [args.context] * n, [1] * n, [True] * n)
    runner.prepare(batch, previous)  # first sight of each table: written once

    def decode_step_inputs():
        runner.prepare(batch, previous)

    vocab = 151936
    logits = torch.randn(n, vocab, device=device, dtype=torch.bfloat16)

    def sampler(params):
        """Sample ``logits`` as the runner does for a batch of sequences with ``params``."""
        sampling = [Sequence([1], p) for p in params]
        sample_batch = ScheduledBatch(sampling, [0] * n, [1] * n, [True] * n)
        step = runner.prepare(sample_batch)  # writes their parameters into their rows' sampling columns
        for seq in sampling:
            runner.release(seq)  # the columns keep them until the rows are handed out again
        return lambda: runner.sampling.sample(logits, step)

    with torch.inference_mode():
        result = {
            "device": str(device), "num_seqs": n, "context": args.context, "block_size": args.block_size,
            "prepare_decode_ms": round(timed(decode_step_inputs, device), 3),
            "sample_greedy_ms": round(timed(sampler([SamplingParams(temperature=0.0)] * n), device), 3),
            "sample_top_k_top_p_ms": round(timed(sampler(
                [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i) for i in range(n)]), device), 3),
            "sample_top_p_only_ms": round(timed(sampler(
                [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(n)]), device), 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
