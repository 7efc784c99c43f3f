"""Tile helpers shared by the FP8 Triton kernels (``fp8.py``'s GEMM, ``fp8_gemv.py``,
``fp8_mma_gemv.py``): per-row group quantization of an activation tile (through
``fp8_cast.saturate_to_fp8``), the epilogue that adds a bias and stores in the output's dtype,
and the split-K finish that merges the splits' float32 partial sums in one launch."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.model.kernels.fp8 import FP8_MAX, SCALE_FLOOR
from engine.model.kernels.triton.fp8_cast import saturate_to_fp8
from engine.model.kernels.triton.semaphores import arrive_last

_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(SCALE_FLOOR)


@triton.jit
def quantize_tile(a):
    """``a [R, 128]`` float32 -> (e4m3 ``[R, 128]``, float32 scales ``[R]``), one group per row.
    Both divisions round to nearest (``div_rn``): Triton's ``/`` on CUDA is the approximate
    ``div.full.f32``, one ulp off torch's ``/`` in the scales."""
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), _FLOOR), _MAX)
    return saturate_to_fp8(tl.div_rn(a, scale[:, None])), scale


@triton.jit
def store_out(acc, bias_ptr, out_ptrs, cols, col_ok, out_mask, HAS_BIAS: tl.constexpr):
    """``acc`` (+ the bias of ``cols``) cast to the output's dtype, stored at ``out_ptrs``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def finish_split(acc, split, part_ptrs, split_stride, counter_ptr, bias_ptr, out_ptrs, cols, col_ok, out_mask,
                 HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store a program's float32 ``acc [R, C]``: unsplit, as the output (``store_out``); split, as
    split ``split``'s partial sums at ``part_ptrs + split * split_stride``, and the last of the
    ``SPLIT_K`` programs to arrive at ``counter_ptr`` (``arrive_last``) adds every split's partials
    in split order (deterministic) and stores them as the output."""
    if SPLIT_K > 1:
        tl.store(part_ptrs + split * split_stride, acc, mask=out_mask)
        if arrive_last(counter_ptr, SPLIT_K):
            acc = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptrs + s * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
            store_out(acc, bias_ptr, out_ptrs, cols, col_ok, out_mask, HAS_BIAS)
    else:
        store_out(acc, bias_ptr, out_ptrs, cols, col_ok, out_mask, HAS_BIAS)
