"""Command line: ``python -m engine generate | serve | bench``.

Under ``torchrun --nproc_per_node N -m engine ...`` every rank runs the same
command (tensor parallel); only rank 0 prints.
"""
from __future__ import annotations

import argparse
import sys

from engine.bench import add_bench_command
from engine.scheduler import ADMISSION_POLICIES
from engine.server import add_serve_command


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The LLMEngine options every subcommand that loads a model shares."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, metavar="DIR",
                       help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer); "
                            "default: the demo model shipped in engine/default_model")
    group.add_argument("--backend", default="tp", choices=["tp", "qwen_tp", "deepseek_tp", "hf"],
                       help="tp: route by config.json architectures[0] (default); hf: transformers under our "
                            "scheduler")
    group.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="default: float32 on CPU, the checkpoint's half dtype (else bfloat16) on CUDA")
    group.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is present, else cpu")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="most sequences running at once (default 256 on CUDA, 16 on CPU)")
    group.add_argument("--max-num-batched-tokens", type=int, default=8192,
                       help="most prompt tokens prefilled in one step; longer prompts are prefilled in chunks "
                            "(default 8192)")
    group.add_argument("--admission", default=ADMISSION_POLICIES[0], choices=ADMISSION_POLICIES,
                       help="watermark: start a request when its prompt fits the KV cache, preempting (and later "
                            "recomputing) the newest requests when it runs out (default); reserve: start one only "
                            "when its prompt + max_tokens fits beside every running request's, never preempting")
    group.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    group.add_argument("--mem-utilization", type=float, default=0.9,
                       help="fraction of the free device memory the KV cache may take (default 0.9)")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    group.add_argument("--enforce-eager", action="store_true",
                       help="decode without CUDA graphs (graphs are the default on CUDA)")
    group.add_argument("--no-overlap", action="store_true",
                       help="run each step to the end before scheduling the next (default: the host schedules and "
                            "postprocesses while the device runs the previous step)")
    group.add_argument("--quantization", default=None, choices=["fp8"],
                       help="fp8: quantize a float checkpoint's linear weights to FP8 at load (128 x 128 blocks, "
                            "W8A8); FP8 checkpoints are read in their own format without it")
    group.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="tensor parallel on CUDA: all-reduce with NCCL only (default: symmetric memory for "
                            "small messages)")


def build_engine(args: argparse.Namespace):
    from engine.llm_engine import LLMEngine

    return LLMEngine(args.model, inference_backend=args.backend, block_size=args.block_size,
                     mem_utilization=args.mem_utilization, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                     dtype=args.dtype, device=args.device, enable_prefix_caching=not args.no_prefix_caching,
                     enforce_eager=args.enforce_eager, custom_all_reduce=not args.disable_custom_all_reduce,
                     admission=args.admission, overlap=not args.no_overlap, quantization=args.quantization)


def generate(args: argparse.Namespace) -> int:
    from engine.sequence import SamplingParams

    engine = build_engine(args)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts and print the text",
                              description="Complete each --prompt and print prompt + completion "
                                          "(default prompt: 'def fibonacci(n):'). A prompt the engine "
                                          "rejects (e.g. longer than --max-model-len) is named on stderr, "
                                          "the others still print, and the exit code is 1.")
    add_engine_arguments(gen)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--prompt", action="append", help="a prompt (repeat for several, batched together)")
    sampling.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 = greedy (default: the checkpoint's generation_config.json when it samples, "
                               "else 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="nucleus sampling mass (default: generation_config.json's, else 1.0 = off)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="keep the k most likely tokens (default: generation_config.json's, else 0 = off)")
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed (default: random per request)")
    sampling.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(run=generate)
    add_serve_command(commands)
    add_bench_command(commands)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
