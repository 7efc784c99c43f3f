"""Scatter new K/V rows into the paged cache (slot -1 = padding, skipped)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def _store_kernel(src_ptr, cache_ptr, slots_ptr, num_tokens, row_width, head_dim, src_stride0, src_stride1,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS tokens x BLOCK elements of their [Hk * D] rows per program."""
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = tokens < num_tokens
    slots = tl.load(slots_ptr + tokens, mask=live, other=-1).to(tl.int64)
    in_row = (offsets < row_width)[None, :]
    src = src_ptr + tokens[:, None] * src_stride0 + ((offsets // head_dim) * src_stride1 + offsets % head_dim)[None, :]
    rows = tl.load(src, mask=live[:, None] & in_row)
    tl.store(cache_ptr + slots[:, None] * row_width + offsets[None, :], rows, mask=(slots >= 0)[:, None] & in_row)


def _store(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if not cache.is_contiguous() or cache.dtype != src.dtype:
        raise ValueError(f"store_kv_cache: cache must be contiguous and {src.dtype} (got {cache.dtype})")
    rows = src.view(src.shape[0], -1, cache.shape[-1])
    if rows.stride(-1) != 1:
        raise ValueError("store_kv_cache: key/value need a contiguous last dim")
    row_width = cache.shape[2] * cache.shape[3]
    block = min(_BLOCK, triton.next_power_of_2(row_width))
    per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
    num_tokens = rows.shape[0]
    _store_kernel[(triton.cdiv(num_tokens, per_program), triton.cdiv(row_width, block))](
        rows, cache, slot_mapping, num_tokens, row_width, cache.shape[3], rows.stride(0), rows.stride(1),
        ROWS=per_program, BLOCK=block)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    _store(key, k_cache, slot_mapping)
    if value is not None:
        _store(value, v_cache, slot_mapping)
