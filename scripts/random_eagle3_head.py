"""A random-weight EAGLE-3 head for a preset's full-size target (bench spec's cost of drafting on the
GPU, where no trained head can be carried): the published layout (``LlamaForCausalLMEagle3``:
``fc``, ``midlayer``, ``norm``, ``lm_head`` over a draft vocabulary, ``d2t``, ``t2d``), the target's
hidden size and heads, MLP width and draft vocabulary as published 8B heads have them.

    python scripts/random_eagle3_head.py --preset qwen3-8b --out build/eagle3_qwen3_8b   # ~1.6 GB, float32
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "phases" / "13_speculative")]

from draft_checkpoints import make_eagle3_head  # noqa: E402
from engine.entrypoints.bench.models import PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (default 32,000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as target:
        (Path(target) / "config.json").write_text(json.dumps(preset))
        make_eagle3_head(args.out, Path(target), seed=args.seed, draft_vocab=args.draft_vocab,
                         intermediate_size=preset["intermediate_size"])
    print(json.dumps({"out": str(args.out), "preset": args.preset, "draft_vocab": args.draft_vocab}))


if __name__ == "__main__":
    main()
