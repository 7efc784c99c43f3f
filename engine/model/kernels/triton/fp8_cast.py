"""The one saturating e4m3 cast every Triton kernel uses: FP8 weights' activation quantization
(phase 12) and stores into an FP8 KV cache."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.model.kernels import FP8_MAX

_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def saturate_to_fp8(v):
    """e4m3 of float32 ``v``: clamped to ±448 (saturated, never NaN), then rounded to 3 mantissa
    bits (nearest, ties to even) in its float32 bits, where a carry reaches the exponent, so the
    cast itself is exact (Triton's interpreter loses the carry of a rounding that crosses a
    power of two, and turns values past the e4m3 range into NaN)."""
    bits = tl.clamp(v, -_MAX, _MAX).to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return bits.to(tl.float32, bitcast=True).to(tl.float8e4nv)
