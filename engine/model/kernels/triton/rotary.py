"""Rotary embedding kernel: query and key rotated in place in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel


@triton.jit
def _rotate_heads(x_ptr, token, heads, num_heads, stride0, stride1, cos, sin, first, second, pair_mask):
    base = token * stride0 + heads[:, None] * stride1
    mask = (heads < num_heads)[:, None] & pair_mask[None, :]
    x1 = tl.load(x_ptr + base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + base + first[None, :], (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + base + second[None, :], (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads_interleaved(x_ptr, token, heads, num_heads, stride0, stride1, cos, sin,
                              HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    """GPT-J pairs (2i, 2i + 1): one contiguous load per head row, split into even/odd lanes in registers
    (two stride-2 loads would waste half of every memory transaction)."""
    cols = tl.arange(0, 2 * BLOCK_HALF)
    base = token * stride0 + heads[:, None] * stride1
    mask = (heads < num_heads)[:, None] & (cols < 2 * HALF)[None, :]
    x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_HEADS, BLOCK_HALF, 2)))
    y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), (BLOCK_HEADS, 2 * BLOCK_HALF))
    tl.store(x_ptr + base + cols[None, :], y.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x_ptr, token, heads, num_heads, stride0, stride1, cos, sin, pair, pair_mask,
            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        _rotate_heads(x_ptr, token, heads, num_heads, stride0, stride1, cos, sin, pair, pair + HALF, pair_mask)
    else:
        _rotate_heads_interleaved(x_ptr, token, heads, num_heads, stride0, stride1, cos, sin,
                                  HALF, BLOCK_HALF, BLOCK_HEADS)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, num_k_heads, q_head_blocks,
                   q_stride0, q_stride1, k_stride0, k_stride1, cache_stride,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                   IS_NEOX: tl.constexpr):
    # Program (token, head block): head blocks [0, q_head_blocks) are query heads, the rest key heads.
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    pair = tl.arange(0, BLOCK_HALF)
    pair_mask = pair < HALF
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + position * cache_stride + pair, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + position * cache_stride + HALF + pair, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
    if head_block < q_head_blocks:
        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _rotate(q_ptr, token, heads, num_q_heads, q_stride0, q_stride1, cos, sin, pair, pair_mask,
                HALF, BLOCK_HALF, BLOCK_HEADS, IS_NEOX)
    else:
        heads = (head_block - q_head_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _rotate(k_ptr, token, heads, num_k_heads, k_stride0, k_stride1, cos, sin, pair, pair_mask,
                HALF, BLOCK_HALF, BLOCK_HEADS, IS_NEOX)


def _heads_view(x: torch.Tensor, head_size: int) -> torch.Tensor:
    view = x.view(x.shape[0], -1, head_size)
    if view.stride(-1) != 1:
        raise ValueError("rotary_embedding: query/key need a contiguous last dim")
    return view


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    q = _heads_view(query, head_size)
    k = _heads_view(key, head_size) if key is not None else q[:, :0]
    half = cos_sin_cache.shape[1] // 2
    block_heads = min(16, next_power_of_2(max(q.shape[1], k.shape[1])))
    q_head_blocks = cdiv(q.shape[1], block_heads)
    grid = (q.shape[0], q_head_blocks + cdiv(k.shape[1], block_heads))
    launch_kernel(_rotary_kernel, grid, positions, q, k, cos_sin_cache, q.shape[1], k.shape[1], q_head_blocks,
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                  HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_HEADS=block_heads, IS_NEOX=is_neox)
