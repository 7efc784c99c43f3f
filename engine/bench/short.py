"""``python -m engine.bench.short``: the performance gate's benchmark (phase 11), a few minutes on an H200.

It measures a fixed set of figures (``FIGURES``) on random-weight presets and prints a JSON report
whose ``figures`` map each name to ``{"value", "unit", "higher_is_better"}``; the gate compares
them with ``phases/11_performance/baseline.json`` (``gates.diff.compare``). ``--write-baseline
FILE`` records a baseline: the figures, the machine and the tolerance the gate allows.

Three engines, one after the other (each freed before the next is built), all from
``engine.bench.offline``'s measurements:

qwen3         the Qwen3 preset, default engine (CUDA graphs on CUDA): B=1 decode tok/s, prefill
              tok/s of one long prompt (prompt tokens / TTFT), offline throughput of a batch
qwen3_eager   the same weights with ``--enforce-eager``: B=1 decode tok/s, host dispatch of a step
deepseek      the DeepSeek-V2-Lite preset, default engine: B=1 decode tok/s

``--tiny`` runs the same code on the tiny presets with small sizes (seconds on a CPU); its
figures are for checking the path, never for comparing with the H200 baseline.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.bench import emit, machine, offline
from gates.diff import DEFAULT_TOLERANCE  # a figure more than 10 % worse than the baseline fails the gate


@dataclass(frozen=True)
class Scale:
    """Models and sizes of one run of the short benchmark."""
    name: str
    qwen3: str              # preset names (engine.bench.models.PRESETS)
    deepseek: str
    prefill_len: int        # prompt of the prefill figure
    decode_prompt_len: int
    decode_tokens: int      # B=1 decode steps timed (graphed engines)
    eager_decode_tokens: int
    split_steps: int        # eager decode steps of the host-dispatch figure
    throughput_seqs: int    # prompts submitted at once
    throughput_lens: tuple[int, int]  # prompt and output lengths drawn in [lo, hi]


FULL = Scale("full", "qwen3-8b", "deepseek-v2-lite", prefill_len=4096, decode_prompt_len=128, decode_tokens=128,
             eager_decode_tokens=32, split_steps=10, throughput_seqs=64, throughput_lens=(64, 256))
TINY = Scale("tiny", "tiny-qwen3", "tiny-deepseek-v2-lite", prefill_len=256, decode_prompt_len=16, decode_tokens=16,
             eager_decode_tokens=8, split_steps=4, throughput_seqs=8, throughput_lens=(8, 32))

# name: (unit, higher is better); each section's measure_* function reports its own
FIGURES: dict[str, tuple[str, bool]] = {
    "qwen3_decode_b1_tok_s": ("tok/s", True),
    "qwen3_prefill_tok_s": ("tok/s", True),
    "qwen3_throughput_output_tok_s": ("tok/s", True),
    "qwen3_eager_decode_b1_tok_s": ("tok/s", True),
    "qwen3_eager_host_us_per_step": ("us", False),
    "deepseek_decode_b1_tok_s": ("tok/s", True),
}
SECTIONS = ("qwen3", "qwen3_eager", "deepseek")


def engine_args(preset: str, seed: int, *options: str) -> argparse.Namespace:
    """The options ``python -m engine bench --preset PRESET --random-weights OPTIONS`` would give."""
    from engine.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return argparse.Namespace(**vars(parser.parse_args(list(options))), preset=preset, random_weights=True,
                              seed=seed)


def _release() -> None:
    """Give the last engine's device memory back before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_qwen3(scale: Scale, seed: int) -> dict:
    from engine.bench.models import open_engine

    lo, hi = scale.throughput_lens
    room = max(scale.prefill_len + 1, 2 * hi, scale.decode_prompt_len + scale.decode_tokens + 1)
    args = engine_args(scale.qwen3, seed, "--max-model-len", str(room), "--max-num-seqs", str(scale.throughput_seqs))
    with open_engine(args) as (engine, _):
        rng = random.Random(seed)
        vocab = engine.config.vocab_size
        offline.warm_up(engine, rng)
        decode = offline.measure_decode(engine, offline.random_prompt(rng, scale.decode_prompt_len, vocab),
                                        scale.decode_tokens)
        ttft = offline.measure_ttft(engine, rng, scale.prefill_len, repeats=3)
        prompts, output_lens = offline.throughput_workload(scale.throughput_seqs, lo, hi, vocab, room, seed)
        throughput = offline.measure_throughput(engine, prompts, output_lens, temperature=0.6)
        graphs = bool(getattr(engine.runner, "graphs", None))
    return {"figures": {"qwen3_decode_b1_tok_s": decode["tok_s"],
                        "qwen3_prefill_tok_s": ttft["prompt_len"] / (ttft["ms"] / 1e3),
                        "qwen3_throughput_output_tok_s": throughput["output_tok_s"]},
            "cuda_graphs": graphs, "decode": decode, "ttft": ttft, "throughput": throughput}


def measure_qwen3_eager(scale: Scale, seed: int) -> dict:
    from engine.bench.models import open_engine

    room = scale.decode_prompt_len + max(scale.eager_decode_tokens, scale.split_steps + 4) + 1
    args = engine_args(scale.qwen3, seed, "--enforce-eager", "--max-model-len", str(room), "--max-num-seqs", "1")
    with open_engine(args) as (engine, _):
        rng = random.Random(seed)
        offline.warm_up(engine, rng)
        prompt = offline.random_prompt(rng, scale.decode_prompt_len, engine.config.vocab_size)
        decode = offline.measure_decode(engine, prompt, scale.eager_decode_tokens)
        split = offline.measure_step_split(engine, rng, scale.decode_prompt_len, scale.split_steps)
    return {"figures": {"qwen3_eager_decode_b1_tok_s": decode["tok_s"],
                        "qwen3_eager_host_us_per_step": split["host_dispatch_us_per_step"]},
            "decode": decode, "step_split": split}


def measure_deepseek(scale: Scale, seed: int) -> dict:
    from engine.bench.models import open_engine

    room = scale.decode_prompt_len + scale.decode_tokens + 1
    args = engine_args(scale.deepseek, seed, "--max-model-len", str(room), "--max-num-seqs", "1")
    with open_engine(args) as (engine, _):
        rng = random.Random(seed)
        offline.warm_up(engine, rng)
        prompt = offline.random_prompt(rng, scale.decode_prompt_len, engine.config.vocab_size)
        decode = offline.measure_decode(engine, prompt, scale.decode_tokens)
        graphs = bool(getattr(engine.runner, "graphs", None))
    return {"figures": {"deepseek_decode_b1_tok_s": decode["tok_s"]}, "cuda_graphs": graphs, "decode": decode}


MEASURE = {"qwen3": measure_qwen3, "qwen3_eager": measure_qwen3_eager, "deepseek": measure_deepseek}


def run_short(scale: Scale = FULL, seed: int = 0, sections: tuple[str, ...] = SECTIONS) -> dict:
    """The short benchmark's report: ``figures`` (every figure of ``sections``, each
    ``{"value", "unit", "higher_is_better"}``), and under ``sections`` what each measured."""
    start = time.perf_counter()
    report = {"bench": "short", "machine": machine(), "scale": asdict(scale), "seed": seed, "sections": {}}
    for name in sections:
        report["sections"][name] = MEASURE[name](scale, seed)
        _release()
    report["figures"] = {name: {"value": value, "unit": FIGURES[name][0], "higher_is_better": FIGURES[name][1]}
                         for section in report["sections"].values() for name, value in section["figures"].items()}
    report["seconds"] = time.perf_counter() - start
    return report


def baseline_from(report: dict, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """What ``baseline.json`` holds: the figures, the tolerance the gate allows, and where they came from."""
    return {"tolerance": tolerance, "scale": report["scale"]["name"], "machine": report["machine"],
            "command": "python -m engine.bench.short " + " ".join(sys.argv[1:]), "figures": report["figures"]}


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.short", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny presets and sizes (checks the path on a CPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and random weights (default 0)")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON report here")
    parser.add_argument("--write-baseline", metavar="FILE",
                        help="record the figures as the gate's baseline (phases/11_performance/baseline.json)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"with --write-baseline: the relative worsening the gate allows (default "
                             f"{DEFAULT_TOLERANCE})")
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    if set(sections) - set(SECTIONS):
        parser.error(f"unknown section(s) {', '.join(sorted(set(sections) - set(SECTIONS)))}")
    if args.write_baseline and (args.tiny or set(sections) != set(SECTIONS)):
        parser.error("a baseline is every section at full scale: drop --tiny and --sections")
    report = run_short(TINY if args.tiny else FULL, args.seed, sections)
    for name, figure in report["figures"].items():
        print(f"{name:<34} {figure['value']:>12.1f} {figure['unit']}", file=sys.stderr)
    if args.write_baseline:
        write_json(args.write_baseline, baseline_from(report, args.tolerance))
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
