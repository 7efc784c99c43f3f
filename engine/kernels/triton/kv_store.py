"""Scatter new K/V rows into the paged cache (slot -1 = padding, skipped)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _store_kernel(src_ptr, cache_ptr, slots_ptr, row_width, head_dim, src_stride0, src_stride1,
                  BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    in_row = offsets < row_width
    row = tl.load(src_ptr + token * src_stride0 + (offsets // head_dim) * src_stride1 + offsets % head_dim,
                  mask=in_row)
    tl.store(cache_ptr + slot * row_width + offsets, row, mask=in_row & (slot >= 0))


def _store(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if not cache.is_contiguous() or cache.dtype != src.dtype:
        raise ValueError(f"store_kv_cache: cache must be contiguous and {src.dtype} (got {cache.dtype})")
    rows = src.view(src.shape[0], -1, cache.shape[-1])
    if rows.stride(-1) != 1:
        raise ValueError("store_kv_cache: key/value need a contiguous last dim")
    row_width = cache.shape[2] * cache.shape[3]
    _store_kernel[(rows.shape[0], triton.cdiv(row_width, _BLOCK))](
        rows, cache, slot_mapping, row_width, cache.shape[3], rows.stride(0), rows.stride(1), BLOCK=_BLOCK)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    _store(key, k_cache, slot_mapping)
    if value is not None:
        _store(value, v_cache, slot_mapping)
