"""``python -m engine generate``: complete prompts and print prompt + completion."""
from __future__ import annotations

import argparse
import sys

from engine.core.engine_args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams


def add_generate_command(commands) -> None:
    """Add ``generate`` to the ``python -m engine`` subcommands."""
    parser = commands.add_parser("generate", help="complete prompts and print the text",
                                 description="Complete each --prompt and print prompt + completion (default prompt: "
                                             "'def fibonacci(n):'). A prompt the engine rejects (e.g. longer than "
                                             "--max-model-len) is named on stderr, the others still print, and the "
                                             "exit code is 1.")
    EngineArgs.add_cli_args(parser)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--prompt", action="append", help="a prompt (repeat for several, batched together)")
    sampling.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 = greedy (default: the checkpoint's generation_config.json when it samples, else 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="nucleus sampling mass (default: generation_config.json's, else 1.0 = off)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="keep the k most likely tokens (default: generation_config.json's, else 0 = off)")
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed (default: random per request)")
    sampling.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.set_defaults(run=generate)


def generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {name: engine.sampling_defaults[name] if value is None else value for name, value in given.items()}
    params = SamplingParams(**sampling, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or ())
    prompts = args.prompt or ["def fibonacci(n):"]
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    rejected = 0
    if engine.tp.rank == 0:
        for i, (prompt, rid) in enumerate(zip(prompts, ids)):
            out = engine.pop_request(rid)
            if out.finish_reason == "rejected":
                rejected += 1
                print(f"error: prompt {i + 1} rejected: {out.reject_reason}", file=sys.stderr)
                continue
            print(prompt + out.text, flush=True)
            if len(prompts) > 1:
                print("-" * 40, flush=True)
    return 1 if rejected else 0
