"""Where a decode step of B sequences (default 1) goes with CUDA graphs: the engine step against
the graph replay alone, and the replay's GPU kernels by name (torch profiler, CUPTI traces kernels
inside graphs).

    python scripts/decode_breakdown.py [--preset qwen3-8b] [--steps 100] [--batch 256 --prompt-len 512]

Prints one JSON object: engine ms/step, replay GPU ms (CUDA events), host ms per step outside
the replay (the difference), and the top kernels of one replay with their share.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.models import PRESETS, open_engine  # noqa: E402
from engine.bench.offline import greedy, random_prompt  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together (default 1)")
    args = parser.parse_args()
    args.random_weights = True
    with open_engine(args) as (engine, _):
        runner = engine.runner
        if not runner.graphs or args.batch > max(runner.graphs) or args.batch > engine.scheduler.max_num_seqs:
            sys.exit(f"decode_breakdown: --batch {args.batch} needs a captured decode graph (sizes "
                     f"{sorted(runner.graphs or [])}) and --max-num-seqs >= it")
        rng = random.Random(args.seed)
        for _ in range(args.batch):
            engine.add_request(random_prompt(rng, args.prompt_len, engine.config.vocab_size),
                               greedy(3 * args.steps + 20), detokenize=False)
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - start) * 1e3 / args.steps
        graph, _ = runner.graphs[min(size for size in runner.graphs if size >= args.batch)]
        replay_ms = []
        for _ in range(args.steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            replay_ms.append(begin.elapsed_time(end))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:70]] += event.device_time
                counts[event.name[:70]] += 1
        total = sum(kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
        replay = statistics.median(replay_ms)
        print(json.dumps({
            "preset": args.preset, "batch": args.batch, "prompt_len": args.prompt_len,
            "engine_ms_per_step": step_ms, "replay_gpu_ms": replay,
            "host_ms_per_step_outside_replay": step_ms - replay, "kernels_in_one_replay": sum(counts.values()),
            "kernel_us_sum": total,
            "top_kernels": [{"name": n, "count": counts[n], "us": round(us, 1),
                             "share": round(us / max(total, 1e-9), 3)} for n, us in top]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
