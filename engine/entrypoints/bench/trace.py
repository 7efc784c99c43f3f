"""A torch-profiler chrome trace of a few decode steps, and the eager check on a trace: no
torch.compile region, no Inductor-generated kernel, no CUDA graph launch."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from engine.entrypoints.bench.offline import greedy, random_prompt, run_to_end, sync

COMPILED_MARKERS = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph", "TorchDynamo")
INDUCTOR_KERNEL_PREFIXES = ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_", "cpp_fused_")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch", "hipGraphLaunch")


def eager_trace_check(trace_path: str | Path) -> dict:
    """Counts, over a chrome trace's events: torch.compile regions / compiled functions,
    Inductor kernels (``triton_poi_fused_...``; ours are named ``_..._kernel``), CUDA graph
    launches. ``eager`` is true when all three are zero in a trace that has events."""
    events = [e for e in json.loads(Path(trace_path).read_text()).get("traceEvents", []) if "name" in e]
    names = [str(e["name"]) for e in events]
    counts = {
        "compiled_function_events": sum(any(m in n for m in COMPILED_MARKERS) for n in names),
        "inductor_kernel_events": sum(n.startswith(INDUCTOR_KERNEL_PREFIXES) for n in names),
        "cuda_graph_launches": sum(n in GRAPH_LAUNCHES for n in names),
    }
    gpu_kernels = [e for e in events if e.get("cat") == "kernel"]
    return {"events": len(events), "gpu_kernel_events": len(gpu_kernels), **counts,
            "eager": len(events) > 0 and not any(counts.values())}


def gpu_kernel_us(trace_path: str | Path) -> float:
    """Summed duration (us) of the trace's GPU kernels."""
    events = json.loads(Path(trace_path).read_text()).get("traceEvents", [])
    return sum(e.get("dur", 0) for e in events if e.get("cat") == "kernel")


def profile_decode(engine, rng: random.Random, trace_path: str | Path, prompt_len: int, steps: int,
                   batch: int = 1) -> dict:
    """Write a chrome trace of ``steps`` decode steps at ``batch`` sequences (after an untimed
    prefill and one decode step) and check it; GPU kernel time per step from the trace, beside
    the wall time per step of the traced steps (the profiler's own cost included): their
    difference is what the GPU waited for.
    Under TP, rank r > 0 writes ``NAME.rank<r>.json`` beside ``trace_path``."""
    from torch.profiler import ProfilerActivity, profile

    if engine.tp.rank > 0:
        trace_path = Path(trace_path).with_suffix(f".rank{engine.tp.rank}.json")

    vocab = engine.config.vocab_size
    ids = [engine.add_request(random_prompt(rng, prompt_len, vocab), greedy(steps + 3), detokenize=False)
           for _ in range(batch)]
    engine.step()
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall_us = 1e6 * (time.perf_counter() - start)
    run_to_end(engine)
    for rid in ids:
        engine.pop_request(rid)
    Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    result = {"trace": str(trace_path), "batch_size": batch, "decode_steps": steps,
              "wall_us_per_step": wall_us / steps, "check": eager_trace_check(trace_path)}
    if engine.device.type == "cuda":
        result["gpu_kernel_us_per_step"] = gpu_kernel_us(trace_path) / steps
    return result
