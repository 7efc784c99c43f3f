"""Where an eager decode step's host time goes: B=1 eager decode steps under cProfile.

    python scripts/eager_host_profile.py [--preset qwen3-8b] [--steps 20] [--json out.json]

Builds the preset with random weights and ``--enforce-eager``, decodes one prompt, and profiles
``--steps`` engine steps. Prints the functions with the most own time and the most cumulative
time (per step), and how many calls each step makes to the launch paths that matter (Triton's
``JITFunction.run``, a compiled kernel's own launcher). cProfile adds its own cost to every
Python call, so read the shares, not the absolute microseconds; the unprofiled step time is
printed beside them.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.bench import offline
    from engine.bench.models import open_engine
    from engine.bench.short import engine_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    args = engine_args(opts.preset, 0, "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "1")
    with open_engine(args) as (engine, _):
        rng = random.Random(0)
        offline.warm_up(engine, rng)
        rid = engine.add_request(offline.random_prompt(rng, 256, engine.config.vocab_size),
                                 offline.greedy(3 * opts.steps + 8), detokenize=False)
        for _ in range(4):
            engine.step()
        start = time.perf_counter()
        for _ in range(opts.steps):
            engine.step()
        plain_ms = 1e3 * (time.perf_counter() - start) / opts.steps
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(opts.steps):
            engine.step()
        profile.disable()
        offline.run_to_end(engine)
        engine.pop_request(rid)
    stats = pstats.Stats(profile)
    total = sum(entry[2] for entry in stats.stats.values())  # own time summed: the profiled wall time
    rows = []
    for (path, line, name), (calls, _, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls_per_step": calls / opts.steps,
                     "own_us_per_step": 1e6 * own / opts.steps, "cum_us_per_step": 1e6 * cumulative / opts.steps,
                     "own_share": own / total})
    report = {"preset": opts.preset, "steps": opts.steps, "unprofiled_ms_per_step": plain_ms,
              "profiled_ms_per_step": 1e3 * total / opts.steps,
              "by_own_time": sorted(rows, key=lambda r: -r["own_us_per_step"])[:opts.top],
              "by_cumulative_time": sorted(rows, key=lambda r: -r["cum_us_per_step"])[:opts.top]}
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{opts.preset}: {plain_ms:.2f} ms per eager step unprofiled, {report['profiled_ms_per_step']:.2f} profiled")
    for title, key in (("own time", "by_own_time"), ("cumulative time", "by_cumulative_time")):
        print(f"-- by {title} (per step): calls, own us, cumulative us, share of own time")
        for r in report[key]:
            print(f"{r['calls_per_step']:8.1f} {r['own_us_per_step']:9.1f} {r['cum_us_per_step']:9.1f} "
                  f"{100 * r['own_share']:5.1f}%  {r['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
