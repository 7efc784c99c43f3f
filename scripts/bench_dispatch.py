"""Host cost of dispatching the decode-path kernels, the part eager decode is bound by.

    python scripts/bench_dispatch.py [--calls 2000] [--json out.json]

``ours_us``: host µs per call of each op through ``engine.model.kernels`` (the interface's checks, the
Triton backend's wrapper: strides, blocks, grid, output allocation, the cached launcher's key)
with Triton's launch replaced by a stub, so the time is the Python we own. Runs anywhere (CPU tensors, the Triton
backend forced; no kernel runs).

On CUDA also, per op: ``full_us``, the real call (our wrapper, then the compiled kernel's launcher
through ``engine.model.kernels.triton.launcher``); ``jit_us``, Triton's launch alone
(``kernel[grid](*args)`` with the arguments of the last call); ``cached_us``, the same launch
through the compiled kernel's own launcher (``CompiledKernel.run`` with the stream and the
packed metadata kept from a first call): what a cached launcher (no per-call specialisation)
would cost. The GPU is kept busy behind a ``torch.cuda._sleep`` so no launch waits for it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_calls(device: str, dtype: torch.dtype) -> dict:
    """One B=1 decode call of each op on Qwen3-8B's per-rank shapes (cache of 64 blocks of 16)."""
    import engine.model.kernels as K

    hidden, heads, kv, d, inter = 4096, 32, 8, 128, 12288
    rand = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    x, residual, weight = rand(1, hidden), rand(1, hidden), 1 + 0.1 * rand(hidden)
    qkv = rand(1, (heads + 2 * kv) * d)
    q, k, v = (t.view(1, -1, d) for t in qkv.split([heads * d, kv * d, kv * d], dim=-1))
    cache, _ = K.get_cos_sin_cache(4096, d, 1e6, device=device)
    k_cache, v_cache = rand(64, 16, kv, d), rand(64, 16, kv, d)
    positions, slots = torch.tensor([100], device=device), torch.tensor([100], device=device)
    tables, lens = torch.arange(64, device=device, dtype=torch.int32)[None], torch.tensor([101], device=device,
                                                                                          dtype=torch.int32)
    gate_up, act = rand(1, 2 * inter), torch.empty(1, inter, device=device, dtype=dtype)
    return {
        "fused_add_rms_norm": lambda: K.fused_add_rms_norm(x, residual, weight, 1e-6),
        "qk_norm_rope_store": lambda: K.qk_norm_rope_store(positions, q, k, v, weight[:d], weight[:d], 1e-6, cache,
                                                           k_cache, v_cache, slots),
        "paged_decode_attention": lambda: K.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5),
        "silu_and_mul": lambda: K.silu_and_mul(act, gate_up),
    }


def per_call_us(fn, calls: int, cuda: bool) -> float:
    """Median over 5 rounds of host µs per call of ``fn`` (on CUDA behind a GPU sleep)."""
    fn()
    rounds = []
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(10_000_000)  # ~5-10 ms of GPU sleep: launches queue, none waits
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append(1e6 * (time.perf_counter() - start) / calls)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(rounds)


def stubbed(calls: int) -> dict:
    """Our wrappers' host µs per call, Triton's launch a no-op (CPU tensors, Triton backend forced)."""
    import triton

    import engine.model.kernels as K

    real_select, real_run = K._select, triton.runtime.jit.JITFunction.run
    K._select = lambda device_type, forced: "triton"
    triton.runtime.jit.JITFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    try:
        return {name: per_call_us(fn, calls, False) for name, fn in decode_calls("cpu", torch.float32).items()}
    finally:
        K._select, triton.runtime.jit.JITFunction.run = real_select, real_run


def launches(calls: int) -> dict:
    """On CUDA, per op: the whole call, Triton's JIT launch, and the compiled kernel's launcher."""
    import triton

    from engine.model.kernels.triton import launcher

    results = {}
    captured = []
    real_run = triton.runtime.jit.JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        captured.append((self, args, kwargs, grid, kernel))
        return kernel

    for name, fn in decode_calls("cuda", torch.bfloat16).items():
        full = per_call_us(fn, calls, True)
        captured.clear()
        launcher._compiled.clear()  # the next call goes through Triton's JITFunction.run, recorded
        triton.runtime.jit.JITFunction.run = record
        try:
            fn()
        finally:
            triton.runtime.jit.JITFunction.run = real_run
        jit_us = cached_us = 0.0
        for jit_fn, args, kwargs, grid, kernel in captured:
            jit_us += per_call_us(lambda: jit_fn[grid](*args, **kwargs), calls, True)
            stream = torch.cuda.current_stream().cuda_stream
            # the kernel's own arguments in signature order; launch options (num_warps, ...) are not among them
            values = [*args, *(kwargs[name] for name in jit_fn.arg_names[len(args):] if name in kwargs)]
            grid3 = (*grid, 1, 1)[:3]
            cached_us += per_call_us(lambda: kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, None,
                                                        None, None, *values), calls, True)
        results[name] = {"full_us": full, "jit_us": jit_us, "cached_us": cached_us, "launches": len(captured)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    report = {"ours_us": stubbed(args.calls)}
    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name()
        report["launch"] = launches(args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    for name, us in report["ours_us"].items():
        line = f"{name:<24} ours {us:6.1f} us"
        if "launch" in report:
            r = report["launch"][name]
            line += (f"   full {r['full_us']:6.1f}   triton jit {r['jit_us']:6.1f}   cached launcher "
                     f"{r['cached_us']:6.1f} us ({r['launches']} launches)")
        print(line, file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
