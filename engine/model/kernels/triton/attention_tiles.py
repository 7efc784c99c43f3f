"""Pieces shared by the decode and prefill attention kernels.

Head dims that are not a power of two (192 = 128 + 64, MLA's 576 = 512 + 64)
are split into a power-of-two main block and a small tail block instead of
being padded to the next power of two (which would nearly double 576).
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.model.kernels.triton.host_math import next_power_of_2

# Finite stand-in for -inf as the initial running max: keeps exp2(m_old - m_new) = 0 without NaNs.
NEG_BIG = tl.constexpr(-1.0e30)


def head_dim_blocks(head_dim: int) -> tuple[int, int]:
    """(main, tail) power-of-two blocks covering ``head_dim``; tail is 0 or >= 16 (tl.dot's minimum)."""
    main = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - main
    return max(main, 16), 0 if rest == 0 else max(16, next_power_of_2(rest))


@triton.jit
def scores_tile(q_main, q_tail, k_ptr, row_offsets, row_mask, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """``q @ k.T`` for one key tile; returns (scores [M, N] fp32, the key tile's main block in q's
    dtype: an FP8 cache's keys are upcast as they load)."""
    d = tl.arange(0, BLOCK_D)
    k_main = tl.load(k_ptr + row_offsets[:, None] + d[None, :], mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
                     other=0.0).to(q_main.dtype)
    scores = tl.dot(q_main, tl.trans(k_main))
    if BLOCK_TAIL > 0:
        d_tail = BLOCK_D + tl.arange(0, BLOCK_TAIL)
        k_tail = tl.load(k_ptr + row_offsets[:, None] + d_tail[None, :],
                         mask=row_mask[:, None] & (d_tail < HEAD_DIM)[None, :], other=0.0).to(q_tail.dtype)
        scores += tl.dot(q_tail, tl.trans(k_tail))
    return scores, k_main


@triton.jit
def load_q(q_ptr, row_offsets, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_TAIL: tl.constexpr):
    """The (main, tail) blocks of query rows at ``q_ptr + row_offsets``; tail is a dummy when absent."""
    d = tl.arange(0, BLOCK_D)
    q_main = tl.load(q_ptr + row_offsets[:, None] + d[None, :], mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
                     other=0.0)
    q_tail = q_main
    if BLOCK_TAIL > 0:
        d_tail = BLOCK_D + tl.arange(0, BLOCK_TAIL)
        q_tail = tl.load(q_ptr + row_offsets[:, None] + d_tail[None, :],
                         mask=row_mask[:, None] & (d_tail < HEAD_DIM)[None, :], other=0.0)
    return q_main, q_tail


@triton.jit
def online_softmax_weights(scores, allowed, m, denom, scale_log2):
    """One tile of raw ``scores`` (entries outside ``allowed`` ignored) folded into the running max
    ``m`` and denominator ``denom`` (base-2 exponent): (new max, new denominator, the tile's weights
    ``p``, the factor ``alpha`` that rescales what was accumulated before)."""
    s = tl.where(allowed, scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return m_new, denom * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def online_softmax_step(scores, allowed, m, denom, acc, v, scale_log2):
    """Fold one tile of raw ``scores`` (entries outside ``allowed`` ignored) and its values ``v``
    into the running max ``m``, denominator ``denom`` and output accumulator ``acc`` (base-2 exponent)."""
    m_new, denom, p, alpha = online_softmax_weights(scores, allowed, m, denom, scale_log2)
    return m_new, denom, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
