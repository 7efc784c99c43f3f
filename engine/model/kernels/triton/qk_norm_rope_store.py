"""Qwen's attention prologue in one launch: per-head q/k RMSNorm (Qwen3; skipped for Qwen2),
neox RoPE on q and k, and the step's K/V rows scattered into the paged cache.

Program (token, head block): head blocks ``[0, q_head_blocks)`` are query heads, the rest
key heads; a key-head program also writes its rotated K rows and the matching V rows to
the cache slot of its token (slot -1 = padding, skipped). Each head row is normalised and
rotated in float32 registers and rounded once, on the final store (to the key's dtype; for an
FP8 cache then to e4m3, as ``store_kv_cache`` would).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels import FP8_DTYPE
from engine.model.kernels.triton.fp8_cast import saturate_to_fp8
from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, token, heads, num_heads, stride0, stride1, cos, sin, pair, eps,
                     HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Normalise and rotate rows ``heads`` of token ``token`` in place; returns them (float32
    halves) and their row mask."""
    base = token * stride0 + heads[:, None] * stride1
    mask = (heads < num_heads)[:, None]
    x1 = tl.load(x_ptr + base + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        x1 = x1 * inv * tl.load(w_ptr + pair).to(tl.float32)[None, :]
        x2 = x2 * inv * tl.load(w_ptr + HALF + pair).to(tl.float32)[None, :]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(x_ptr + base + pair[None, :], y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + base + HALF + pair[None, :], y2.to(x_ptr.dtype.element_ty), mask=mask)
    return y1, y2, mask


@triton.jit
def _qk_norm_rope_store_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cache_ptr, k_cache_ptr,
                               v_cache_ptr, slots_ptr, eps, num_q_heads, num_kv_heads, q_head_blocks,
                               q_stride0, q_stride1, k_stride0, k_stride1, v_stride0, v_stride1, cache_stride,
                               HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
                               CACHE_FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    pair = tl.arange(0, HALF)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + position * cache_stride + pair).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + position * cache_stride + HALF + pair).to(tl.float32)[None, :]
    if head_block < q_head_blocks:
        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _norm_rope_heads(q_ptr, qw_ptr, token, heads, num_q_heads, q_stride0, q_stride1, cos, sin, pair, eps,
                         HALF, HAS_NORM)
    else:
        heads = (head_block - q_head_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        k1, k2, mask = _norm_rope_heads(k_ptr, kw_ptr, token, heads, num_kv_heads, k_stride0, k_stride1, cos, sin,
                                        pair, eps, HALF, HAS_NORM)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        keep = mask & (slot >= 0)
        row = (slot * num_kv_heads + heads[:, None]) * (2 * HALF)
        tl.store(k_cache_ptr + row + pair[None, :], _cache_value(k1, k_ptr, CACHE_FP8), mask=keep)
        tl.store(k_cache_ptr + row + HALF + pair[None, :], _cache_value(k2, k_ptr, CACHE_FP8), mask=keep)
        v_base = token * v_stride0 + heads[:, None] * v_stride1
        for part in tl.static_range(2):
            v = tl.load(v_ptr + v_base + part * HALF + pair[None, :], mask=mask, other=0.0)
            tl.store(v_cache_ptr + row + part * HALF + pair[None, :], _cache_value(v, v_ptr, CACHE_FP8), mask=keep)


@triton.jit
def _cache_value(x, src_ptr, CACHE_FP8: tl.constexpr):
    """``x`` as the cache stores it: rounded to the source rows' dtype (what the unfused store
    would copy), then, for an FP8 cache, cast to e4m3 with saturation."""
    x = x.to(src_ptr.dtype.element_ty)
    if CACHE_FP8:
        x = saturate_to_fp8(x.to(tl.float32))
    return x


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """See ``engine.model.kernels.qk_norm_rope_store``."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if half & (half - 1) or min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("qk_norm_rope_store: head_dim must be twice a power of two, rows contiguous in the last dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype not in (k.dtype, FP8_DTYPE):
        raise ValueError("qk_norm_rope_store: caches must be contiguous and in the key dtype or e4m3")
    block_heads = min(16, next_power_of_2(max(num_q_heads, num_kv_heads)))
    q_head_blocks = cdiv(num_q_heads, block_heads)
    has_norm = q_weight is not None
    launch_kernel(_qk_norm_rope_store_kernel, (tokens, q_head_blocks + cdiv(num_kv_heads, block_heads)),
        positions, q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos_sin_cache, k_cache, v_cache,
        slot_mapping, eps, num_q_heads, num_kv_heads, q_head_blocks, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_HEADS=block_heads, HAS_NORM=has_norm, CACHE_FP8=k_cache.dtype == FP8_DTYPE)
