"""Where a step that carries a prefill chunk goes: its host dispatch against its GPU kernels.

    python scripts/mixed_step_profile.py [--preset qwen3-8b] [--decodes 0 64] [--prompts 128 512 2048]

For each number of running decodes D and prompt length P: D sequences decode (each holding a
128-token context), then a P-token prompt arrives and the next step carries it as a prefill
chunk beside the D decodes (a mixed step; D = 0: the prompt alone, the step behind a short
prompt's TTFT). The engine runs without overlap so one step is timed alone. Per case, medians
of ``--repeat`` such steps: ``wall_ms`` (schedule to sampled ids on the host) and ``launch_ms``
(the runner's ``launch`` returning: the host dispatch of the forward and sampling, the GPU still
running), then of as many steps under the torch profiler (whose tracing slows every launch):
``kernel_ms``, the sum of the step's GPU kernel times. A step whose ``launch_ms`` exceeds its
``kernel_ms`` is host-bound. The last case is also run under cProfile (``--top`` functions by
own time). Prints one JSON object (``--output``: also to a file).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.models import PRESETS, open_engine  # noqa: E402
from engine.bench.offline import greedy, random_prompt  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402


class TimedLaunch:
    """Wraps ``runner.launch``: the host seconds of each call."""

    def __init__(self, runner):
        self.launch, self.seconds = runner.launch, []
        runner.launch = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.launch(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


def kernel_ms(prof) -> float:
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def mixed_step(engine, timer: TimedLaunch, rng, decodes: int, prompt_len: int, profile) -> dict:
    """D decodes running, then one step with a P-token prompt; the engine is left empty."""
    vocab = engine.config.vocab_size
    for _ in range(decodes):
        engine.add_request(random_prompt(rng, 128, vocab), greedy(10_000), detokenize=False)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    engine.step()  # a plain decode step: every sequence past its prompt
    rid = engine.add_request(random_prompt(rng, prompt_len, vocab), greedy(1), detokenize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile() as prof:
        engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    for request_id in list(engine.request_ids()):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.pop_request(rid)
    return {"wall_ms": wall * 1e3, "launch_ms": timer.seconds[-1] * 1e3,
            "kernel_ms": kernel_ms(prof) if prof is not None else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decodes", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--output", metavar="FILE", help="also write the JSON report here")
    args = parser.parse_args()
    args.random_weights, args.overlap = True, False
    from torch.profiler import ProfilerActivity, profile

    cases = []
    with open_engine(args) as (engine, _):
        timer = TimedLaunch(engine.runner)
        rng = random.Random(args.seed)
        mixed_step(engine, timer, rng, 4, 64, lambda: profile(activities=[ProfilerActivity.CUDA]))  # warm-up
        for decodes in args.decodes:
            for prompt_len in args.prompts:
                timed = [mixed_step(engine, timer, rng, decodes, prompt_len, _no_profile)
                         for _ in range(args.repeat)]
                profiled = [mixed_step(engine, timer, rng, decodes, prompt_len,
                                       lambda: profile(activities=[ProfilerActivity.CUDA]))
                            for _ in range(args.repeat)]
                case = {"decodes": decodes, "prompt_len": prompt_len,
                        **{k: round(statistics.median(r[k] for r in timed), 2) for k in ("wall_ms", "launch_ms")},
                        "kernel_ms": round(statistics.median(r["kernel_ms"] for r in profiled), 2)}
                cases.append(case)
                print(json.dumps(case), file=sys.stderr)
        profiler = cProfile.Profile()
        profiler.enable()
        mixed_step(engine, timer, rng, args.decodes[-1], args.prompts[0], _no_profile)
        profiler.disable()
        stats = pstats.Stats(profiler)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        hot = [{"function": f"{Path(f).name}:{line}:{name}", "calls": cc, "own_ms": round(tt * 1e3, 2),
                "cumulative_ms": round(ct * 1e3, 2)} for (f, line, name), (cc, nc, tt, ct, _) in top]
        graph_tokens = engine.engine_config.parallel.prefill_graph_tokens
    report = json.dumps({"preset": args.preset, "prefill_graph_tokens": graph_tokens,
                         "cases": cases, "cprofile_case": [args.decodes[-1], args.prompts[0]],
                         "cprofile_top_own_time": hot})
    print(report)
    if args.output:
        Path(args.output).write_text(report)
    return 0


class _no_profile:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
