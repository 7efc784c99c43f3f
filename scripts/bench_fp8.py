"""FP8 on the GPU: the GEMMs against bf16 cuBLAS, and FP8 against bf16 on the same random weights.

    python scripts/bench_fp8.py gemm [--preset qwen3-8b] [--json out.json]
    python scripts/bench_fp8.py gemv [--preset qwen3-8b] [--rows 1 8 32 128] [--sweep] [--json out.json]
    python scripts/bench_fp8.py agreement [--preset qwen3-8b] [--tokens 64] [--json out.json]

``gemm``: each decoder linear shape of the preset at M = 1, 8, 16, 256 and 4096 rows (``--rows``): bf16 cuBLAS
(``F.linear``), ``kernels.fp8.fp8_linear`` with the Triton kernels (``AGENT_INFER_FP8_GEMM=triton``) and with
``AGENT_INFER_FP8_GEMM=scaled_mm`` (cuBLAS block-wise scaling; null with the error where it
refuses the shape), microseconds per call (CUDA events around CUDA-graph replays, median of 20)
and TB/s of weight bytes at M = 1. Up to 16 rows also the launch shape the decode plan chose
(``fp8_triton_config``: the GEMM's ``GemmConfig`` or the GEMV's ``Fp8GemvConfig``), every
candidate's time (``fp8_candidates_us``) and the unsplit GEMM's (``fp8_unsplit_us``).

``gemv``: each decoder linear shape at a decode row count, timed as a decode step meets it: a CUDA
graph of one call per copy of the weight, enough copies to pass 400 MB (every call reads its
weight from HBM, none from L2; a single weight timed alone would be one launch's latency, and
repeated it would sit in the 50 MB L2): bf16 cuBLAS and every FP8 launch the plan times (up to 16
rows ``decode_plan``'s: the GEMM's split-K, the FMA GEMV's, the MMA GEMV's; 17-128 rows
``batch_plan``'s: the MMA GEMV's, ``scaled_mm``; beyond, the one launch the plan takes),
microseconds per call and TB/s of weight bytes, beside the launch the plan chose at load (timed
there on one weight, repeated). ``--sweep`` also times every Triton GEMM launch of ``SWEEP`` (tiles x
split-K x warps x stages) past 16 rows: where to look for better batch candidates.

``agreement``: the preset's random bf16 weights, as the bf16 model and online-quantized to FP8
(``quantization="fp8"``); greedy decode of the bf16 model from random prompts, then both models
teacher-forced over it: per prompt the first position where the FP8 argmax differs and the
bf16 model's top-1 minus top-2 logit there (a near-tie is a small gap), and the relative
logits error over all positions.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from engine import kernels  # noqa: E402
from engine.entrypoints.bench.floors import dense_linear_shapes, elapsed_ms  # noqa: E402
from engine.entrypoints.bench.models import PRESETS, random_checkpoint  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.kernels import fp8  # noqa: E402
from engine.model.kernels.triton import fp8 as triton_fp8  # noqa: E402
from engine.model.kernels.triton import fp8_mma_gemv  # noqa: E402
from engine.model.kernels.triton.fp8 import (  # noqa: E402
    GemmConfig,
    _batch_runs,
    _block_sizes,
    _decode_runs,
    decode_plan,
)
from engine.model.kernels.triton.gemv import MAX_ROWS  # noqa: E402

UNSPLIT = _block_sizes(1)  # the FP8 GEMM's launch shape before the decode split-K
BATCH_ROWS = 256           # gemv: the most rows timed (a decode batch of the offline throughput's 256 sequences)
SWEEP = [GemmConfig(block_m, block_n, split_k, warps, stages) for block_m in (64, 128) for block_n in (64, 128, 256)
         for split_k in (1, 2, 4) for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4))
         if warps == 8 or block_m * block_n < 128 * 256]


def graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (20 replays)."""
    return elapsed_ms(fn, 20, torch.device("cuda")) * 1000


def bench_gemm(preset: dict, row_counts: list[int]) -> list[dict]:
    rows = []
    layer, _ = dense_linear_shapes(preset)
    for n, k in layer:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scales = fp8.quantize_weight(weight)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "m": m, "bf16_us": graph_us(lambda: F.linear(x, weight))}
            for gemm in ("triton", "scaled_mm"):
                try:
                    with kernels.using(fp8_gemm=gemm):
                        row[f"fp8_{gemm}_us"] = graph_us(lambda: fp8.fp8_linear(x, q, scales))
                except (RuntimeError, ValueError) as error:  # scaled_mm refuses some shapes (M = 1 on torch 2.11)
                    row[f"fp8_{gemm}_us"], row[f"fp8_{gemm}_error"] = None, str(error).splitlines()[0]
            if m <= MAX_ROWS:  # the launch shape the decode plan measured for this shape
                plan = decode_plan(x, q, scales, None)
                row["fp8_triton_config"] = {"kernel": type(plan).__name__, **plan._asdict()}
                row["fp8_candidates_us"] = {f"{type(config).__name__}{tuple(config)}": graph_us(run)
                                            for config, run in _decode_runs(x, q, scales, None).items()}
                row["fp8_unsplit_us"] = graph_us(lambda: triton_fp8.fp8_linear(x, q, scales, config=UNSPLIT))
            if m == 1:
                row.update({f"{kind}_tb_s": bytes_ / row[f"{kind}_us"] / 1e6 for kind, bytes_ in
                            (("bf16", 2 * n * k), ("fp8_triton", n * k), ("fp8_scaled_mm", n * k))
                            if row[f"{kind}_us"]})
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def step_like_us(calls) -> float:
    """Microseconds per call of ``calls`` (one per weight copy) replayed in one CUDA graph."""
    return elapsed_ms(lambda: [call() for call in calls], 10, torch.device("cuda")) * 1000 / len(calls)


def name_of(config) -> str:
    """A launch choice as text: the config's class and fields, or ``scaled_mm``."""
    return config if isinstance(config, str) else f"{type(config).__name__}{tuple(config)}"


def bench_gemv(preset: dict, row_counts: list[int], sweep: bool) -> list[dict]:
    rows = []
    layer, _ = dense_linear_shapes(preset)
    for n, k in layer:
        copies = -(-400_000_000 // (n * k))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        quantized = [fp8.quantize_weight(w) for w in weights]
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "m": m, "copies": copies,
                   "bf16_us": step_like_us([lambda w=w: F.linear(x, w) for w in weights])}
            chosen = triton_fp8.plan(x, *quantized[0], None)
            runs = (_decode_runs(x, *quantized[0], None) if m <= MAX_ROWS else _batch_runs(x, *quantized[0], None)
                    if m <= fp8_mma_gemv.MAX_ROWS else [chosen])  # past batch_plan's rows: the plan's one launch
            row["plan"] = name_of(chosen)
            times = {}
            for config in [*runs, *(SWEEP if sweep and m > MAX_ROWS else [])]:
                calls = [lambda q=q, s=s, config=config: triton_fp8.fp8_linear(x, q, s, config=config)
                         for q, s in quantized]
                try:
                    times[name_of(config)] = step_like_us(calls)
                except RuntimeError as error:  # a sweep's launch that does not fit (shared memory, registers)
                    print(f"{name_of(config)} at {m} x {n} x {k}: {str(error).splitlines()[0]}", file=sys.stderr)
            best = min(times, key=times.get)
            row.update(fp8_plan_us=times[row["plan"]], fp8_best=best, fp8_best_us=times[best], fp8_us=times)
            row.update(bf16_tb_s=2 * n * k / row["bf16_us"] / 1e6, fp8_best_tb_s=n * k / times[best] / 1e6,
                       fp8_plan_tb_s=n * k / times[row["plan"]] / 1e6)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        del weights, quantized
    return rows


def build(preset: dict, quantization: str | None):
    from engine.model.models.registry import build_model
    from engine.model.weight_loading import load_weights

    model = build_model(ModelConfig.from_dict(preset, quantization), "cuda", torch.bfloat16)
    load_weights(model, random_checkpoint(preset, 0, torch.device("cuda"), torch.bfloat16), progress=False)
    return model.eval()


def logits_of(model, sequence: torch.Tensor) -> torch.Tensor:
    from engine.worker.kv_cache import bind_kv_cache
    from phases.harness import all_logits_step, num_blocks_for, run_paged

    bind_kv_cache(model, num_blocks_for([len(sequence)], 16), 16, torch.bfloat16, "cuda")
    with torch.no_grad():
        return run_paged(all_logits_step(model), [sequence], [len(sequence)], 16)[0].float()


def bench_agreement(preset: dict, prompts: int, prompt_len: int, tokens: int) -> dict:
    bf16, quantized = build(preset, None), build(preset, "fp8")
    gen = torch.Generator().manual_seed(0)
    results, errors = [], []
    for _ in range(prompts):
        sequence = torch.randint(0, preset["vocab_size"], (prompt_len,), generator=gen).cuda()
        for _ in range(tokens):  # bf16 greedy (one prefill per token: simple, not fast)
            sequence = torch.cat([sequence, logits_of(bf16, sequence)[-1].argmax().view(1)])
        ref, got = logits_of(bf16, sequence)[prompt_len - 1:-1], logits_of(quantized, sequence)[prompt_len - 1:-1]
        differ = (ref.argmax(-1) != got.argmax(-1)).nonzero().flatten().tolist()
        first = differ[0] if differ else None
        gap = None if first is None else float(ref[first].topk(2).values.diff().abs())
        results.append({"first_divergence": first, "bf16_top2_gap_there": gap, "positions_differing": len(differ)})
        errors.append(float((got - ref).norm() / ref.norm()))
    return {"tokens": tokens, "prompts": results, "relative_logits_error": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["gemm", "gemv", "agreement"])
    parser.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 256, 4096],
                        help="gemm, gemv: the row counts (M) to time (gemv: at most 256)")
    parser.add_argument("--sweep", action="store_true", help="gemv: also time the Triton GEMM's SWEEP past 16 rows")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    report = {"preset": args.preset, "device": torch.cuda.get_device_name()}
    if args.what == "gemm":
        report["gemm"] = bench_gemm(preset, args.rows)
    elif args.what == "gemv":
        report["gemv"] = bench_gemv(preset, [m for m in args.rows if m <= BATCH_ROWS], args.sweep)
    else:
        report["agreement"] = bench_agreement(preset, args.prompts, args.prompt_len, args.tokens)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
