"""Benchmark the engine.model.kernels ops on CUDA against copy bandwidth and torch eager.

    python scripts/bench_kernels.py [--json out.json] [--only elementwise rotary decode decode_fp8 gemv prefill
                                                         prefill_sweep]

Shapes are Qwen3-8B (hidden 4096, 32 q / 8 kv heads, d 128, intermediate 12288)
and DeepSeek-V2-Lite (hidden 2048, 16 heads, kv_lora_rank 512, rope 64, v 128)
at decode and prefill sizes; paged decode also with its one-launch merge and, at the offline
throughput's 256 sequences, over a bf16 and an e4m3 cache with several key tiles; and the decode
GEMV (best config per shape) against cuBLAS on Qwen3-8B's linears. Times are medians of CUDA-event timings from
triton.testing.do_bench, which clears the L2 cache before every call, so no
timing measures data left in L2. Our kernels are timed as CUDA-graph replays
(their own time, as graph-captured decode runs them) and eagerly (with
Python's launch cost); torch's reference eagerly. Memory-bound ops report GB/s
(bytes read + written once) and the share of a device-to-device copy measured
in the same run; prefill attention (eager) reports TFLOP/s, the Triton kernel's beside the op's
(which sends one causal sequence to cuDNN); ``prefill_sweep`` times the Triton kernel's launch
shapes beside torch's dense SDPA backends.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.kernels import get_cos_sin_cache, reference  # noqa: E402
from engine.model.kernels import triton as ours  # noqa: E402

DTYPE = torch.bfloat16
QWEN = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288)
DSV2 = dict(hidden=2048, heads=16, kv_lora=512, rope=64, nope=128, v=128)


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of ``fn`` captured in a CUDA graph and replayed (the L2 is cleared before each
    replay): the kernels' own time without Python launch gaps, as graph-captured decode runs them."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def rand(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def copy_gbps() -> float:
    src = torch.randn(1 << 28, device="cuda", dtype=DTYPE)  # 512 MiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_ms(lambda: dst.copy_(src)) / 1e6


def row(results, op, model, shape, ours_fn, torch_fn, nbytes=None, flops=None, copy=None, baseline=None,
        graph=True):
    """Time ``ours_fn`` (in a CUDA graph when ``graph``, else eager; eager always as well) and the torch
    eager reference ``torch_fn``; bandwidth and FLOP rates use the first time."""
    ours_eager_ms = median_ms(ours_fn)
    ours_ms = graph_ms(ours_fn) if graph else ours_eager_ms
    entry = dict(op=op, model=model, shape=shape, ours_us=ours_ms * 1e3, ours_eager_us=ours_eager_ms * 1e3,
                 timing="graph" if graph else "eager", torch_eager_us=median_ms(torch_fn) * 1e3)
    if nbytes is not None:
        entry["gbps"] = nbytes / ours_ms / 1e6
        entry["pct_copy"] = 100 * entry["gbps"] / copy
    if flops is not None:
        entry["tflops"] = flops / ours_ms / 1e9
    if baseline is not None:
        entry.update(baseline)
    results.append(entry)


def bench_elementwise(results, copy):
    eps = 1e-6
    for model, hidden in (("qwen3-8b", QWEN["hidden"]), ("dsv2-lite", DSV2["hidden"])):
        for tokens in (64, 4096):
            x, res, w = rand(tokens, hidden), rand(tokens, hidden), 1 + 0.1 * rand(hidden)
            out = torch.empty_like(x)
            nbytes = 2 * x.numel() * 2
            row(results, "rms_norm", model, f"T={tokens} H={hidden}", lambda: ours.rms_norm(out, x, w, eps),
                lambda: reference.rms_norm(out, x, w, eps), nbytes, copy=copy)
            row(results, "fused_add_rms_norm", model, f"T={tokens} H={hidden}",
                lambda: ours.fused_add_rms_norm(x, res, w, eps),
                lambda: reference.fused_add_rms_norm(x, res, w, eps), 2 * nbytes, copy=copy)
    inter = QWEN["intermediate"]
    for tokens in (64, 4096):
        x, out = rand(tokens, 2 * inter), torch.empty(tokens, inter, device="cuda", dtype=DTYPE)
        row(results, "silu_and_mul", "qwen3-8b", f"T={tokens} I={inter}", lambda: ours.silu_and_mul(out, x),
            lambda: reference.silu_and_mul(out, x), 3 * out.numel() * 2, copy=copy)


def bench_rotary_and_store(results, copy):
    hq, hk, d = QWEN["heads"], QWEN["kv_heads"], QWEN["head_dim"]
    cache, _ = get_cos_sin_cache(40960, d, 1e6, dtype=DTYPE, device="cuda")
    for tokens in (64, 4096):
        qkv = rand(tokens, (hq + 2 * hk) * d)
        q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
        v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
        pos = torch.randint(0, 40960, (tokens,), device="cuda")
        row(results, "rotary (neox)", "qwen3-8b", f"T={tokens}",
            lambda: ours.rotary_embedding(pos, q, k, d, cache, True),
            lambda: reference.rotary_embedding(pos, q, k, d, cache, True), 2 * (hq + hk) * d * tokens * 2,
            copy=copy)
        k_cache, v_cache = rand(tokens // 16 + 8, 16, hk, d), rand(tokens // 16 + 8, 16, hk, d)
        slots = torch.randperm(k_cache.shape[0] * 16, device="cuda")[:tokens]
        row(results, "store_kv_cache", "qwen3-8b", f"T={tokens}",
            lambda: ours.store_kv_cache(k, v, k_cache, v_cache, slots),
            lambda: reference.store_kv_cache(k, v, k_cache, v_cache, slots), 4 * hk * d * tokens * 2,
            copy=copy)
    scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    cache, _ = get_cos_sin_cache(163840, DSV2["rope"], 1e4, scaling, dtype=DTYPE, device="cuda")
    for tokens in (64, 4096):
        q = rand(tokens, DSV2["heads"], DSV2["nope"] + DSV2["rope"])
        latent = rand(tokens, 1, DSV2["kv_lora"] + DSV2["rope"])
        q_pe, k_pe = q[..., DSV2["nope"]:], latent[..., DSV2["kv_lora"]:]
        pos = torch.randint(0, 163840, (tokens,), device="cuda")
        row(results, "rotary (gptj yarn)", "dsv2-lite", f"T={tokens}",
            lambda: ours.rotary_embedding(pos, q_pe, k_pe, DSV2["rope"], cache, False),
            lambda: reference.rotary_embedding(pos, q_pe, k_pe, DSV2["rope"], cache, False),
            2 * (DSV2["heads"] + 1) * DSV2["rope"] * tokens * 2, copy=copy)


def paged_inputs(batch, context, block_size, kv_heads, head_dim, v_dim):
    blocks_per_seq = context // block_size
    k_cache = rand(batch * blocks_per_seq, block_size, kv_heads, head_dim)
    v_cache = None if v_dim is None else rand(batch * blocks_per_seq, block_size, kv_heads, v_dim)
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, lens


def bench_decode(results, copy):
    import torch.nn.functional as F

    hq, hk, d, ctx = QWEN["heads"], QWEN["kv_heads"], QWEN["head_dim"], 4096
    for batch in (1, 8, 64):
        q = rand(batch, hq, d)
        contiguous_k, contiguous_v = rand(batch, hk, ctx, d), rand(batch, hk, ctx, d)
        sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], contiguous_k, contiguous_v,
                                                                   enable_gqa=True))
        nbytes = 2 * batch * ctx * hk * d * 2
        for block_size in (16, 256):
            k_cache, v_cache, tables, lens = paged_inputs(batch, ctx, block_size, hk, d, d)
            args = (q, k_cache, v_cache, tables, lens, d ** -0.5)
            row(results, "paged_decode", "qwen3-8b", f"B={batch} ctx={ctx} bs={block_size}",
                lambda: ours.paged_decode_attention(*args),
                lambda: reference.paged_decode_attention(*args), nbytes, copy=copy,
                baseline={"sdpa_contiguous_us": sdpa_ms * 1e3})
            row(results, "paged_decode 1 launch", "qwen3-8b", f"B={batch} ctx={ctx} bs={block_size}",
                lambda: ours.paged_decode_attention(*args, fused_merge=True),
                lambda: reference.paged_decode_attention(*args), nbytes, copy=copy)
    width = DSV2["kv_lora"] + DSV2["rope"]
    for batch in (1, 8, 64):
        q = rand(batch, DSV2["heads"], width)
        for block_size in (16, 256):
            k_cache, _, tables, lens = paged_inputs(batch, ctx, block_size, 1, width, None)
            args = (q, k_cache, None, tables, lens, (DSV2["nope"] + DSV2["rope"]) ** -0.5, DSV2["kv_lora"])
            row(results, "paged_decode (MLA)", "dsv2-lite", f"B={batch} ctx={ctx} bs={block_size}",
                lambda: ours.paged_decode_attention(*args),
                lambda: reference.paged_decode_attention(*args), batch * ctx * width * 2, copy=copy)
            row(results, "paged_decode (MLA) 1 l.", "dsv2-lite", f"B={batch} ctx={ctx} bs={block_size}",
                lambda: ours.paged_decode_attention(*args, fused_merge=True),
                lambda: reference.paged_decode_attention(*args), batch * ctx * width * 2, copy=copy)


def bench_decode_fp8(results, copy):
    """Decode attention at the offline throughput's shape (Qwen3-8B, 256 sequences, 512 tokens of
    context, block size 16) over a bf16 and an e4m3 cache: the default launch and every key tile
    (``block_n``, ``num_stages``), over e4m3 with dots in fp16 and in bf16 (``fp16_dots``), as graph
    replays; the reference once per cache. Then the leading launches under a cap on registers per
    thread (``max_registers``) and with keys and values in column chunks (``chunks``; the rows without
    a count take the default's, so "default" is what a step runs): the e4m3
    128 x 3 launch holds 216 registers (two programs per SM), 149 in 2 chunks, 110 in 4; bf16's
    64 x 2 106, 75 in 4 (sm90 ptxas, compiled on a CPU)."""
    hq, hk, d, batch, ctx = QWEN["heads"], QWEN["kv_heads"], QWEN["head_dim"], 256, 512
    q = rand(batch, hq, d)
    k_cache, v_cache, tables, lens = paged_inputs(batch, ctx, 16, hk, d, d)
    for label, cache_dtype in (("bf16", DTYPE), ("e4m3", torch.float8_e4m3fn)):
        k, v = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        args = (q, k, v, tables, lens, d ** -0.5)
        nbytes = 2 * batch * ctx * hk * d * k.element_size()
        reference_us = median_ms(lambda: reference.paged_decode_attention(*args)) * 1e3
        tiles = ((None, None), (64, 2), (128, 2), (64, 3), (128, 3), (128, 4), (256, 2), (32, 4))
        swept = [(tile, f16, None, None) for tile, f16 in
                 itertools.product(tiles, (None, True, False) if label == "e4m3" else (None,))]
        if label == "bf16":  # (tile, fp16 dots, register cap, column chunks)
            varied = [((64, 2), None, 96, 1), ((64, 2), None, 80, 1), ((64, 2), None, None, 2),
                      ((64, 2), None, None, 4), ((64, 3), None, None, 4), ((128, 2), None, None, 4),
                      ((128, 3), None, None, 4), ((128, 3), None, 96, 4)]
        else:
            varied = [((128, 3), True, None, 1), ((128, 3), True, 168, 1), ((128, 3), True, 128, 1),
                      ((64, 3), True, 128, 1), ((64, 3), True, 96, 1), ((128, 3), True, None, 2),
                      ((128, 3), True, 128, 2), ((128, 4), True, 128, 2), ((128, 2), True, 128, 2),
                      ((64, 3), True, 96, 2), ((128, 3), True, None, 4), ((128, 3), True, 96, 4),
                      ((64, 3), True, 80, 4)]
        for (block_n, stages), f16, cap, chunks in swept + varied:
            knobs = dict(block_n=block_n, num_stages=stages, fp16_dots=f16, max_registers=cap, chunks=chunks)
            ms = graph_ms(lambda: ours.paged_decode_attention(*args, **knobs))
            tile = "default" if block_n is None else f"{block_n}x{stages}"
            dots = ({None: "", True: " f16 dots", False: " bf16 dots"}[f16] + (f" {cap} regs" if cap else "")
                    + (f" {chunks} chunk(s)" if chunks else ""))
            results.append(dict(op=f"paged_decode {label} cache", model="qwen3-8b",
                                shape=f"B={batch} ctx={ctx} tile={tile}{dots}", ours_us=ms * 1e3, timing="graph",
                                torch_eager_us=reference_us, gbps=nbytes / ms / 1e6,
                                pct_copy=100 * nbytes / ms / 1e6 / copy, **knobs))


def bench_gemv(results, copy):
    """The decode GEMV on Qwen3-8B's linears (down_proj with its SiLU-and-mul prologue) at 1, 4 and 8
    rows: every config as a graph replay, the best against cuBLAS (``F.linear``, after
    ``silu_and_mul`` for down_proj) in the same run; GB/s counts the weight bytes."""
    from engine.model.kernels.triton.gemv import CANDIDATES, FMA_MAX_ROWS, launch

    hidden, inter, heads, kv, d = (QWEN[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    shapes = {"qkv_proj": ((heads + 2 * kv) * d, hidden, None), "o_proj": (hidden, heads * d, None),
              "gate_up_proj": (2 * inter, hidden, None), "down_proj+silu_mul": (hidden, inter, "silu_mul"),
              "lm_head": (151936, hidden, None)}
    for name, (n_out, k_dim, act) in shapes.items():
        weight = rand(n_out, k_dim) * k_dim ** -0.5
        for rows in (1, 4, 8):
            x = rand(rows, 2 * k_dim if act else k_dim)
            times = {config: graph_ms(lambda: launch(x, weight, None, act, config)) for config in CANDIDATES
                     if not config.fma or rows <= FMA_MAX_ROWS}
            best = min(times, key=times.get)
            cublas_ms = graph_ms(lambda: reference.decode_gemv(x, weight, None, act))
            row(results, "decode_gemv", "qwen3-8b", f"{name} M={rows} N={n_out} K={k_dim}",
                lambda: launch(x, weight, None, act, best), lambda: reference.decode_gemv(x, weight, None, act),
                weight.numel() * 2, copy=copy,
                baseline={"best_config": list(best), "cublas_us": cublas_ms * 1e3,
                          "cublas_gbps": weight.numel() * 2 / cublas_ms / 1e6})


def bench_prefill(results):
    from engine.model.kernels.triton.prefill_attention import flash_varlen_attention

    tokens = 4096
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    for model, hq, hk, d, dv in (("qwen3-8b", QWEN["heads"], QWEN["kv_heads"], 128, 128),
                                 ("dsv2-lite", DSV2["heads"], DSV2["heads"], 192, 128)):
        q, k, v = rand(tokens, hq, d), rand(tokens, hk, d), rand(tokens, hk, dv)
        args = (q, k, v, cu, cu, tokens, tokens, d ** -0.5, True)
        flops = 2 * hq * tokens * tokens * (d + dv) / 2  # causal: half the score matrix
        baseline = {"triton_kernel_tflops": flops / median_ms(lambda: flash_varlen_attention(*args)) / 1e9}
        row(results, "varlen_prefill", model, f"T={tokens} {hq}q/{hk}kv d={d}/{dv} causal",
            lambda: ours.varlen_attention(*args), lambda: reference.varlen_attention(*args),
            flops=flops, baseline=baseline, graph=False)


def sdpa_peers(q, k, v, scale) -> dict:
    """ms of torch's dense SDPA on one causal sequence per backend that runs it (GQA through
    ``enable_gqa``, else K/V expanded outside the timing): the peers of the Triton prefill kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    peers = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for name, kk, vv, gqa in ((f"{backend.name.lower()}_gqa", kd, vd, True), (backend.name.lower(), ke, ve, False)):
            def call(kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qd, kk, vv, is_causal=True, scale=scale,
                                                                            enable_gqa=gqa)
            try:
                call()
                peers[name] = median_ms(call)
            except RuntimeError as error:
                peers[name] = f"refused: {str(error).splitlines()[0][:120]}"
    return peers


def bench_prefill_sweep(results):
    """The Triton prefill kernel at every launch shape of a grid (Qwen3-8B, one causal 4,096-token
    sequence) beside torch's dense SDPA backends on the same inputs: TFLOP/s each."""
    from engine.model.kernels.triton.prefill_attention import PrefillLaunch, default_launch, flash_varlen_attention

    tokens, hq, hk, d = 4096, QWEN["heads"], QWEN["kv_heads"], QWEN["head_dim"]
    q, k, v = rand(tokens, hq, d), rand(tokens, hk, d), rand(tokens, hk, d)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    flops = 2 * hq * tokens * tokens * 2 * d / 2
    launches = [PrefillLaunch(bm, bn, w, st) for bm, w in ((64, 4), (128, 4), (128, 8)) for bn in (32, 64, 128)
                for st in (2, 3, 4)]
    default = default_launch(d, d, q.element_size())
    sweep = []
    for launch in launches:
        try:
            ms = median_ms(lambda launch=launch: flash_varlen_attention(q, k, v, cu, cu, tokens, tokens, d ** -0.5,
                                                                         True, launch=launch))
        except Exception as error:  # out of shared memory or registers at this shape
            sweep.append({"launch": list(vars(launch).values()), "refused": str(error).splitlines()[0][:120]})
            continue
        sweep.append({"launch": list(vars(launch).values()), "ms": ms, "tflops": flops / ms / 1e9,
                      "default": launch == default})
    peers = {name: (flops / ms / 1e9 if isinstance(ms, float) else ms)
             for name, ms in sdpa_peers(q, k, v, d ** -0.5).items()}
    timed = [entry for entry in sweep if "ms" in entry]
    best = min(timed, key=lambda entry: entry["ms"])
    results.append(dict(op="prefill_sweep", model="qwen3-8b", shape=f"T={tokens} {hq}q/{hk}kv d={d} causal",
                        ours_us=best["ms"] * 1e3, ours_eager_us=best["ms"] * 1e3, torch_eager_us=float("nan"),
                        tflops=best["tflops"], best_config=best["launch"], sweep=sweep, sdpa_tflops=peers))
    for entry in sorted(timed, key=lambda entry: entry["ms"]):
        print(f"prefill launch {entry['launch']}: {entry['ms'] * 1e3:8.1f} us {entry['tflops']:6.1f} TFLOP/s"
              f"{'  (default)' if entry['default'] else ''}", file=sys.stderr)
    for name, value in peers.items():
        print(f"sdpa {name}: {value if isinstance(value, str) else f'{value:6.1f} TFLOP/s'}", file=sys.stderr)


SECTIONS = {"elementwise": bench_elementwise, "rotary": bench_rotary_and_store, "decode": bench_decode,
            "decode_fp8": bench_decode_fp8, "gemv": bench_gemv, "prefill": lambda results, copy: bench_prefill(results),
            "prefill_sweep": lambda results, copy: bench_prefill_sweep(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS),
                        help="run only these sections (prefill_sweep runs only when named)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    copy = copy_gbps()
    results: list[dict] = []
    for name in opts.only or [name for name in SECTIONS if name != "prefill_sweep"]:
        SECTIONS[name](results, copy)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "results": results}
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1))
    print(f"{report['device']}  torch {torch.__version__}  device-to-device copy {copy:.0f} GB/s")
    print("ours us: CUDA-graph replay (eager for varlen prefill); %copy from it; eager: Python launches")
    print(f"{'op':22} {'model':9} {'shape':44} {'ours us':>8} {'GB/s':>6} {'%copy':>6} {'TFLOP/s':>7} "
          f"{'eager us':>8} {'torch us':>9}  extra")
    for r in results:
        extra = {k: v if isinstance(v, list) else round(v, 1) for k, v in r.items()
                 if k in ("sdpa_contiguous_us", "triton_kernel_tflops", "cublas_us",
                          "cublas_gbps", "best_config")}
        print(f"{r['op']:22} {r['model']:9} {r['shape']:44} {r['ours_us']:8.1f} {r.get('gbps', float('nan')):6.0f} "
              f"{r.get('pct_copy', float('nan')):6.1f} {r.get('tflops', float('nan')):7.1f} "
              f"{r.get('ours_eager_us', float('nan')):8.1f} {r['torch_eager_us']:9.1f}  {extra or ''}")
    print(json.dumps({"copy_gbps": round(copy), "n_results": len(results)}))


if __name__ == "__main__":
    main()
