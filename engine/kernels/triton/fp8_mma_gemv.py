"""FP8 decode GEMV on the tensor cores: ``out = x W^T + bias`` for the few rows of a decode step
(``M <= fp8_gemv.MAX_ROWS``), the W8A8 function of ``engine.kernels.fp8.fp8_linear`` (contract
there), with the weight as the MMA's large side.

Why: ``fp8_gemv.py`` multiplies in float32 FMAs, converting every e4m3 weight first, and on the
H200 that tops out at 1-2 TB/s of weight bytes (instructions, not bandwidth); ``fp8.py``'s GEMM
puts the activation rows on the MMA's M side, so it pads them to 16 and quantizes all 16 at every
K step. Here each program multiplies its ``[BLOCK_N, 128]`` e4m3 weight tile by the transposed
``[16, 128]`` tile of quantized activations (``tl.dot(w, trans(xq))``: the weight rows are the
MMA's M, 64 or more, which sm90's wgmma takes straight from shared memory), so the weight's
bytes are never touched by the ALUs; only the ``ROWS`` real rows are quantized (each row's 128
values once per group, ``fp8_tiles.quantize_tile``) and put into the zero tile's rows.

Program (column block, split) walks its split's 128-column groups, one group per iteration,
pipelined ``num_stages`` deep: per group the fp8 product ``[BLOCK_N, 16]`` (float32
accumulation) is scaled by the weight scale of each weight row and the activation scale of each
row and added. The split-K partial sums are float32, merged by the last split of a column block
to arrive (``fp8_tiles.finish_split``: deterministic, no memset, CUDA-graph safe).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels import FP8_DTYPE
from engine.kernels.fp8 import GROUP, weight_block_rows
from engine.kernels.triton.fp8_gemv import MAX_ROWS
from engine.kernels.triton.fp8_tiles import finish_split, quantize_tile
from engine.kernels.triton.semaphores import zeroed_counters

TILE_ROWS = 16  # the MMA's N: the activation rows padded with zeros
_GROUP = tl.constexpr(GROUP)
_TILE_ROWS = tl.constexpr(TILE_ROWS)


class Fp8MmaGemvConfig(NamedTuple):
    """A launch shape: weight rows per program (64 or more: one wgmma's M), K splits (runs of
    whole 128-column groups), pipeline stages. Warps: 4 per 128 weight rows, at least 4. Three
    fields: never equal to a 4-field ``Fp8GemvConfig`` or a 5-field ``GemmConfig``."""
    block_n: int
    split_k: int
    num_stages: int

    @property
    def num_warps(self) -> int:
        return max(4, self.block_n // 32)


# Timed per shape at load among the other decode launches (``fp8.decode_plan``). On the H200 at one
# row (Qwen3-8B, weights from HBM, 2026-12-03) more splits won the short-K shapes (qkv, o: 8 splits of
# 4 groups; down: 16 of 6) and 64 x 2 splits with 4 stages the wide gate-up: 2.1-3.0 TB/s.
CANDIDATES = [Fp8MmaGemvConfig(block_n, split_k, stages) for block_n, split_k, stages in
              [(64, 1, 4), (64, 2, 4), (64, 4, 4), (64, 8, 3), (64, 8, 4), (64, 16, 3), (128, 2, 4), (128, 4, 3),
               (128, 8, 3), (128, 8, 4), (128, 16, 3), (128, 16, 4), (128, 32, 3)]]


def fits(rows: int) -> bool:
    """Whether the launch takes ``rows`` activation rows (at most ``fp8_gemv.MAX_ROWS``)."""
    return rows <= MAX_ROWS


@triton.jit
def _fp8_mma_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, M, N, K,
                         x_stride, w_stride, ws_stride, out_stride,
                         SCALE_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    block = tl.program_id(0)
    split = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: the output's columns
    col_ok = cols < N
    rows = tl.arange(0, _TILE_ROWS)
    in_group = tl.arange(0, _GROUP)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_stride
    ws_rows = ws_ptr + (cols // SCALE_BLOCK_N).to(tl.int64) * ws_stride
    split_len = tl.cdiv(tl.cdiv(K, SPLIT_K), _GROUP) * _GROUP  # whole groups: splits meet on 128 columns
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, K)
    acc = tl.zeros([BLOCK_N, _TILE_ROWS], tl.float32)
    for k0 in tl.range(k_start, k_end, _GROUP, num_stages=NUM_STAGES):
        ks = k0 + in_group
        k_ok = ks < k_end
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, 128]
        w_scale = tl.load(ws_rows + k0 // _GROUP, mask=col_ok, other=0.0)  # [BLOCK_N]
        xq = tl.zeros([_TILE_ROWS, _GROUP], w.dtype)
        x_scale = tl.zeros([_TILE_ROWS], tl.float32)
        for r in tl.static_range(ROWS):  # the real rows only; rows from M on stay zero
            x = tl.load(x_ptr + r * x_stride + ks, mask=k_ok & (r < M), other=0.0).to(tl.float32)
            row_q, row_scale = quantize_tile(x[None, :])  # [1, 128], [1]
            xq = tl.where(rows[:, None] == r, row_q, xq)
            x_scale = tl.where(rows == r, row_scale, x_scale)
        acc += tl.dot(w, tl.trans(xq)) * w_scale[:, None] * x_scale[None, :]
    out = tl.trans(acc)  # [16, BLOCK_N]: rows of the output
    out_mask = (rows < M)[:, None] & col_ok[None, :]
    finish_split(out, split, part_ptr + rows[:, None] * N + cols[None, :], M * N, counters_ptr + block, bias_ptr,
                 out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], cols, col_ok, out_mask, HAS_BIAS,
                 SPLIT_K)


def launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, config: Fp8MmaGemvConfig) -> None:
    """One launch writing ``out [M, N]`` (x's dtype) from ``x [M <= MAX_ROWS, K]`` (unit last
    stride, any row stride), e4m3 ``weight [N, K]`` (unit last stride), ``weight_scale`` (see
    ``fp8.weight_block_rows``) and ``bias [N]`` or None."""
    rows, (n, k) = x.shape[0], weight.shape
    if not fits(rows) or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 MMA GEMV: {rows} rows of {weight.dtype}; it takes at most {MAX_ROWS} rows of e4m3")
    blocks = triton.cdiv(n, config.block_n)
    part = out  # unused unless split: any pointer serves
    if config.split_k > 1:
        part = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    _fp8_mma_gemv_kernel[(blocks, config.split_k)](
        x, weight, weight_scale, bias if bias is not None else out, out, part, zeroed_counters(x.device, blocks),
        rows, n, k, x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        SCALE_BLOCK_N=weight_block_rows(weight, weight_scale), HAS_BIAS=bias is not None,
        ROWS=triton.next_power_of_2(rows), BLOCK_N=config.block_n, SPLIT_K=config.split_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps)
