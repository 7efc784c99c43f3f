"""Tile helpers shared by the FP8 Triton kernels (``fp8.py``'s GEMM, ``fp8_gemv.py``): the
saturating e4m3 cast, per-row group quantization of an activation tile, and the epilogue that
adds a bias and stores in the output's dtype."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_MAX, SCALE_FLOOR

_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(SCALE_FLOOR)


@triton.jit
def saturate_to_fp8(v):
    """e4m3 of float32 ``v``: clamped to ±448 (saturated, never NaN), then rounded to 3 mantissa
    bits (nearest, ties to even) in its float32 bits, where a carry reaches the exponent, so the
    cast itself is exact (Triton's interpreter loses the carry of a rounding that crosses a
    power of two, and turns values past the e4m3 range into NaN)."""
    bits = tl.clamp(v, -_MAX, _MAX).to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return bits.to(tl.float32, bitcast=True).to(tl.float8e4nv)


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
