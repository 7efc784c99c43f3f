"""RMSNorm kernels: plain and fused with the residual add (float32 math)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel

_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, out_ptr, weight_ptr, num_rows, inner_rows, hidden, eps,
                     x_stride0, x_stride1, r_stride0, r_stride1, o_stride0, o_stride1,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # Rows of a [outer, inner, hidden] view: row r is (r // inner_rows, r % inner_rows).
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    outer, inner = rows // inner_rows, rows % inner_rows
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x_offsets = (outer * x_stride0 + inner * x_stride1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_offsets = (outer * r_stride0 + inner * r_stride1)[:, None] + cols[None, :]
        summed = (x + tl.load(residual_ptr + r_offsets, mask=mask, other=0.0).to(tl.float32))
        summed = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + r_offsets, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = x * inv_rms[:, None] * weight[None, :]
    o_offsets = (outer * o_stride0 + inner * o_stride1)[:, None] + cols[None, :]
    tl.store(out_ptr + o_offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _row_strides(t: torch.Tensor, name: str) -> tuple[int, int]:
    """(stride of dim 0, stride of dim 1 or 0) of a [M, H] or [M, N, H] tensor with unit last stride."""
    if t.dim() not in (2, 3) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D or 3-D with a contiguous last dim, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0), t.stride(1) if t.dim() == 3 else 0


def _launch(x, residual, out, weight, eps):
    hidden = x.shape[-1]
    block_h = next_power_of_2(hidden)
    block_rows = max(1, _ELEMENTS_PER_PROGRAM // block_h)
    num_rows, inner_rows = x.numel() // hidden, x.shape[1] if x.dim() == 3 else 1
    residual_strides = _row_strides(residual, "residual") if residual is not None else (0, 0)
    launch_kernel(_rms_norm_kernel, (cdiv(num_rows, block_rows),),
        x, residual if residual is not None else x, out, weight, num_rows, inner_rows, hidden, eps,
        *_row_strides(x, "input"), *residual_strides, *_row_strides(out, "out"),
        HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
        num_warps=8 if block_h * block_rows >= 4096 else 4)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _launch(input, None, out, weight, eps)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _launch(input, residual, input, weight, eps)
