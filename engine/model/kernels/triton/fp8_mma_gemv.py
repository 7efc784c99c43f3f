"""FP8 GEMM with the weight as the MMA's large side ("swap AB"): ``out = x W^T + bias`` for the
rows of a decode step or a small batch (``M <= MAX_ROWS``, 128), the W8A8 function of
``engine.model.kernels.fp8.fp8_linear`` (contract there).

Why: ``fp8_gemv.py`` multiplies in float32 FMAs, converting every e4m3 weight first, and on the
H200 that tops out at 1-2 TB/s of weight bytes (instructions, not bandwidth); ``fp8.py``'s GEMM
puts the activation rows on the MMA's M side, so it pads them to 16 and quantizes all 16 at every
K step; cuBLAS's block-scaled GEMM (``scaled_mm``) tiles the output 128 x 128 without splitting K,
so at 32-128 rows Qwen3-8B's linears leave most of the 132 SMs idle (0.7-1.8 x bf16's time).
Here each program multiplies its ``[BLOCK_N, 128]`` e4m3 weight tile by the transposed
``[TILE_ROWS, 128]`` tile of quantized activations (``tl.dot(w, trans(xq))``: the weight rows are
the MMA's M, 64 or more, which sm90's wgmma takes straight from shared memory), so the weight's
bytes are never touched by the ALUs. Up to ``QUANTIZE_MAX_ROWS`` rows the kernel quantizes the real
rows itself (each row's 128 values once per group, ``fp8_tiles.quantize_tile``) into a zero
16-row tile: one launch; beyond, ``fp8_linear`` quantizes them first (``quantize_per_token_group``,
the same function) and the kernel loads all the rows, zero-padded to a power of two, and their
scales. On the H200 (``scripts/bench_fp8.py gemv``, weights from HBM) a 32-row tile read gate-up's
weight at 3.1 TB/s (32 us against bf16's 57 and cuBLAS FP8's 41); at 128 rows it won 2 of
Qwen3-8B's 4 linears, at 256 none (1.1-1.8 x cuBLAS's time), so ``MAX_ROWS`` is 128.

Program (column block, split) walks its split's 128-column groups, one group per iteration,
pipelined ``num_stages`` deep: per group the fp8 product ``[BLOCK_N, TILE_ROWS]`` (float32
accumulation) is scaled by the weight scale of each weight row and the activation scale of each
row and added. The split-K partial sums are float32, merged by the last split of a column block
to arrive (``fp8_tiles.finish_split``: deterministic, no memset, CUDA-graph safe).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.kernels import FP8_DTYPE
from engine.model.kernels.fp8 import GROUP, weight_block_rows
from engine.model.kernels.triton import fp8_gemv
from engine.model.kernels.triton.fp8_tiles import finish_split, quantize_tile
from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel
from engine.model.kernels.triton.semaphores import zeroed_counters

QUANTIZE_MAX_ROWS = fp8_gemv.MAX_ROWS  # up to this many rows the kernel quantizes them itself
MAX_ROWS = 128  # the rows a launch takes, all in one tile: the MMA's N (zero-padded to a power of two >= 16)
_GROUP = tl.constexpr(GROUP)


class Fp8MmaGemvConfig(NamedTuple):
    """A launch shape: weight rows per program (64 or more: one wgmma's M), K splits (runs of
    whole 128-column groups), pipeline stages. Three fields: never equal to a 4-field
    ``Fp8GemvConfig`` or a 5-field ``GemmConfig``."""
    block_n: int
    split_k: int
    num_stages: int


# Timed per shape at load among the other launches (``fp8.decode_plan`` up to ``gemv.MAX_ROWS`` rows,
# ``fp8.batch_plan`` beyond). On the H200 at one row (Qwen3-8B, weights from HBM, 2026-12-03) more splits
# won the short-K shapes (qkv, o: 8 splits of 4 groups; down: 16 of 6) and 64 x 2 splits with 4 stages the
# wide gate-up: 2.1-3.0 TB/s.
CANDIDATES = [Fp8MmaGemvConfig(block_n, split_k, stages) for block_n, split_k, stages in
              [(64, 1, 4), (64, 2, 4), (64, 4, 4), (64, 8, 3), (64, 8, 4), (64, 16, 3), (128, 2, 4), (128, 4, 3),
               (128, 8, 3), (128, 8, 4), (128, 16, 3), (128, 16, 4), (128, 32, 3)]]
# Beyond gemv.MAX_ROWS rows (batches of 17-128 decoding sequences): the winners on the H200 at 32-128 rows
# (Qwen3-8B's linears, 2026-12-04) among 7 shapes, where 128-row weight tiles and 8 splits never won.
BATCH_CANDIDATES = [Fp8MmaGemvConfig(block_n, split_k, stages) for block_n, split_k, stages in
                    [(64, 1, 4), (64, 2, 4), (64, 4, 3)]]


def tile_rows(rows: int) -> int:
    """The activation rows of the tile for a launch over ``rows`` rows (zero-padded)."""
    return max(16, next_power_of_2(rows))


def num_warps(config: Fp8MmaGemvConfig, rows: int) -> int:
    """4 per 128 weight rows and 1 per 2,048 accumulators (64 float32 registers a thread), at least 4."""
    return max(4, config.block_n // 32, config.block_n * tile_rows(rows) // 2048)


@triton.jit
def _fp8_mma_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, M, N, K,
                         x_stride, xs_stride, w_stride, ws_stride, out_stride,
                         SCALE_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                         TILE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """``ROWS`` > 0: x holds that many raw rows (one tile), quantized here; 0: x holds e4m3 rows and
    ``xs`` their scales ``[M, K / 128]``."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: the output's columns
    col_ok = cols < N
    rows = tl.arange(0, TILE_ROWS)
    row_ok = rows < M
    in_group = tl.arange(0, _GROUP)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_stride
    ws_rows = ws_ptr + (cols // SCALE_BLOCK_N).to(tl.int64) * ws_stride
    split_len = tl.cdiv(tl.cdiv(K, SPLIT_K), _GROUP) * _GROUP  # whole groups: splits meet on 128 columns
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, K)
    acc = tl.zeros([BLOCK_N, TILE_ROWS], tl.float32)
    for k0 in tl.range(k_start, k_end, _GROUP, num_stages=NUM_STAGES):
        ks = k0 + in_group
        k_ok = ks < k_end
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, 128]
        w_scale = tl.load(ws_rows + k0 // _GROUP, mask=col_ok, other=0.0)  # [BLOCK_N]
        if ROWS == 0:
            xq = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_scale = tl.load(xs_ptr + rows.to(tl.int64) * xs_stride + k0 // _GROUP, mask=row_ok, other=0.0)
        else:
            xq = tl.zeros([TILE_ROWS, _GROUP], w.dtype)
            x_scale = tl.zeros([TILE_ROWS], tl.float32)
            for r in tl.static_range(ROWS):  # the real rows only; rows from M on stay zero
                x = tl.load(x_ptr + r * x_stride + ks, mask=k_ok & (r < M), other=0.0).to(tl.float32)
                row_q, row_scale = quantize_tile(x[None, :])  # [1, 128], [1]
                xq = tl.where(rows[:, None] == r, row_q, xq)
                x_scale = tl.where(rows == r, row_scale, x_scale)
        acc += tl.dot(w, tl.trans(xq)) * w_scale[:, None] * x_scale[None, :]
    out = tl.trans(acc)  # [TILE_ROWS, BLOCK_N]: rows of the output
    out_mask = row_ok[:, None] & col_ok[None, :]
    finish_split(out, split, part_ptr + rows[:, None] * N + cols[None, :], M * N, counters_ptr + block, bias_ptr,
                 out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], cols, col_ok, out_mask, HAS_BIAS,
                 SPLIT_K)


def launch(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, config: Fp8MmaGemvConfig) -> None:
    """One launch writing ``out [M, N]`` (the output dtype) from ``x [M <= MAX_ROWS, K]`` (unit last
    stride, any row stride): raw rows (``x_scale`` None, at most ``QUANTIZE_MAX_ROWS``) or e4m3
    rows with their float32 scales ``x_scale [M, K / 128]`` (``quantize_per_token_group``); e4m3
    ``weight [N, K]`` (unit last stride), ``weight_scale`` (see ``fp8.weight_block_rows``) and
    ``bias [N]`` or None."""
    rows, (n, k) = x.shape[0], weight.shape
    raw_limit = QUANTIZE_MAX_ROWS if x_scale is None else MAX_ROWS
    if rows > raw_limit or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 MMA GEMV: {rows} rows (quantized: {x_scale is not None}) of {weight.dtype}; it takes "
                         f"at most {raw_limit} rows and an e4m3 weight")
    blocks = cdiv(n, config.block_n)
    part = out  # unused unless split: any pointer serves
    if config.split_k > 1:
        part = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    launch_kernel(_fp8_mma_gemv_kernel, (blocks, config.split_k),
        x, x if x_scale is None else x_scale, weight, weight_scale, bias if bias is not None else out, out, part,
        zeroed_counters(x.device, blocks), rows, n, k, x.stride(0),
        0 if x_scale is None else x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        SCALE_BLOCK_N=weight_block_rows(weight, weight_scale), HAS_BIAS=bias is not None,
        ROWS=0 if x_scale is not None else next_power_of_2(rows), TILE_ROWS=tile_rows(rows), BLOCK_N=config.block_n,
        SPLIT_K=config.split_k, NUM_STAGES=config.num_stages, num_warps=num_warps(config, rows))
