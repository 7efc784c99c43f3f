"""Ragged (varlen) prefill attention on CUDA.

A Triton flash-attention kernel serves every case (any dtype, GQA, MLA's q/k 192 vs v 128, cached
prefixes: causal masking bottom-right aligned); one causal sequence without a cached prefix in
half precision goes to cuDNN's dense attention instead. Measured on the H200 (Qwen3-8B, one causal
4,096-token sequence, `scripts/bench_kernels.py --only prefill_sweep`, 2026-12-04): cuDNN 510
TFLOP/s; the Triton kernel 429 at 128 x 128 tiles, 8 warps, 3 stages (its default for half-precision
head dims <= 128; 385 at the old 64 x 64, 4 warps, 2 stages, which MLA's wider heads keep);
torch's FlashAttention-2 (``varlen_attn``, no GQA in torch 2.11) 273, so it is no longer used.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.attention_tiles import (
    NEG_BIG,
    head_dim_blocks,
    load_q,
    online_softmax_step,
    scores_tile,
)
from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel

_LOG2E = 1.4426950408889634


@triton.jit
def _key_value_tile(q_main, q_tail, k_ptr, v_ptr, k_rows, col_mask, kv_head, k_stride0, k_stride1, v_stride0,
                    v_stride1, dv, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_TAIL: tl.constexpr):
    """One key tile at key rows ``k_rows`` (masked by ``col_mask``): (raw scores [M, N] fp32, values [N, DV])."""
    scores, _ = scores_tile(q_main, q_tail, k_ptr, k_rows * k_stride0 + kv_head * k_stride1, col_mask,
                            HEAD_DIM, BLOCK_D, BLOCK_TAIL)
    v = tl.load(v_ptr + (k_rows * v_stride0 + kv_head * v_stride1)[:, None] + dv[None, :],
                mask=col_mask[:, None] & (dv < V_DIM)[None, :], other=0.0)
    return scores, v


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, scale_log2, group, q_blocks,
                   q_stride0, q_stride1, k_stride0, k_stride1, v_stride0, v_stride1, o_stride0, o_stride1,
                   HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr):
    # Program (query head, query block counted from the last, sequence): the heads of a KV group sit
    # side by side (they read the same keys), and under a causal mask the longest rows start first.
    head = tl.program_id(0)
    q_block = q_blocks - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    if q_block * BLOCK_M >= q_len:
        return
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_main, q_tail = load_q(q_ptr, (q_start + rows) * q_stride0 + head * q_stride1, row_mask,
                            HEAD_DIM, BLOCK_D, BLOCK_TAIL)
    shift = k_len - q_len  # bottom-right causal: row i sees keys <= i + shift
    end = k_len
    # Key tiles before `full` are seen whole by every row of the block: no mask to build or apply.
    full = (k_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        end = tl.minimum(k_len, (q_block + 1) * BLOCK_M + shift)
        full = tl.maximum(q_block * BLOCK_M + shift + 1, 0) // BLOCK_N * BLOCK_N
    dv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for tile in range(0, full, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        # every column is below k_len here; a mask along rows only keeps the loads vectorised
        scores, v = _key_value_tile(q_main, q_tail, k_ptr, v_ptr, k_start + cols, cols < k_len, kv_head, k_stride0,
                                    k_stride1, v_stride0, v_stride1, dv, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_TAIL)
        m, denom, acc = online_softmax_step(scores, True, m, denom, acc, v, scale_log2)
    for tile in range(full, end, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        col_mask = cols < k_len
        scores, v = _key_value_tile(q_main, q_tail, k_ptr, v_ptr, k_start + cols, col_mask, kv_head, k_stride0,
                                    k_stride1, v_stride0, v_stride1, dv, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_TAIL)
        allowed = col_mask[None, :]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + shift)
        m, denom, acc = online_softmax_step(scores, allowed, m, denom, acc, v, scale_log2)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + ((q_start + rows) * o_stride0 + head * o_stride1)[:, None] + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dv < V_DIM)[None, :])


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch shape of the Triton prefill kernel: query rows and key columns per tile, warps, pipeline stages."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_launch(head_dim: int, v_dim: int, element_size: int) -> PrefillLaunch:
    """The measured launch for these head dims (module docstring): 128 x 128 tiles for half-precision
    heads up to 128 wide (their three stages fill 224 of the H200's 227 KiB of shared memory);
    otherwise 64-row tiles, with narrower key tiles where the head dims make a tile large."""
    block_d, block_tail = head_dim_blocks(head_dim)
    block_dv = max(16, next_power_of_2(v_dim))
    if element_size == 2 and block_d + block_tail <= 128 and block_dv <= 128:
        return PrefillLaunch(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return PrefillLaunch(block_n=64 if (block_d + block_tail + block_dv) * element_size <= 512 else 32)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool = True,
                           launch: PrefillLaunch | None = None) -> torch.Tensor:
    """The Triton kernel behind ``varlen_attention`` (any dtype, any head dims, Dv may differ from D);
    ``launch`` overrides the default launch shape (benchmarks and tests)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("varlen_attention: q, k, v need a contiguous last dim")
    head_dim, v_dim = q.shape[2], v.shape[2]
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    block_d, block_tail = head_dim_blocks(head_dim)
    launch = launch or default_launch(head_dim, v_dim, q.element_size())
    q_blocks = cdiv(max_seqlen_q, launch.block_m)
    grid = (q.shape[1], q_blocks, cu_seqlens_q.shape[0] - 1)
    launch_kernel(_varlen_kernel, grid, q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E,
                  q.shape[1] // k.shape[1], q_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                  v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                  HEAD_DIM=head_dim, V_DIM=v_dim, CAUSAL=causal, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                  BLOCK_D=block_d, BLOCK_TAIL=block_tail, BLOCK_DV=max(16, next_power_of_2(v_dim)),
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def _one_causal_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         causal: bool) -> bool:
    """The case cuDNN's dense attention serves, on a GPU where it runs: ``_cudnn_shape``."""
    return (q.is_cuda and _cudnn_shape(cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], causal, q.dtype,
                                       q.shape[2], v.shape[2]) and _cudnn_attention_runs(q.device))


def _cudnn_shape(num_seqs: int, q_rows: int, k_rows: int, causal: bool, dtype: torch.dtype, head_dim: int,
                 v_dim: int) -> bool:
    """The shapes cuDNN's dense attention serves: one sequence attending causally to its own keys
    (no cached prefix: as many key rows as query rows, so top-left and bottom-right alignment
    agree; rows past the sequence, a padded step's, come after it and are never seen by it), at
    least two of them (cuDNN has no kernel for one key row: a one-token prompt aborted the
    prefill), half precision, equal head dims <= 128, multiples of 8."""
    return (causal and num_seqs == 1 and q_rows == k_rows >= 2 and dtype in (torch.float16, torch.bfloat16)
            and head_dim == v_dim <= 128 and head_dim % 8 == 0)


@functools.cache
def _cudnn_attention_runs(device: torch.device) -> bool:
    """Whether torch's cuDNN attention backend runs here, on an sm90+ GPU (where it was measured
    faster than the Triton kernel; other GPUs keep the kernel); asked once per device."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        probe = torch.zeros(1, 2, 16, 64, device=device, dtype=torch.bfloat16)
        _cudnn_attention(probe, probe[:, :1], probe[:, :1], 1.0)
        return True
    except RuntimeError:
        return False


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``[1, Hq, T, D]`` queries on ``[1, Hk, T, D]`` keys / values through cuDNN (GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """One causal sequence without a cached prefix (a long prompt's prefill) through cuDNN's attention
    (510 against 429 TFLOP/s for the Triton kernel on the H200, module docstring); everything else
    through the Triton kernel."""
    if not _one_causal_sequence(q, k, v, cu_seqlens_q, causal):
        return flash_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal)
    dense = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return _cudnn_attention(*dense, softmax_scale).squeeze(0).transpose(0, 1).contiguous()
