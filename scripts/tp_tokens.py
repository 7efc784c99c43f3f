"""Greedy tokens of a preset's random model at any TP size, and where two runs diverge.

    python scripts/tp_tokens.py generate --preset qwen3-8b --out tp1.json [engine options]
    torchrun --nproc_per_node 2 scripts/tp_tokens.py generate --preset qwen3-8b --out tp2.json
    python scripts/tp_tokens.py compare tp1.json tp2.json

``generate`` runs ``--num-prompts`` random prompts for ``--steps`` greedy tokens (random
weights from ``--seed``: the same tensors at every TP size) and writes, from rank 0, the
tokens with every rank's weight bytes, device memory and all-reduce path.
``compare`` reports, per prompt, the first step where the two runs' tokens differ and, at
that step, transformers' logits of both tokens (bf16 on CUDA) (a near-tie is bf16 reduction order,
not a bug); transformers runs the same random weights on one GPU.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.models import PRESETS, hf_model, open_engine  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402


def generate(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from engine.distributed import all_reduce_path
    from engine.sequence import SamplingParams

    args.random_weights = True
    with open_engine(args) as (engine, _):
        rng = random.Random(args.seed)
        vocab = engine.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        tokens = engine.generate_tokens(prompts, SamplingParams(temperature=0.0, max_tokens=args.steps,
                                                                ignore_eos=True))
        device = engine.device
        rank = {"rank": engine.tp.rank, "weight_bytes": engine.runner.weight_bytes,
                "memory_allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
                "memory_reserved": torch.cuda.memory_reserved(device) if device.type == "cuda" else 0}
        ranks = [rank]
        if engine.tp.size > 1:
            ranks = [None] * engine.tp.size
            dist.all_gather_object(ranks, rank)
        if engine.tp.rank == 0:
            report = {"preset": args.preset, "tp": engine.tp.size, "all_reduce": all_reduce_path(),
                      "graphs": bool(getattr(engine.runner, "graphs", None)), "prompts": prompts,
                      "tokens": tokens, "ranks": ranks}
            Path(args.out).write_text(json.dumps(report) + "\n")
            print(json.dumps({k: v for k, v in report.items() if k not in ("prompts", "tokens")}))


def compare(args: argparse.Namespace) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (args.first, args.second))
    assert a["prompts"] == b["prompts"] and a["preset"] == b["preset"], "runs of different prompts or models"
    divergences = []
    for i, (prompt, ta, tb) in enumerate(zip(a["prompts"], a["tokens"], b["tokens"])):
        step = next((s for s, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if step is not None:
            divergences.append({"prompt": i, "step": step, "tokens": [ta[step], tb[step]],
                                "context": prompt + ta[:step]})
    hf = None
    for d in divergences:
        if hf is None:
            where = argparse.Namespace(preset=a["preset"], seed=args.seed)
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            hf = hf_model(argparse.Namespace(dtype=dtype, device=device), where)
        with torch.no_grad():
            logits = hf(torch.tensor([d.pop("context")], device=device)).logits[0, -1].float()
        top2 = logits.topk(2)
        d.update(hf_logits=[float(logits[t]) for t in d["tokens"]],
                 hf_gap=float(logits[d["tokens"][0]] - logits[d["tokens"][1]]),
                 hf_top2_margin=float(top2.values[0] - top2.values[1]))
    per_rank = {name: [r["weight_bytes"] for r in run["ranks"]] for name, run in (("first", a), ("second", b))}
    print(json.dumps({"runs": [(a["tp"], a["all_reduce"], a["graphs"]), (b["tp"], b["all_reduce"], b["graphs"])],
                      "prompts": len(a["prompts"]), "steps": len(a["tokens"][0]),
                      "identical_prompts": len(a["prompts"]) - len(divergences), "divergences": divergences,
                      "weight_bytes_per_rank": per_rank,
                      "memory_reserved_per_rank": {"first": [r["memory_reserved"] for r in a["ranks"]],
                                                   "second": [r["memory_reserved"] for r in b["ranks"]]}}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--preset", choices=sorted(PRESETS), required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-prompts", type=int, default=4)
    gen.add_argument("--prompt-len", type=int, default=32)
    gen.add_argument("--steps", type=int, default=64)
    gen.add_argument("--out", required=True)
    cmp = commands.add_parser("compare")
    cmp.add_argument("first")
    cmp.add_argument("second")
    cmp.add_argument("--seed", type=int, default=0, help="the random weights' seed the runs used")
    args = parser.parse_args()
    generate(args) if args.command == "generate" else compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
