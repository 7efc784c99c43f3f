"""Expert GEMV: each (token, expert) assignment of a few-token MoE step, the token's row times
that expert's weight matrix, read in place from the stacked expert weights (no gathered copy of
the weights, no repeated copy of the row).

Program (assignment, output block) loads its assignment's expert id on the device, then streams
that expert's ``[BLOCK_N, K]`` weight rows in ``BLOCK_K`` chunks against its token's
activations (row ``assignment // J``), accumulating in float32. Launch shape comes from host
shapes only (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.host_math import cdiv
from engine.model.kernels.triton.launcher import launch_kernel


@triton.jit
def _expert_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, n_out, k_dim, experts_per_row, x_stride, w_stride_e,
                        w_stride_n, out_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, expert) assignment
    token = row // experts_per_row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    expert = tl.load(ids_ptr + row).to(tl.int64)
    col_ok = col_ok & (expert >= 0)  # id -1: a zero row, and none of the weights read
    w_rows = w_ptr + tl.maximum(expert, 0) * w_stride_e + cols[:, None].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_dim
        x = tl.load(x_ptr + token * x_stride + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n_out)


def expert_gemv(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """See ``engine.model.kernels.expert_gemv``."""
    tokens, k_dim = x.shape
    experts_per_row = expert_ids.shape[1]
    _, n_out, _ = weights.shape
    if x.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("expert_gemv: x and weights need a contiguous last dim")
    ids = expert_ids.contiguous()
    out = torch.empty(tokens, experts_per_row, n_out, dtype=x.dtype, device=x.device)
    block_n, block_k = 32, 256
    launch_kernel(_expert_gemv_kernel, (tokens * experts_per_row, cdiv(n_out, block_n)),
        x, weights, ids, out, n_out, k_dim, experts_per_row, x.stride(0), weights.stride(0), weights.stride(1),
        out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
