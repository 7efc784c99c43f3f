"""Decode GEMV: ``out = act(x) @ weight.T + bias`` for the few rows of a decode step (M <= 16),
split-K in one launch.

Program (column block, split) reads a ``[BLOCK_N, K / SPLIT_K]`` slice of the weight once for
every row of x (rows padded to 16 for ``tl.dot``, which the weight stream leaves idle-bound), in
``BLOCK_K`` chunks, accumulating in float32. With ``SPLIT_K`` > 1 each split stores its partial
sums and the last split of a column block to arrive adds them up (``semaphores.arrive_last``).
``act = silu_mul`` reads x as gate | up halves and applies ``silu(gate) * up`` in the prologue
(rounded to the weight's dtype, as ``silu_and_mul`` then a GEMM would), so the activation
never goes through memory. The dot runs in the weight's dtype: bf16 on tensor cores, float32
exactly when either side is float32 (a bf16 x against a float32 router weight is upcast, never
rounded): the dtype promotion of the reference's ``F.linear``. Up to ``FMA_MAX_ROWS`` rows a
config may instead hold just the rows there are (``GemvConfig.fma``) and sum float32 FMAs along
K: no padding rows, no operand staging for the tensor cores. ``plan`` offers those for one row
only: on the H200 the FMA tile won Qwen3-8B's down_proj at one row (43.1 us against cuBLAS's
44.1) and lost it at four (88 us against 47).

Configs (``GemvConfig``) are chosen once per shape (``plan``): on CUDA by timing every candidate
and cuBLAS (``F.linear``) on that shape in this process, the first time the shape is seen
outside a CUDA-graph capture (the engine's warm-up and the capture's eager pass do it), never
per step; cuBLAS keeps the shape when it is faster.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.kernels import reference
from engine.model.kernels.triton.host_math import cdiv
from engine.model.kernels.triton.launcher import launch_kernel
from engine.model.kernels.triton.semaphores import arrive_last, zeroed_counters

MAX_ROWS = 16


FMA_MAX_ROWS = 4  # up to this many rows a tile may hold just the rows (``GemvConfig.fma``)


class GemvConfig(NamedTuple):
    """A launch shape: weight rows per program, columns per K step, K splits, warps; ``fma``: the
    tile holds ``next_pow2(M)`` rows (at most ``FMA_MAX_ROWS``) whose products are float32 FMAs
    summed along K, instead of 16 rows for ``tl.dot`` (at one row, 15 of them padding)."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    fma: bool = False


CANDIDATES = [GemvConfig(16, 256, 1, 4), GemvConfig(32, 256, 1, 4), GemvConfig(16, 512, 1, 4),
              GemvConfig(64, 128, 1, 4), GemvConfig(16, 256, 2, 4), GemvConfig(16, 256, 4, 4),
              GemvConfig(32, 128, 4, 4), GemvConfig(16, 128, 8, 4),
              GemvConfig(8, 512, 4, 4, True), GemvConfig(16, 256, 4, 4, True)]
DEFAULT = CANDIDATES[0]
CUBLAS = None  # a plan that keeps cuBLAS for its shape


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, M, N, K, x_stride, w_stride, out_stride,
                 SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, FMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_stride
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
    split_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * split_len
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + split_len, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x_mask = row_ok[:, None] & k_ok[None, :]
        if SILU_MUL:
            gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        if FMA:  # float32 products (exact for bf16 and float32 operands), summed along K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif DOT_FP32:  # either operand float32: exact float32 products (a bf16 x is upcast, never rounded)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
    out_offsets = rows[:, None] * out_stride + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        part_offsets = (split * BLOCK_M + rows[:, None]) * N + cols[None, :]
        tl.store(part_ptr + part_offsets, acc, mask=out_mask)
        if arrive_last(counters_ptr + block, SPLIT_K):
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + (s * BLOCK_M + rows[:, None]) * N + cols[None, :], mask=out_mask,
                               other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
           config: GemvConfig) -> torch.Tensor:
    """One launch of the GEMV with ``config`` (no plan consulted); a new ``[M, N]`` tensor."""
    rows, n_out, k_dim = x.shape[0], weight.shape[0], weight.shape[1]
    most = FMA_MAX_ROWS if config.fma else MAX_ROWS
    if rows > most:
        raise ValueError(f"decode_gemv: {rows} rows; {config} takes at most {most}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("decode_gemv: x and weight need a contiguous last dim")
    dtype = x.dtype if x.dtype == weight.dtype else torch.float32  # promotion among bf16 / fp16 / fp32
    out = torch.empty(rows, n_out, dtype=dtype, device=x.device)
    blocks = cdiv(n_out, config.block_n)
    block_m = triton.next_power_of_2(rows) if config.fma else MAX_ROWS
    part = out  # unused unless split: any pointer serves
    if config.split_k > 1:
        part = torch.empty(config.split_k, block_m, n_out, dtype=torch.float32, device=x.device)
    launch_kernel(_gemv_kernel, (blocks, config.split_k),
        x, weight, bias if bias is not None else weight, out, part, zeroed_counters(x.device, blocks),
        rows, n_out, k_dim, x.stride(0), weight.stride(0), out.stride(0),
        SILU_MUL=activation == "silu_mul", HAS_BIAS=bias is not None, DOT_FP32=dtype == torch.float32,
        FMA=config.fma, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=config.split_k, num_warps=config.num_warps)
    return out


def fastest(plans: dict, key, fallback, options):
    """The fastest choice for ``key``, kept in ``plans``: the first time a key is seen, every entry
    of ``options()`` (choice -> a call that runs it) is timed on CUDA in this process, as replays
    of a CUDA graph of repeated calls (how a decode step runs them: a Triton launch's host work,
    20-40 us of Python, would otherwise be timed instead of a 20 us kernel), and the quickest
    kept. Inside a CUDA-graph capture an unmeasured key gets ``fallback`` (nothing can be timed
    there). Shared by the decode GEMVs (this one, the FP8 GEMM's split-K configs and GEMV)."""
    if key not in plans:
        if torch.cuda.is_current_stream_capturing():
            return fallback
        from triton.testing import do_bench_cudagraph

        timings = {choice: do_bench_cudagraph(run, rep=3, return_mode="median") for choice, run in options().items()}
        plans[key] = min(timings, key=timings.get)
    return plans[key]


_PLANS: dict[tuple, GemvConfig | None] = {}


def plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """The config for this shape (or ``CUBLAS``), measured once per shape on CUDA (``fastest``);
    the default config elsewhere (the interpreter). Inside a CUDA-graph capture an unmeasured
    shape keeps cuBLAS."""
    if x.device.type != "cuda":
        return DEFAULT
    key = (x.device, x.shape[0], *weight.shape, x.dtype, weight.dtype, bias is not None, activation)
    return fastest(_PLANS, key, CUBLAS, lambda: {
        CUBLAS: lambda: reference.decode_gemv(x, weight, bias, activation),
        **{config: lambda config=config: launch(x, weight, bias, activation, config) for config in CANDIDATES
           if not config.fma or x.shape[0] == 1}})


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """See ``engine.model.kernels.decode_gemv``. ``config`` (None = ``plan``) forces one launch shape."""
    config = config or plan(x, weight, bias, activation)
    if config is CUBLAS:
        return reference.decode_gemv(x, weight, bias, activation)
    return launch(x, weight, bias, activation, config)
