"""``python -m engine generate``: complete prompts and print prompt + completion, through the engine client
(``engine.core.engine_client.InProcessClient``: its core on a thread of this process)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from engine.core.engine_args import EngineArgs
from engine.core.engine_client import InProcessClient, Stream
from engine.core.llm_engine import LLMEngine
from engine.core.lockstep import mirror_rank0
from engine.core.output_processor import RequestOutput
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
    if engine.tp.rank != 0:  # under torchrun: follow rank 0's core in lock-step
        mirror_rank0(engine)
        return 0
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {name: engine.sampling_defaults[name] if value is None else value for name, value in given.items()}
    params = SamplingParams(**sampling, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or ())
    prompts = args.prompt or ["def fibonacci(n):"]
    token_ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    client = InProcessClient(engine)
    client.start()
    try:
        outputs = asyncio.run(_complete(client, token_ids, params))
    finally:
        client.stop()
    rejected = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if out.finish_reason in ("rejected", "error"):
            rejected += 1
            print(f"error: prompt {i + 1} {out.finish_reason}: {out.reject_reason or out.error}", file=sys.stderr)
            continue
        print(prompt + out.text, flush=True)
        if len(prompts) > 1:
            print("-" * 40, flush=True)
    return 1 if rejected else 0


async def _complete(client: InProcessClient, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Each prompt run to its end through ``client``: its whole output (its text joined)."""
    bell = asyncio.Event()
    streams = [Stream(ids, params, i, bell, "") for i, ids in enumerate(prompts)]
    for stream in streams:
        client.submit(stream)
    texts, finals = [""] * len(streams), [None] * len(streams)
    while not all(finals):
        await bell.wait()
        bell.clear()
        for i, stream in enumerate(streams):
            update = stream.take()
            if update is not None:
                texts[i] += update.text
                finals[i] = update if update.finished else None
    return [dataclasses.replace(final, text=text) for final, text in zip(finals, texts)]
