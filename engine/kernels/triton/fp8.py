"""FP8 W8A8 kernels (see ``engine.kernels.fp8`` for the contract): per-token-group activation
quantization, and one block-scaled GEMM that serves the linear layers and the routed experts.

The GEMM's K loop steps by 128, so each K-tile is exactly one activation group and one
weight scale column: the tile's fp8 product (``tl.dot``, float32 accumulation) is scaled
by the rows' activation scales and the columns' weight scales before it is added. The
activations come quantized (``quantize_per_token_group``, large M) or are quantized in the
GEMM itself, one K-tile at a time (small M, where the weights' bytes dominate: one launch).

Experts: assignments are grouped by expert on the device into tiles of ``BLOCK_M`` rows
(each expert's rows padded to a whole tile; ``_group_by_expert``), so a program reads one
expert's weights for its tile; tiles past the last used one return at once. Launch shapes
come from host shapes only: no host sync, CUDA-graph safe.

``AGENT_INFER_FP8_GEMM=scaled_mm`` routes ``fp8_linear`` with 128 x 128 weight blocks through
``torch.nn.functional.scaled_mm`` (cuBLAS block-wise scaling, sm90) instead: measured against
the Triton GEMM by ``scripts/bench_fp8.py``; Triton stays the default until it measures slower.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, GROUP, SCALE_FLOOR, weight_block_rows

GEMM_ENV = "AGENT_INFER_FP8_GEMM"   # "triton" (default) or "scaled_mm"
FUSED_QUANT_MAX_ROWS = 64           # up to this many rows the GEMM quantizes its own activations
_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(SCALE_FLOOR)


@triton.jit
def saturate_to_fp8(v):
    """e4m3 of float32 ``v``: clamped to ±448 (saturated, never NaN), then rounded to 3 mantissa
    bits (nearest, ties to even) in its float32 bits, where a carry reaches the exponent, so the
    cast itself is exact (Triton's interpreter loses the carry of a rounding that crosses a
    power of two, and turns values past the e4m3 range into NaN)."""
    bits = tl.clamp(v, -_MAX, _MAX).to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return bits.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _quantize_tile(a):
    """``a [R, 128]`` float32 -> (e4m3 ``[R, 128]``, float32 scales ``[R]``), one group per row."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), _FLOOR) / _MAX
    return saturate_to_fp8(a / scale[:, None]), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, m, k, x_stride, q_stride, s_stride,
                     BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < m)[:, None] & (cols < k)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x)
    tl.store(q_ptr + rows64[:, None] * q_stride + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * s_stride + group, scale, mask=rows < m)


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    block_rows = 16
    _quantize_kernel[(triton.cdiv(m, block_rows), scales.shape[1])](
        x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0), BLOCK_ROWS=block_rows, BLOCK_K=GROUP)
    return q, scales


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, rows_ptr, tile_expert_ptr,
                     m, n, k, experts_per_row, num_experts,
                     a_stride, a_scale_stride, w_stride_e, w_stride_n, ws_stride_e, ws_stride_n, out_stride,
                     SCALE_BLOCK_N: tl.constexpr, QUANTIZE_A: tl.constexpr, GATHER: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if QUANTIZE_A:
            a, a_scale = _quantize_tile(a.to(tl.float32))
        else:
            a_scale = tl.load(a_scale_ptr + a_rows * a_scale_stride + k0 // BLOCK_K, mask=row_ok, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_scale = tl.load(w_scale_rows + k0 // BLOCK_K, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _block_sizes(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for tiles of up to ``rows`` rows."""
    if rows <= 16:
        return 16, 64, 4, 4
    if rows <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def _launch(a, a_scale, w, w_scale, bias, out, m, tiles, tile_rows, rows=None, tile_expert=None,
            experts_per_row=1):
    """One GEMM launch over ``tiles`` tiles of ``tile_rows`` rows (gathered when ``rows`` is given)."""
    if w.dim() == 2:
        w, w_scale = w.unsqueeze(0), w_scale.unsqueeze(0)
    block_m, block_n, warps, stages = _block_sizes(tile_rows)
    _fp8_gemm_kernel[(tiles, triton.cdiv(w.shape[1], block_n))](
        a, a_scale if a_scale is not None else a, w, w_scale, bias if bias is not None else out, out,
        rows if rows is not None else out, tile_expert if tile_expert is not None else out,
        m, w.shape[1], w.shape[2], experts_per_row, w.shape[0], a.stride(0),
        a_scale.stride(0) if a_scale is not None else 0, w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), out.stride(0), SCALE_BLOCK_N=weight_block_rows(w, w_scale), QUANTIZE_A=a_scale is None,
        GATHER=rows is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
        num_warps=warps, num_stages=stages)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    a = x.reshape(-1, x.shape[-1])
    m, n = a.shape[0], weight.shape[0]
    if os.environ.get(GEMM_ENV) == "scaled_mm" and _scaled_mm_fits(a, weight, weight_scale):
        return _scaled_mm_linear(a, weight, weight_scale, bias).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    a_scale = None
    if m > FUSED_QUANT_MAX_ROWS:
        a, a_scale = quantize_per_token_group(a)
    _launch(a, a_scale, weight, weight_scale, bias, out, m, triton.cdiv(m, _block_sizes(m)[0]), m)
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
    tokens, per_token = expert_ids.shape
    n = weights.shape[1]
    block_m = 16 if tokens * per_token <= 64 else 64
    rows, tile_expert = _group_by_expert(expert_ids, weights.shape[0], block_m)
    out = torch.zeros(tokens * per_token, n, dtype=x.dtype, device=x.device)
    _launch(x, None, weights, weight_scales, None, out, tokens, tile_expert.shape[0], block_m, rows, tile_expert,
            per_token)
    return out.view(tokens, per_token, n)


def _scaled_mm_fits(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """cuBLAS block-wise scaling (1 x 128 activations, 128 x 128 weights): K and N whole blocks."""
    n, k = weight.shape
    return weight_block_rows(weight, weight_scale) == GROUP and n % GROUP == 0 and k % GROUP == 0


def _scaled_mm_linear(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with activation scales outer-dim-major ``[M, K/128]`` and
    weight scales ``[K/128 padded to 4, N/128]`` (the layouts cuBLAS reads on sm90)."""
    from torch.nn.functional import ScalingType, scaled_mm

    q, a_scale = quantize_per_token_group(a)
    k_blocks = weight_scale.shape[1]
    padded = weight_scale.new_zeros(weight_scale.shape[0], -(-k_blocks // 4) * 4)
    padded[:, :k_blocks] = weight_scale
    return scaled_mm(q, weight.t(), a_scale.t().contiguous().t(), ScalingType.BlockWise1x128, padded.t(),
                     ScalingType.BlockWise128x128, bias=bias, output_dtype=a.dtype)
