"""Scatter new K/V rows into the paged cache (slot -1 = padding, skipped); into an FP8 (e4m3)
cache through the saturating cast (``fp8_cast.saturate_to_fp8``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels import FP8_DTYPE
from engine.model.kernels.triton.fp8_cast import saturate_to_fp8
from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel

_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_tokens, num_heads,
                  k_stride0, k_stride1, v_stride0, v_stride1,
                  HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr, CACHE_FP8: tl.constexpr):
    """Program (token block, head): ROWS tokens' K (and V) rows of one head; K and V in one launch."""
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1)
    live = tokens < num_tokens
    slots = tl.load(slots_ptr + tokens, mask=live, other=-1).to(tl.int64)
    keep = (slots >= 0)[:, None]
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + (tokens * k_stride0 + head * k_stride1)[:, None] + d[None, :],
                mask=live[:, None] & (d < HEAD_DIM)[None, :])
    if CACHE_FP8:
        k = saturate_to_fp8(k.to(tl.float32))
    tl.store(k_cache_ptr + ((slots * num_heads + head) * HEAD_DIM)[:, None] + d[None, :], k,
             mask=keep & (d < HEAD_DIM)[None, :])
    if HAS_V:
        dv = tl.arange(0, BLOCK_DV)
        v = tl.load(v_ptr + (tokens * v_stride0 + head * v_stride1)[:, None] + dv[None, :],
                    mask=live[:, None] & (dv < V_DIM)[None, :])
        if CACHE_FP8:
            v = saturate_to_fp8(v.to(tl.float32))
        tl.store(v_cache_ptr + ((slots * num_heads + head) * V_DIM)[:, None] + dv[None, :], v,
                 mask=keep & (dv < V_DIM)[None, :])


def _rows(src: torch.Tensor, cache: torch.Tensor, name: str) -> torch.Tensor:
    """``src`` as [T, Hk, D] matching ``cache`` [blocks, block_size, Hk, D]; checks layout and dtype
    (the cache's is the rows' own, or e4m3)."""
    if not cache.is_contiguous() or cache.dtype not in (src.dtype, FP8_DTYPE):
        raise ValueError(f"store_kv_cache: {name} cache must be contiguous and {src.dtype} or {FP8_DTYPE} "
                         f"(got {cache.dtype})")
    rows = src.view(src.shape[0], cache.shape[2], cache.shape[3])
    if rows.stride(-1) != 1:
        raise ValueError(f"store_kv_cache: {name} needs a contiguous last dim")
    return rows


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    k = _rows(key, k_cache, "key")
    v = _rows(value, v_cache, "value") if value is not None else k
    num_tokens, num_heads, head_dim = k.shape
    block_d, block_dv = next_power_of_2(head_dim), next_power_of_2(v.shape[2])
    rows = max(1, _ELEMENTS_PER_PROGRAM // max(block_d, block_dv))
    launch_kernel(_store_kernel, (cdiv(num_tokens, rows), num_heads),
        k, v, k_cache, v_cache if value is not None else k_cache, slot_mapping, num_tokens, num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, V_DIM=v.shape[2], ROWS=rows, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_V=value is not None, CACHE_FP8=k_cache.dtype == FP8_DTYPE)
