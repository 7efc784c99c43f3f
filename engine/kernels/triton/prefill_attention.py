"""Ragged (varlen) prefill attention on CUDA.

Uses torch's own FlashAttention varlen kernel (``torch.nn.attention.varlen``)
when it fits (fp16/bf16, equal head dims <= 256); otherwise a Triton
flash-attention kernel (MLA prefill: q/k 192 vs v 128; float32). Causal
masking is bottom-right aligned in both.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from engine.kernels.triton.attention_tiles import NEG_BIG, head_dim_blocks, load_q, online_softmax_step, scores_tile
from engine.kernels.triton.host_math import cdiv, next_power_of_2

_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, scale_log2, group,
                   q_stride0, q_stride1, k_stride0, k_stride1, v_stride0, v_stride1, o_stride0, o_stride1,
                   HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr):
    # Program (query block, sequence, query head).
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
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
    if CAUSAL:
        end = tl.minimum(k_len, (q_block + 1) * BLOCK_M + shift)
    dv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for tile in range(0, end, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        col_mask = cols < k_len
        scores, _ = scores_tile(q_main, q_tail, k_ptr, (k_start + cols) * k_stride0 + kv_head * k_stride1,
                                col_mask, HEAD_DIM, BLOCK_D, BLOCK_TAIL)
        v = tl.load(v_ptr + ((k_start + cols) * v_stride0 + kv_head * v_stride1)[:, None] + dv[None, :],
                    mask=col_mask[:, None] & (dv < V_DIM)[None, :], other=0.0)
        allowed = col_mask[None, :]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + shift)
        m, denom, acc = online_softmax_step(scores, allowed, m, denom, acc, v, scale_log2)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + ((q_start + rows) * o_stride0 + head * o_stride1)[:, None] + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dv < V_DIM)[None, :])


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """The Triton kernel behind ``varlen_attention`` (any dtype, any head dims, Dv may differ from D)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("varlen_attention: q, k, v need a contiguous last dim")
    head_dim, v_dim = q.shape[2], v.shape[2]
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    block_d, block_tail = head_dim_blocks(head_dim)
    block_dv = max(16, next_power_of_2(v_dim))
    block_m = 64
    block_n = 64 if (block_d + block_tail + block_dv) * q.element_size() <= 512 else 32
    grid = (cdiv(max_seqlen_q, block_m), cu_seqlens_q.shape[0] - 1, q.shape[1])
    _varlen_kernel[grid](q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E, q.shape[1] // k.shape[1],
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         out.stride(0), out.stride(1),
                         HEAD_DIM=head_dim, V_DIM=v_dim, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_D=block_d, BLOCK_TAIL=block_tail, BLOCK_DV=block_dv, num_warps=4, num_stages=2)
    return out


@functools.cache
def _torch_varlen_parameters() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """torch's varlen_attn serves the case directly: half precision, equal head dims <= 256,
    and GQA only where it has ``enable_gqa`` (torch >= 2.12; expanding K/V instead costs
    more than our Triton kernel, measured on the H200)."""
    params = _torch_varlen_parameters()
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] == v.shape[2] <= 256
            and q.shape[2] % 8 == 0 and "scale" in params and ("window_size" in params or "is_causal" in params)
            and (q.shape[1] == k.shape[1] or "enable_gqa" in params))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool = True) -> torch.Tensor:
    if not _torch_varlen_fits(q, k, v):
        return flash_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal)
    from torch.nn.attention.varlen import varlen_attn

    params = _torch_varlen_parameters()
    kwargs = {"scale": softmax_scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
