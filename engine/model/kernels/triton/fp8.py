"""FP8 W8A8 kernels (see ``engine.model.kernels.fp8`` for the contract): per-token-group activation
quantization, and one block-scaled GEMM that serves the linear layers and the routed experts.

The GEMM's K loop steps by 128, so each K-tile is exactly one activation group and one
weight scale column: the tile's fp8 product (``tl.dot``, float32 accumulation) is scaled
by the rows' activation scales and the columns' weight scales before it is added. The
activations come quantized (``quantize_per_token_group``, large M) or are quantized in the
GEMM itself, one K-tile at a time (small M, where the weights' bytes dominate: one launch).

Decode (up to ``gemv.MAX_ROWS`` rows): one 16-row tile would leave only N / BLOCK_N programs, each
looping over all of K, so the K loop is split too (``SPLIT_K`` runs of whole 128-column groups,
one launch): each program stores its float32 partial sums and the last split of a column block
to arrive adds them in split order, then the bias (``semaphores.arrive_last``: deterministic, no
memset, graph-safe). The FP8 GEMVs are candidates too: up to ``fp8_gemv.MAX_ROWS`` rows
``fp8_gemv.py`` (FMAs over a tile of just the rows there are, no padding to 16), at every row
count ``fp8_mma_gemv.py`` (the weight as the MMA's large side; up to 8 rows only the real rows
quantized, in the kernel; beyond, quantized first). The launch is timed once per shape on CUDA
among ``DECODE_CANDIDATES`` (the unsplit GEMM included) and the GEMVs' (``decode_plan``,
``gemv.fastest``).

Experts: up to ``fp8_gemv.MAX_ROWS`` tokens the GEMV takes them, one program per assignment reading
its expert in place; beyond, assignments are grouped by expert on the device into tiles of ``BLOCK_M`` rows
(each expert's rows padded to a whole tile; ``_group_by_expert``), so a program reads one
expert's weights for its tile; tiles past the last used one return at once. Launch shapes
come from host shapes only: no host sync, CUDA-graph safe.

Batches of 17-128 rows (``batch_plan``): the MMA GEMV over all the rows (``fp8_mma_gemv.BATCH_CANDIDATES``,
activations quantized first) and, on sm90 with 128 x 128 weight blocks, ``torch.nn.functional.scaled_mm``
(cuBLAS block-wise scaling, FP8 wgmma) are timed once per shape and row count, the fastest kept: on the
H200 (``scripts/bench_fp8.py gemv``, Qwen3-8B linears, weights from HBM) cuBLAS took 0.7-1.8 of bf16's
time at 32-64 rows and the MMA GEMV 0.56-1.3, faster than cuBLAS at all 8 (shape, rows) and than bf16
at 6; the Triton GEMM's one tile per 64 rows took 4-20 times bf16's. Beyond 128 rows on sm90
everything goes through ``scaled_mm`` after ``quantize_per_token_group`` (0.76-1.3 of bf16's time at
256 rows, 0.65-0.77 at 4,096, where the Triton GEMM took 1.3); elsewhere the Triton GEMM.
``AGENT_INFER_FP8_GEMM`` (``KernelSettings.fp8_gemm``): ``triton`` keeps the Triton kernels at every row
count, ``scaled_mm`` takes cuBLAS wherever it fits (any row count it accepts, any GPU it runs on).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.kernels.fp8 import FP8_DTYPE, GROUP, weight_block_rows
from engine.model.kernels.settings import current
from engine.model.kernels.triton import fp8_gemv, fp8_mma_gemv
from engine.model.kernels.triton.fp8_tiles import finish_split, quantize_tile
from engine.model.kernels.triton.gemv import MAX_ROWS, fastest
from engine.model.kernels.triton.launcher import launch_kernel
from engine.model.kernels.triton.semaphores import zeroed_counters

FUSED_QUANT_MAX_ROWS = 64           # up to this many rows the GEMM quantizes its own activations
SCALED_MM = "scaled_mm"             # a plan's choice: cuBLAS block-wise scaling (_scaled_mm_linear)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, m, k, x_stride, q_stride, s_stride,
                     BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < m)[:, None] & (cols < k)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_tile(x)
    tl.store(q_ptr + rows64[:, None] * q_stride + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * s_stride + group, scale, mask=rows < m)


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    block_rows = 16
    launch_kernel(_quantize_kernel, (triton.cdiv(m, block_rows), scales.shape[1]),
        x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0), BLOCK_ROWS=block_rows, BLOCK_K=GROUP)
    return q, scales


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, rows_ptr,
                     tile_expert_ptr, m, n, k, experts_per_row, num_experts,
                     a_stride, a_scale_stride, w_stride_e, w_stride_n, ws_stride_e, ws_stride_n, out_stride,
                     SCALE_BLOCK_N: tl.constexpr, QUANTIZE_A: tl.constexpr, GATHER: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER:  # a tile of one expert's assignments (-1: padding); a row of a is assignment // J
        expert = tl.load(tile_expert_ptr + tl.program_id(0)).to(tl.int64)
        if expert >= num_experts:
            return
        out_rows = tl.load(rows_ptr + offs).to(tl.int64)
        row_ok = out_rows >= 0
        a_rows = tl.maximum(out_rows, 0) // experts_per_row
    else:
        expert = 0
        out_rows = offs.to(tl.int64)
        row_ok = offs < m
        a_rows = out_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_rows = w_ptr + expert * w_stride_e + cols[:, None].to(tl.int64) * w_stride_n
    w_scale_rows = w_scale_ptr + expert * ws_stride_e + (cols // SCALE_BLOCK_N).to(tl.int64) * ws_stride_n
    split = tl.program_id(2)
    split_len = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K  # whole groups: splits meet on 128 columns
    k_start = split * split_len
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + split_len, k), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if QUANTIZE_A:
            a, a_scale = quantize_tile(a.to(tl.float32))
        else:
            a_scale = tl.load(a_scale_ptr + a_rows * a_scale_stride + k0 // BLOCK_K, mask=row_ok, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_scale = tl.load(w_scale_rows + k0 // BLOCK_K, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    # split (rows of a, not gathered): partials [SPLIT_K, m, n], the last split adds them in order
    finish_split(acc, split, part_ptr + out_rows[:, None] * n + cols[None, :], m * n,
                 counters_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), bias_ptr,
                 out_ptr + out_rows[:, None] * out_stride + cols[None, :], cols, col_ok, out_mask, HAS_BIAS, SPLIT_K)


class GemmConfig(NamedTuple):
    """A launch shape: rows per tile, columns per program, K splits (each a run of whole 128-column
    groups; > 1 only for plain rows), warps, pipeline stages."""
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


def _block_sizes(rows: int) -> GemmConfig:
    """The unsplit GEMM's launch shape for tiles of up to ``rows`` rows."""
    if rows <= 16:
        return GemmConfig(16, 64, 1, 4, 4)
    if rows <= 64:
        return GemmConfig(64, 64, 1, 4, 3)
    return GemmConfig(128, 128, 1, 8, 3)


# Up to gemv.MAX_ROWS rows (decode): one 16-row tile, the weight streamed by N / BLOCK_N * SPLIT_K
# programs; the unsplit shape (_block_sizes) is a candidate too. Timed per shape (decode_plan). On the
# H200 the widest tiles won every Qwen3-8B linear at one row (128 columns, 8 splits; 2026-12-03).
DECODE_CANDIDATES = [_block_sizes(1)] + [GemmConfig(16, block_n, split_k, warps, 3) for block_n, split_k, warps in
                                         [(32, 4, 4), (64, 4, 4), (32, 8, 4), (64, 8, 4), (128, 4, 4), (128, 8, 4),
                                          (128, 16, 4), (64, 16, 4), (256, 4, 8), (256, 8, 8)]]
DECODE_DEFAULT = GemmConfig(16, 32, 2, 4, 3)  # without CUDA (the interpreter), past the GEMV's rows: split
DecodeConfig = GemmConfig | fp8_gemv.Fp8GemvConfig | fp8_mma_gemv.Fp8MmaGemvConfig
_DECODE_PLANS: dict[tuple, DecodeConfig] = {}


def decode_plan(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> DecodeConfig:
    """The launch for ``a [M <= gemv.MAX_ROWS, K]`` against this weight: on CUDA the fastest of
    ``DECODE_CANDIDATES``, of the FMA GEMV's (``fp8_gemv.CANDIDATES`` whose tile fits M rows) and
    of the MMA GEMV's (``fp8_mma_gemv.CANDIDATES``, up to its rows) on this shape, timed once per
    shape (``gemv.fastest``; inside a capture an unmeasured shape keeps the unsplit GEMM);
    elsewhere (the interpreter) the FMA GEMV's default up to its rows, ``DECODE_DEFAULT`` beyond."""
    rows = a.shape[0]
    if a.device.type != "cuda":
        return fp8_gemv.DEFAULT if rows <= fp8_gemv.MAX_ROWS else DECODE_DEFAULT
    key = (a.device, rows, *weight.shape, weight_scale.shape[0], a.dtype, bias is not None)
    return fastest(_DECODE_PLANS, key, _block_sizes(rows), lambda: _decode_runs(a, weight, weight_scale, bias))


def _decode_runs(a, weight, weight_scale, bias) -> dict:
    """Every decode candidate that fits ``a``'s rows -> a call running ``fp8_linear`` with it."""
    gemvs = [config for config in fp8_gemv.CANDIDATES if fp8_gemv.fits(config, a.shape[0])]
    return {config: lambda config=config: fp8_linear(a, weight, weight_scale, bias, config)
            for config in DECODE_CANDIDATES + gemvs + fp8_mma_gemv.CANDIDATES}


_BATCH_PLANS: dict[tuple, DecodeConfig | str] = {}


def batch_plan(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> DecodeConfig | str:
    """The launch for ``a [gemv.MAX_ROWS < M <= fp8_mma_gemv.MAX_ROWS, K]`` on CUDA: the fastest of
    ``_batch_runs``, timed once per shape and row count (``gemv.fastest``; inside a capture an
    unmeasured shape keeps ``_cublas_or_gemm``)."""
    other = _cublas_or_gemm(a, weight, weight_scale)
    key = (a.device, a.shape[0], *weight.shape, weight_scale.shape[0], a.dtype, bias is not None, other)
    return fastest(_BATCH_PLANS, key, other, lambda: _batch_runs(a, weight, weight_scale, bias))


def _cublas_or_gemm(a, weight, weight_scale) -> GemmConfig | str:
    """``SCALED_MM`` for ``a`` where ``_scaled_mm_unforced``, else the unsplit GEMM: the launch beyond
    the MMA GEMV's rows, and the one timed against it within them."""
    return SCALED_MM if _scaled_mm_unforced(a, weight, weight_scale) else _block_sizes(a.shape[0])


def _batch_runs(a, weight, weight_scale, bias) -> dict:
    """``batch_plan``'s candidates for ``a``'s rows -> a call running ``fp8_linear`` with each:
    ``fp8_mma_gemv.BATCH_CANDIDATES`` and ``_cublas_or_gemm``'s."""
    return {choice: lambda choice=choice: fp8_linear(a, weight, weight_scale, bias, choice)
            for choice in fp8_mma_gemv.BATCH_CANDIDATES + [_cublas_or_gemm(a, weight, weight_scale)]}


def plan(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         bias: torch.Tensor | None) -> DecodeConfig | str:
    """The launch ``fp8_linear`` runs for ``a [M, K]`` (see the module's docstring):
    ``KernelSettings.fp8_gemm``'s choice when set; up to ``gemv.MAX_ROWS`` rows ``decode_plan``; up
    to ``fp8_mma_gemv.MAX_ROWS`` on CUDA ``batch_plan``; beyond, ``SCALED_MM`` on sm90 where it takes
    the shape, else the GEMM."""
    choice = current().fp8_gemm
    if choice == "scaled_mm" and _scaled_mm_takes(a, weight, weight_scale):
        return SCALED_MM
    rows = a.shape[0]
    if rows <= MAX_ROWS:  # a decode step's: no more host work than the plan's lookup
        return decode_plan(a, weight, weight_scale, bias)
    if rows <= fp8_mma_gemv.MAX_ROWS and a.device.type == "cuda":
        return batch_plan(a, weight, weight_scale, bias)
    return _cublas_or_gemm(a, weight, weight_scale)


def _launch(a, a_scale, w, w_scale, bias, out, m, tiles, config, rows=None, tile_expert=None, experts_per_row=1):
    """One GEMM launch over ``tiles`` tiles of ``config.block_m`` rows (gathered when ``rows`` is
    given; split-K only when not)."""
    if w.dim() == 2:
        w, w_scale = w.unsqueeze(0), w_scale.unsqueeze(0)
    n = w.shape[1]
    blocks = triton.cdiv(n, config.block_n)
    part = counters = out  # unused unless split: any pointer serves
    if config.split_k > 1:
        part = torch.empty(config.split_k, m, n, dtype=torch.float32, device=out.device)
        counters = zeroed_counters(out.device, tiles * blocks)
    launch_kernel(_fp8_gemm_kernel, (tiles, blocks, config.split_k),
        a, a_scale if a_scale is not None else a, w, w_scale, bias if bias is not None else out, out, part, counters,
        rows if rows is not None else out, tile_expert if tile_expert is not None else out,
        m, n, w.shape[2], experts_per_row, w.shape[0], a.stride(0),
        a_scale.stride(0) if a_scale is not None else 0, w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), out.stride(0), SCALE_BLOCK_N=weight_block_rows(w, w_scale), QUANTIZE_A=a_scale is None,
        GATHER=rows is not None, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=GROUP, SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               config: DecodeConfig | str | None = None) -> torch.Tensor:
    """See ``engine.model.kernels.fp8.fp8_linear``. ``config`` (None: ``plan``) forces one launch: a GEMV
    (``fp8_gemv``, ``fp8_mma_gemv``) for their configs, cuBLAS for ``SCALED_MM``, else the GEMM."""
    a = x.reshape(-1, x.shape[-1])
    m, n = a.shape[0], weight.shape[0]
    config = config or plan(a, weight, weight_scale, bias)
    if config == SCALED_MM:
        return _scaled_mm_linear(a, weight, weight_scale, bias).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    a_scale = None
    mma = isinstance(config, fp8_mma_gemv.Fp8MmaGemvConfig)
    if m > (fp8_mma_gemv.QUANTIZE_MAX_ROWS if mma else FUSED_QUANT_MAX_ROWS):
        a, a_scale = quantize_per_token_group(a)
    if isinstance(config, fp8_gemv.Fp8GemvConfig):
        fp8_gemv.launch(a, weight, weight_scale, bias, out, config)
    elif mma:
        fp8_mma_gemv.launch(a, a_scale, weight, weight_scale, bias, out, config)
    else:
        _launch(a, a_scale, weight, weight_scale, bias, out, m, triton.cdiv(m, config.block_m), config)
    return out.view(*x.shape[:-1], n)


def _group_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows ``[tiles * block_m]``, tile_expert ``[tiles]``): assignment ids (``t * J + j``) grouped
    by expert, each expert's run padded with -1 to whole tiles of ``block_m``; ``tile_expert``
    is each tile's expert, ``num_experts`` for the unused tiles at the end. ``tiles`` bounds the
    tiles any routing needs (``ceil(A / block_m) + min(E, A)`` for A assignments), so the shapes
    depend on shapes only. Assignments with id -1 are in no tile. Device ops, no host sync."""
    flat = expert_ids.flatten()
    count = flat.shape[0]
    key = torch.where(flat >= 0, flat, num_experts)                        # another rank's: sorted last
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    per_expert.scatter_add_(0, key, torch.ones_like(key))
    padded = (per_expert[:num_experts] + block_m - 1) // block_m * block_m
    tile_ends = padded.cumsum(0)
    order = key.argsort(stable=True)
    sorted_key = key[order]
    first_in_sorted = per_expert.cumsum(0) - per_expert                   # where each expert's run starts
    tiles = triton.cdiv(count, block_m) + min(num_experts, count)
    dest = torch.arange(count, device=flat.device) - first_in_sorted[sorted_key]
    dest += torch.cat([tile_ends - padded, tile_ends.new_zeros(1)])[sorted_key]
    dest = torch.where(sorted_key < num_experts, dest, tiles * block_m)   # -1 ids: to a dropped last slot
    rows = torch.full((tiles * block_m + 1,), -1, dtype=torch.int64, device=flat.device)
    rows.scatter_(0, dest, order)
    tile_starts = torch.arange(tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(tile_ends, tile_starts, right=True)
    return rows[:-1], tile_expert


def fp8_expert_linear(x: torch.Tensor, weights: torch.Tensor, weight_scales: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
    """See ``engine.model.kernels.fp8.fp8_expert_linear``: up to ``fp8_gemv.MAX_ROWS`` tokens (decode)
    the GEMV reads each assignment's expert in place (``fp8_gemv.expert_launch``); beyond, the
    GEMM over assignments grouped by expert."""
    tokens, per_token = expert_ids.shape
    if tokens <= fp8_gemv.MAX_ROWS:
        return fp8_gemv.expert_launch(x, weights, weight_scales, expert_ids)
    n = weights.shape[1]
    block_m = 16 if tokens * per_token <= 64 else 64
    rows, tile_expert = _group_by_expert(expert_ids, weights.shape[0], block_m)
    out = torch.zeros(tokens * per_token, n, dtype=x.dtype, device=x.device)
    _launch(x, None, weights, weight_scales, None, out, tokens, tile_expert.shape[0], _block_sizes(block_m), rows,
            tile_expert, per_token)
    return out.view(tokens, per_token, n)


def _scaled_mm_takes(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether cuBLAS block-wise scaling (1 x 128 activations, 128 x 128 weights) can run ``a [M, K]``
    against this weight: on CUDA, with 128-row weight blocks, K and N whole blocks."""
    n, k = weight.shape
    return (a.device.type == "cuda" and weight_block_rows(weight, weight_scale) == GROUP and n % GROUP == 0
            and k % GROUP == 0)


def _scaled_mm_unforced(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` may choose cuBLAS for ``a`` when ``KernelSettings.fp8_gemm`` forces
    nothing: no choice forced, an sm90 GPU, a shape ``scaled_mm`` takes."""
    return (current().fp8_gemm is None and _scaled_mm_takes(a, weight, weight_scale)
            and torch.cuda.get_device_capability(a.device) == (9, 0))


def _scaled_mm_linear(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with activation scales outer-dim-major ``[M, K/128]`` and
    weight scales ``[K/128 padded to 4, N/128]`` (the layouts cuBLAS reads on sm90). cuBLAS refuses
    (CUBLAS_STATUS_NOT_SUPPORTED) activation scales whose leading dimension M is not a multiple of 4
    (16 bytes): such an ``a`` gets zero rows up to one, and its output loses them again."""
    from torch.nn.functional import ScalingType, scaled_mm

    rows = a.shape[0]
    if rows % 4:
        a = torch.nn.functional.pad(a, (0, 0, 0, -rows % 4))
    q, a_scale = quantize_per_token_group(a)
    k_blocks = weight_scale.shape[1]
    padded = weight_scale.new_zeros(weight_scale.shape[0], -(-k_blocks // 4) * 4)
    padded[:, :k_blocks] = weight_scale
    out = scaled_mm(q, weight.t(), a_scale.t().contiguous().t(), ScalingType.BlockWise1x128, padded.t(),
                    ScalingType.BlockWise128x128, bias=bias, output_dtype=a.dtype)
    return out[:rows]
