"""``python -m engine bench latency | throughput | serve``: benchmarks that print a JSON report.

latency     B=1 decode tok/s and ms/token, TTFT at 128 / 1024 / 4096-token prompts (clamped to
            max_model_len), the host/GPU split of a decode step (CPU dispatch us per decoder layer)
throughput  nano-vllm's shape: 256 sequences, random prompt and output lengths in [100, 1024],
            random token ids, ignore_eos; output and total tok/s
serve       an HTTP client for a running ``python -m engine serve`` (streaming /v1/completions):
            TTFT, TPOT, ITL, E2E latency (mean, median, p99) and request / token throughput;
            ``--structured json_schema,tools``: per workload, plain requests then constrained
            ones under the same load (``response_format`` json_schema on /v1/completions; tools
            with ``tool_choice: "required"`` on /v1/chat/completions), the constrained answers
            validated, output tok/s and TTFT / ITL of each side, their ratios, the grammar's
            compile ms (cold, cached) and host us per mask fill at 64 rows (``engine.entrypoints.bench.structured``)
overlap     overlapped against synchronous engine steps on a simulated device (a fixed delay per
            step; the engine's host work is real): step, host and device ms per step (CPU, seconds)
spec        speculative decoding (--method ngram|draft|eagle3|mtp) at B=1: a code-editing and a plain-completion
            workload through a plain and a speculative engine (tokens per target forward, tok/s,
            acceptance), and a verify step's time against a decode step's (``engine.entrypoints.bench.spec``)

The model: ``--model DIR`` or a Hugging Face Hub id (``--model ORG/NAME [--revision REV]``, fetched into
the Hugging Face cache), or ``--preset NAME --random-weights`` (full-size, random weights made
on the device, no checkpoint). ``--compare hf`` times transformers on the same weights in the
same process and adds ratios; ``--profile trace.json`` writes a torch-profiler chrome trace of a
few decode steps and checks it is eager (no compiled region, Inductor kernel or CUDA graph
launch). GPU utilisation and memory are sampled through NVML when nvidia-ml-py is installed.
The report is the last line of stdout (and ``--output FILE``); progress bars go to stderr.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

from engine.core.engine_args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.bench.models import PRESETS
from engine.scheduling.speculative import SPECULATIVE_METHODS

SERVE_DEFAULT_URL = "http://127.0.0.1:8000"


def add_bench_command(commands) -> None:
    """Add ``bench`` (with its modes) to the ``python -m engine`` subcommands."""
    bench = commands.add_parser("bench", help="benchmark latency, throughput or a running server (JSON report)",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = bench.add_subparsers(dest="mode", required=True)
    latency = modes.add_parser("latency", help="B=1 decode tok/s, TTFT, host/GPU time of a decode step")
    throughput = modes.add_parser("throughput", help="offline batch throughput (nano-vllm's shape)")
    serve = modes.add_parser("serve", help="load a running server over HTTP (vLLM's serving metrics)")
    overlap = modes.add_parser("overlap", help="overlapped vs synchronous steps on a simulated device (CPU, seconds)")
    spec = modes.add_parser("spec", help="speculative decoding at B=1: workloads and the verify step's cost")
    overlap.add_argument("--num-seqs", type=_int_list, default=[1, 256], metavar="N,N,...",
                         help="batch sizes, each run in both modes (default 1,256)")
    overlap.add_argument("--gpu-ms", type=_float_pair, default=(5.0, 12.0), metavar="AT_1,AT_MAX",
                         help="simulated device ms per step at one sequence and at the largest batch, linear "
                              "between (default 5,12: a Qwen3-8B-sized step on an H200)")
    overlap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    overlap.add_argument("--output-len", type=int, default=48, help="output tokens per request (default 48)")
    overlap.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    overlap.add_argument("--output", metavar="FILE", help="also write the JSON report here")
    overlap.set_defaults(run=run_overlap)
    for mode in (latency, throughput, serve, spec):
        EngineArgs.add_cli_args(mode)
        source = mode.add_argument_group("model source")
        source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config, used with --random-weights")
        source.add_argument("--random-weights", action="store_true",
                            help="random weights made on the device (needs --preset; no checkpoint read)")
    for mode in (latency, throughput):
        extra = mode.add_argument_group("comparison and profiling")
        extra.add_argument("--compare", choices=["hf", "hf-eager"],
                           help="also time transformers on the same weights: eager and static cache + compile "
                                "(hf), or eager only (hf-eager)")
        extra.add_argument("--profile", metavar="TRACE_JSON", help="write a chrome trace of a few decode steps")
        extra.add_argument("--profile-steps", type=int, default=5, help="decode steps traced (default 5)")
    latency.add_argument("--prompt-lens", type=_int_list, default=[128, 1024, 4096], metavar="N,N,...",
                         help="TTFT prompt lengths (default 128,1024,4096; clamped to max_model_len - 1)")
    latency.add_argument("--repeats", type=int, default=3, help="TTFT runs per length, median reported (default 3)")
    latency.add_argument("--decode-tokens", type=int, default=256, help="decode steps timed at B=1 (default 256)")
    latency.add_argument("--decode-prompt-len", type=int, default=128, help="prompt before decoding (default 128)")
    latency.add_argument("--split-steps", type=int, default=20,
                         help="decode steps for the host/GPU time split (default 20)")
    throughput.add_argument("--num-seqs", type=int, default=256, help="sequences (default 256)")
    throughput.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (default 100)")
    throughput.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (default 1024)")
    throughput.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6, "
                                                                            "as nano-vllm)")
    throughput.add_argument("--hf-num-seqs", type=int, default=16,
                            help="with --compare hf: sequences of the subset both engines run (default 16)")
    spec.add_argument("--num-requests", type=int, default=None,
                      help="requests of each workload (default: all 24 functions of "
                           "engine/entrypoints/bench/spec_workload.json)")
    spec.add_argument("--method", dest="speculative", choices=SPECULATIVE_METHODS, default=None,
                      help="the speculative method (the same as --speculative; default ngram)")
    spec.add_argument("--verify-context", type=int, default=512, help="context of the timed verify step (default 512)")
    spec.add_argument("--verify-steps", type=int, default=50, help="timed decode and verify steps (default 50)")
    serve.add_argument("--url", default=SERVE_DEFAULT_URL, help=f"server base URL (default {SERVE_DEFAULT_URL})")
    serve.add_argument("--launch", action="store_true",
                       help="start the server (the engine options' model, on a free port) and stop it after; "
                            "without it, the model options only name the served model's vocabulary")
    serve.add_argument("--num-prompts", type=int, default=100, help="requests (default 100)")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second (default inf: all at once)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    serve.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    serve.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default 128)")
    serve.add_argument("--range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    serve.add_argument("--health-timeout", type=float, default=60.0, help="seconds to wait for /health")
    structured = serve.add_argument_group("structured outputs (engine.entrypoints.bench.structured)")
    structured.add_argument("--structured", type=_workloads, default=None, metavar="WORKLOAD,...",
                            help="instead of the plain load: each workload's (json_schema, tools) plain and "
                                 "constrained loads, compared (tools needs a chat template: skipped without one)")
    structured.add_argument("--tokenizer", metavar="DIR", default=None,
                            help="with --preset: the served model's tokenizer (and chat template) from DIR "
                                 "instead of a one-word one (--structured needs a real tokenizer)")
    structured.add_argument("--chat-template", metavar="FILE", default=None,
                            help="with --launch: the server's --chat-template (a template rendering tools)")
    structured.add_argument("--mask-steps", type=int, default=200,
                            help="steps of the timed 64-row grammar mask fill (default 200)")
    for mode in (latency, throughput, serve, spec):
        mode.add_argument("--seed", type=int, default=0, help="seed of prompts and random weights (default 0)")
        mode.add_argument("--output", metavar="FILE", help="also write the JSON report here")
        mode.add_argument("--gpu-sample-interval", type=float, default=0.2, help="NVML sampling period in s")
        mode.set_defaults(run=run_bench)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _workloads(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    if not names or set(names) - {"json_schema", "tools"}:
        raise argparse.ArgumentTypeError(f"expected json_schema and / or tools, comma-separated, got {text!r}")
    return names


def _float_pair(text: str) -> tuple[float, float]:
    values = [float(x) for x in text.split(",")]
    if len(values) != 2 or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected two positive numbers AT_1,AT_MAX, got {text!r}")
    return values[0], values[1]


def run_overlap(args: argparse.Namespace) -> int:
    from engine.entrypoints.bench.overlap import bench_overlap

    report = {"bench": "overlap", "machine": machine(), "settings": _settings(args),
              **bench_overlap(args.num_seqs, *args.gpu_ms, args.prompt_len, args.output_len, args.seed)}
    emit(report, args.output)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from engine.entrypoints.bench.monitor import GpuMonitor

    _check_source(args)
    report = {"bench": args.mode, "machine": machine(args.device), "settings": _settings(args)}
    # a run on the CPU samples no GPU (serve without --launch measures a server anywhere: it samples)
    on_cpu = report["machine"]["device"].startswith("cpu") and (args.mode != "serve" or args.launch)
    with GpuMonitor(args.gpu_sample_interval, "the run is on the CPU" if on_cpu else None) as monitor:
        if args.mode == "serve":
            report["serve"] = run_serve(args)
        else:
            run_offline(args, report)
    report["gpu_monitor"] = monitor.report()
    window = report.get("throughput", {}).get("monotonic_window")
    if window is not None:  # the timed run alone: the figure GPU busy is stated in
        report["gpu_monitor"]["timed_run"] = monitor.report(window)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank runs the bench; rank 0 reports
        emit(report, args.output)
    return 0


def _check_source(args: argparse.Namespace) -> None:
    if args.preset and not args.random_weights:
        raise ValueError("--preset has no checkpoint: add --random-weights")
    if args.random_weights and not args.preset:
        raise ValueError("--random-weights needs --preset NAME")
    if args.preset and args.model:
        raise ValueError("give --model or --preset, not both")
    if args.random_weights and args.backend == "hf":
        raise ValueError("--random-weights fills our model; --backend hf reads a checkpoint")
    if getattr(args, "tokenizer", None) and not args.preset:
        raise ValueError("--tokenizer is for a --preset (a checkpoint serves its own tokenizer)")
    if getattr(args, "chat_template", None) and not args.launch:
        raise ValueError("--chat-template is passed to the server --launch starts")
    if getattr(args, "structured", None) and args.preset and not args.tokenizer:
        raise ValueError("--structured with --preset needs --tokenizer DIR (a preset's own tokenizer is one word)")
    if getattr(args, "compare", None) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--compare hf runs in a single process, not under torchrun")


def model_config(args: argparse.Namespace):
    from engine.model.config import ModelConfig

    if args.preset:
        return ModelConfig.from_dict(PRESETS[args.preset])
    return ModelConfig.from_model_dir(model_files(args))


def model_files(args: argparse.Namespace) -> Path:
    """The directory holding the configs and tokenizer of ``--model`` (a Hub id's snapshot, its
    weights fetched only when an engine is built from it)."""
    from engine.core.engine_config import DEFAULT_MODEL_DIR
    from engine.core.model_source import resolve_model

    return resolve_model(args.model or DEFAULT_MODEL_DIR, args.revision, weights=False).path


def run_offline(args: argparse.Namespace, report: dict) -> None:
    import torch

    from engine.entrypoints.bench.models import open_engine

    limit = model_config(args).max_position_embeddings
    if args.max_model_len is None:  # as long as the benchmark needs, not the model's maximum
        needed = {"latency": lambda: max(max(args.prompt_lens) + 1, args.decode_prompt_len + args.decode_tokens + 1),
                  "throughput": lambda: 2 * args.max_len, "spec": lambda: max(1024, args.verify_context + 64)}
        args.max_model_len = min(limit, needed[args.mode]())
    if args.mode in ("latency", "spec") and args.max_num_seqs is None:
        args.max_num_seqs = 1
    if args.mode == "spec":
        args.speculative = args.speculative or "ngram"
    start = time.perf_counter()
    with open_engine(args) as (engine, weights):
        c = engine.config
        report["model"] = {"source": f"preset {args.preset}" if args.preset else str(engine.model_dir),
                           "weights": weights, "architecture": c.architecture, "num_layers": c.num_hidden_layers,
                           "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": str(engine.dtype),
                           "device": str(engine.device), "tp": engine.tp.size,
                           "weight_gib_per_rank": engine.runner.weight_bytes / 2**30,
                           "load_seconds": time.perf_counter() - start}
        report["engine"] = {"max_model_len": engine.max_model_len, "max_num_seqs": engine.scheduler.max_num_seqs,
                            "block_size": engine.block_manager.block_size, "kv_cache_blocks": engine.runner.num_blocks,
                            "kv_cache_gib": engine.runner.kv_cache_bytes / 2**30}
        {"latency": run_latency, "throughput": run_throughput, "spec": run_spec}[args.mode](engine, args, report)
        if engine.device.type == "cuda":
            report["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30


def run_latency(engine, args: argparse.Namespace, report: dict) -> None:
    from engine.entrypoints.bench import offline
    from engine.entrypoints.bench.trace import profile_decode

    rng = random.Random(args.seed)
    vocab, room = engine.config.vocab_size, engine.max_model_len
    offline.warm_up(engine, rng)
    report["ttft"] = [offline.measure_ttft(engine, rng, n, args.repeats) for n in args.prompt_lens]
    prompt = offline.random_prompt(rng, min(args.decode_prompt_len, room // 2), vocab)
    tokens = min(args.decode_tokens, room - len(prompt) - 1)
    report["decode"] = offline.measure_decode(engine, prompt, tokens)
    steps = min(args.split_steps, room - len(prompt) - 4)
    if getattr(engine.runner, "graphs", None):  # a replayed graph runs no module hook: nothing to split
        report["step_split"] = {"skipped": "decode replays CUDA graphs (host dispatch is one replay per step)"}
    else:
        report["step_split"] = offline.measure_step_split(engine, rng, len(prompt), steps)
    if args.profile:
        report["profile"] = profile_decode(engine, rng, args.profile, len(prompt),
                                           min(args.profile_steps, room - len(prompt) - 4))
    if args.compare in ("hf", "hf-eager"):
        from engine.entrypoints.bench.hf_compare import compare_decode
        from engine.entrypoints.bench.models import hf_model

        hf = compare_decode(hf_model(engine, args), prompt, tokens,
                            compile=False if args.compare == "hf-eager" else None)
        ours = report["decode"]["tok_s"]
        hf["ratios"] = {f"ours_vs_{name}": ours / figures["tok_s"] for name, figures in hf.items()
                        if "tok_s" in figures}
        report["compare_hf"] = hf


def run_throughput(engine, args: argparse.Namespace, report: dict) -> None:
    from engine.entrypoints.bench import offline
    from engine.entrypoints.bench.trace import profile_decode

    if not 1 <= args.min_len <= args.max_len:
        raise ValueError(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    rng = random.Random(args.seed)
    prompts, output_lens = offline.throughput_workload(args.num_seqs, args.min_len, args.max_len,
                                                       engine.config.vocab_size, engine.max_model_len, args.seed)
    offline.warm_up(engine, rng)
    report["throughput"] = {**offline.measure_throughput(engine, prompts, output_lens, args.temperature),
                            "temperature": args.temperature}
    if args.profile:
        batch = min(args.num_seqs, engine.scheduler.max_num_seqs)
        report["profile"] = profile_decode(engine, rng, args.profile, args.min_len, args.profile_steps, batch)
    if args.compare in ("hf", "hf-eager"):
        from engine.entrypoints.bench.hf_compare import hf_batch_generate
        from engine.entrypoints.bench.models import hf_model

        # fresh prompts: the timed run's are in the prefix cache now
        subset, lens = offline.throughput_workload(min(args.hf_num_seqs, args.num_seqs), args.min_len, args.max_len,
                                                   engine.config.vocab_size, engine.max_model_len, args.seed + 1)
        length = min(max(lens), engine.max_model_len - max(map(len, subset)))
        ours = offline.measure_throughput(engine, subset, [length] * len(subset), 0.0, desc="throughput subset")
        hf = hf_batch_generate(hf_model(engine, args), subset, length)
        report["compare_hf"] = {
            "subset": f"{len(subset)} new sequences of the same shape, each generating {length} tokens greedily "
                      f"(HF's batched generate has one output length per batch; eager, DynamicCache, left padding)",
            "ours": ours, "hf_eager": hf, "ratios": {"ours_vs_eager": ours["output_tok_s"] / hf["output_tok_s"]}}


def run_spec(engine, args: argparse.Namespace, report: dict) -> None:
    """The verify step's cost on the speculative ``engine``; with a checkpoint (not a preset's
    random weights, whose tokenizer is one word) the workloads, beside a plain engine."""
    from dataclasses import replace

    from engine.entrypoints.bench import spec

    report["verify_step"] = spec.measure_verify_step(engine, args.num_speculative_tokens, args.verify_context,
                                                     args.verify_steps)
    if args.preset is None:
        plain_args = replace(EngineArgs.from_cli_args(args), speculative=None, draft_model=None)
        plain = LLMEngine(plain_args.create_engine_config())
        report["workloads"] = spec.run_workloads(plain, engine, args.num_requests)


def run_serve(args: argparse.Namespace) -> dict:
    from engine.entrypoints.bench.serve import bench_serve, launch_server, serve_workload

    prompts, output_lens = serve_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                          model_config(args).vocab_size, args.seed)
    load = functools.partial(run_structured, args=args) if args.structured else bench_serve
    if not args.launch:
        return load(args.url, prompts, output_lens, args.request_rate, args.max_concurrency, args.seed,
                    args.health_timeout)
    server, url = launch_server(server_command(args))
    try:
        return {"url": url, **load(url, prompts, output_lens, args.request_rate, args.max_concurrency, args.seed,
                                   args.health_timeout)}
    finally:
        server.terminate()
        server.wait(60)


def run_structured(url: str, prompts, output_lens, request_rate: float, max_concurrency: int | None, seed: int,
                   health_timeout_s: float, *, args: argparse.Namespace) -> dict:
    """``--structured``: each workload's report (``engine.entrypoints.bench.structured``), the grammars
    compiled over the served model's tokenizer (``--tokenizer`` for a preset)."""
    import asyncio

    from engine.core.tokenizer import load_tokenizer
    from engine.entrypoints.bench import structured
    from engine.entrypoints.bench.serve import wait_healthy

    tokenizer = load_tokenizer(Path(args.tokenizer) if args.preset else model_files(args))
    config = model_config(args)
    stop_ids = set(config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    url = url.rstrip("/")
    asyncio.run(wait_healthy(url, health_timeout_s))
    return {"structured": {workload: structured.bench_structured(
        url, workload, prompts, output_lens, tokenizer, config.vocab_size, stop_ids, config.architecture, request_rate,
        max_concurrency, seed, args.mask_steps) for workload in args.structured}}


def server_command(args: argparse.Namespace) -> list[str]:
    """The command line of the server ``--launch`` starts: ``python -m engine serve`` for a
    checkpoint, ``python -m engine.entrypoints.bench.preset_server`` for a preset; same engine options."""
    if args.preset:
        command = [sys.executable, "-m", "engine.entrypoints.bench.preset_server", "--preset", args.preset, "--seed",
                   str(args.seed)] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    else:
        command = [sys.executable, "-m", "engine", "serve"]
    if args.chat_template:
        command += ["--chat-template", args.chat_template]
    return command + EngineArgs.from_cli_args(args).to_cli_args() + ["--port", "0"]


def machine(device: str | None = None) -> dict:
    """What a report was measured on; ``device`` is the run's ``--device`` (None: CUDA when present),
    so a CPU run on a GPU host is labelled as the CPU run it is."""
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if torch.cuda.is_available() and not (device or "").startswith("cpu"):
        info.update(device=torch.cuda.get_device_name(), device_count=torch.cuda.device_count(),
                    cuda=torch.version.cuda)
    else:
        info["device"] = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return info


def _settings(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in vars(args).items() if k not in ("run", "command")}


def emit(report: dict, output: str | None) -> None:
    """A few readable lines on stderr; the report as one JSON line on stdout (and in ``output``)."""
    for key in ("decode", "step_split", "throughput", "serve", "compare_hf", "results", "verify_step", "workloads"):
        if key in report:
            print(f"{key}: {json.dumps(report[key])[:400]}", file=sys.stderr)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report), flush=True)
