"""SiLU-and-multiply kernel for gated MLPs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.host_math import cdiv
from engine.model.kernels.triton.launcher import launch_kernel

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, half, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + half + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    x, y = input.view(-1, input.shape[-1]), out.view(-1, out.shape[-1])
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("silu_and_mul: input and out need a contiguous last dim")
    half = y.shape[1]
    launch_kernel(_silu_and_mul_kernel, (x.shape[0], cdiv(half, _BLOCK)), x, y, half, x.stride(0), y.stride(0),
                  BLOCK=_BLOCK)
