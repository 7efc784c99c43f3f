"""FP8 decode GEMV: ``out = x W^T + bias`` for the few rows of a decode step (``M <=
MAX_ROWS``), W e4m3 with its block (or per-row) scales, x quantized per token group of 128 in
the kernel's prologue: the W8A8 function of ``engine.model.kernels.fp8.fp8_linear`` (contract there).

Why not the GEMM of ``fp8.py`` with one tile of rows: it pads the rows to 16 for ``tl.dot`` and
quantizes all 16 in every program at every K step, which at one row costs more instructions
than streaming the weight. Here the products are float32 FMAs and the weight's bytes are the
only large stream, read once.

Program (column block, split) reads its ``BLOCK_N`` weight rows over a run of whole 128-column
groups (its split), ``GROUPS`` groups per load: one ``[BLOCK_N, GROUPS, 128]`` tile, the whole
split with the default split count (``split_k`` 0: one chunk per split), so every program has
all its weight bytes in flight at once and no reduction or barrier stands between two loads of
a loop. Per row of x and group: the row's 128 activations are quantized
(``fp8_tiles.quantize_tile``: the scale is their max / 448, divided with round-to-nearest as the
reference does), multiplied by the e4m3 weights (both exact in float32), summed, and the sum
scaled by the activation scale of the row and the weight scale of the column block. With
``SPLIT_K`` > 1 each split stores its float32 partial sums and the last split of a column block
to arrive adds them in split order, then the bias (``semaphores.arrive_last``: deterministic,
no memset, CUDA-graph safe).

Routed experts of a few tokens (``expert_launch``): the same kernel with a third program axis,
one (token, expert) assignment per program, one split walking K, its expert's weights and scales
read in place (expert id from the device, -1 a zero row reading no weights): CUDA-graph safe,
no grouping.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.kernels.fp8 import GROUP, weight_block_rows
from engine.model.kernels.triton.fp8_tiles import finish_split, quantize_tile
from engine.model.kernels.triton.launcher import launch_kernel
from engine.model.kernels.triton.semaphores import zeroed_counters

MAX_ROWS = 8  # beyond, x's rows times the weight tile outgrow the tensor cores of the GEMM
_GROUP = tl.constexpr(GROUP)  # one activation group, one weight scale column


class Fp8GemvConfig(NamedTuple):
    """A launch shape of the GEMV: weight rows per program, K splits (runs of whole 128-column
    groups; 0: as many as chunks of ``groups`` groups cover K, one load per program), warps,
    128-column groups per load (a power of two). Four fields: never equal to a 5-field
    ``GemmConfig``."""
    block_n: int
    split_k: int
    num_warps: int
    groups: int


# Timed per shape against the GEMM's launch shapes (``fp8.decode_plan``), one chunk per split:
# 4-32 KiB of e4m3 weight per program. On the H200 at one row (Qwen3-8B, 2026-12-03) 8 KiB won
# (32 x 2 groups for qkv and o, 8 x 8 for gate-up and down) at 1.0-1.8 TB/s, every 8 KiB shape within
# 5 % of the others; the larger tiles are offered too.
CANDIDATES = [Fp8GemvConfig(block_n, 0, num_warps, groups) for block_n, num_warps, groups in
              [(16, 4, 2), (16, 4, 4), (32, 4, 2), (16, 8, 8), (32, 8, 4), (64, 8, 2), (8, 4, 8), (32, 8, 2),
               (16, 4, 8), (32, 4, 4), (8, 4, 16), (32, 8, 8), (64, 8, 4)]]
DEFAULT = Fp8GemvConfig(16, 0, 4, 2)  # without CUDA (the interpreter)
EXPERT_CONFIG = Fp8GemvConfig(32, 1, 4, 2)  # expert_launch: one program per assignment and 32 columns


def fits(config: Fp8GemvConfig, rows: int) -> bool:
    """Whether ``config`` takes ``rows`` rows: at most ``MAX_ROWS``, and a weight tile of at most
    128 values per thread (``block_n x groups x 128`` over its warps' threads)."""
    return rows <= MAX_ROWS and config.block_n * config.groups * GROUP <= 128 * 32 * config.num_warps


def split_count(config: Fp8GemvConfig, k: int) -> int:
    """The K splits ``config`` launches for ``k`` columns (see ``Fp8GemvConfig.split_k``)."""
    return config.split_k or triton.cdiv(triton.cdiv(k, GROUP), config.groups)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, ids_ptr, M, N, K,
                     experts_per_row, x_stride, w_stride_e, w_stride, ws_stride_e, ws_stride, out_stride,
                     SCALE_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUPS: tl.constexpr):
    block = tl.program_id(0)
    split = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if GATHER:  # program axis 2: one (token, expert) assignment, a row of x times its expert's weights
        assignment = tl.program_id(2).to(tl.int64)
        expert = tl.load(ids_ptr + assignment).to(tl.int64)
        col_ok = col_ok & (expert >= 0)  # id -1 (another rank's expert): a zero row, no weights read
        expert = tl.maximum(expert, 0)
        x_first, out_first = assignment // experts_per_row, assignment
    else:
        expert, x_first, out_first = 0, 0, 0
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    groups = tl.arange(0, GROUPS)
    in_group = tl.arange(0, _GROUP)
    w_rows = w_ptr + expert * w_stride_e + cols[:, None, None].to(tl.int64) * w_stride
    ws_rows = ws_ptr + expert * ws_stride_e + (cols // SCALE_BLOCK_N).to(tl.int64)[:, None] * ws_stride
    split_len = tl.cdiv(tl.cdiv(K, SPLIT_K), _GROUP) * _GROUP  # whole groups: splits meet on 128 columns
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_start, k_end, GROUPS * _GROUP):
        ks = k0 + groups[:, None] * _GROUP + in_group[None, :]  # [GROUPS, 128]
        k_ok = ks < k_end
        w = tl.load(w_rows + ks[None, :, :], mask=col_ok[:, None, None] & k_ok[None, :, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, GROUPS, 128]
        group_ok = k0 + groups * _GROUP < k_end
        scale_cols = groups + k0 // _GROUP
        w_scale = tl.load(ws_rows + scale_cols[None, :], mask=col_ok[:, None] & group_ok[None, :],
                          other=0.0)  # [BLOCK_N, GROUPS]
        for r in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + (x_first + r) * x_stride + ks, mask=k_ok & (r < M), other=0.0).to(tl.float32)
            xq, x_scale = quantize_tile(x)  # [GROUPS, 128], [GROUPS]
            sums = tl.sum(w * xq.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
            row_sum = tl.sum(sums * w_scale * x_scale[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(rows[:, None] == r, row_sum[None, :], 0.0)
    out_mask = row_ok[:, None] & (cols < N)[None, :]  # a -1 assignment's zeros are stored too
    out_ptrs = out_ptr + (out_first + rows[:, None]).to(tl.int64) * out_stride + cols[None, :]
    finish_split(acc, split, part_ptr + rows[:, None] * N + cols[None, :], BLOCK_M * N, counters_ptr + block,
                 bias_ptr, out_ptrs, cols, col_ok, out_mask, HAS_BIAS, SPLIT_K)  # GATHER: one split


def launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, config: Fp8GemvConfig) -> None:
    """One launch writing ``out [M, N]`` (x's dtype) from ``x [M <= MAX_ROWS, K]`` (unit last
    stride, any row stride), e4m3 ``weight [N, K]``, ``weight_scale`` (see
    ``fp8.weight_block_rows``) and ``bias [N]`` or None."""
    rows, (n, k) = x.shape[0], weight.shape
    if rows > MAX_ROWS:
        raise ValueError(f"fp8 decode GEMV: {rows} rows; it takes at most {MAX_ROWS}")
    block_m = triton.next_power_of_2(rows)
    blocks, split_k = triton.cdiv(n, config.block_n), split_count(config, k)
    part = out  # unused unless split: any pointer serves
    if split_k > 1:
        part = torch.empty(split_k, block_m, n, dtype=torch.float32, device=x.device)
    launch_kernel(_fp8_gemv_kernel, (blocks, split_k, 1),
        x, weight, weight_scale, bias if bias is not None else out, out, part, zeroed_counters(x.device, blocks),
        out, rows, n, k, 1, x.stride(0), 0, weight.stride(0), 0, weight_scale.stride(0),
        out.stride(0), SCALE_BLOCK_N=weight_block_rows(weight, weight_scale), HAS_BIAS=bias is not None,
        GATHER=False, BLOCK_M=block_m, BLOCK_N=config.block_n, SPLIT_K=split_k, GROUPS=config.groups,
        num_warps=config.num_warps)


def expert_launch(x: torch.Tensor, weights: torch.Tensor, weight_scales: torch.Tensor,
                  expert_ids: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = W[expert_ids[t, j]] @ x[t]`` (the contract of ``fp8.fp8_expert_linear``) for a
    few tokens: one program per (assignment, column block) reads its expert's weights in place
    (no grouping by expert, no padding of rows); a new ``[T, J, N]`` tensor in x's dtype."""
    tokens, per_token = expert_ids.shape
    n = weights.shape[1]
    out = torch.empty(tokens, per_token, n, dtype=x.dtype, device=x.device)
    config = EXPERT_CONFIG
    launch_kernel(_fp8_gemv_kernel, (triton.cdiv(n, config.block_n), 1, tokens * per_token),
        x, weights, weight_scales, out, out, out, out, expert_ids.contiguous(), 1, n, weights.shape[2], per_token,
        x.stride(0), weights.stride(0), weights.stride(1), weight_scales.stride(0), weight_scales.stride(1),
        out.stride(1), SCALE_BLOCK_N=weight_block_rows(weights, weight_scales), HAS_BIAS=False, GATHER=True,
        BLOCK_M=1, BLOCK_N=config.block_n, SPLIT_K=1, GROUPS=config.groups, num_warps=config.num_warps)
    return out
