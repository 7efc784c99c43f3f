"""Paged decode attention: split-K flash-decoding, in one launch or two.

Program (KV head x query-head block, sequence, split) scores a slice of the
context against every query head of that KV head at once (the head group is
padded to >= 16 rows for tl.dot); a sequence's KV heads are neighbours in the grid
(1.7 % faster over a bf16 cache on the H200). With one split (batches whose programs fill
the GPU) it writes the output itself: one launch. With several it writes a
normalised partial output and its log-sum-exp, and the splits are merged
either by a second launch (a program per sequence and head) or, with
``fused_merge``, by the last split of each (sequence, head block) to arrive
(``semaphores.arrive_last``): one launch. The number of splits
comes from host ints only (batch, heads, block-table width, SM count), never
from ``context_lens``, so the launch is CUDA-graph safe; each program sizes
its slice from its sequence's context length on the device, so a short
context in a wide table (a graph captured for max_model_len) is still spread
over every split instead of landing in the first one. Splits past the end of a
context write nothing and the merge reads only the active ones. A sequence with
context length 0 (no split has a token) gets a zero row, never 0/0.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton.attention_tiles import (
    NEG_BIG,
    head_dim_blocks,
    load_q,
    online_softmax_step,
    online_softmax_weights,
    scores_tile,
)
from engine.model.kernels.triton.host_math import cdiv, next_power_of_2
from engine.model.kernels.triton.launcher import launch_kernel
from engine.model.kernels.triton.semaphores import arrive_last, zeroed_counters

_LOG2E = 1.4426950408889634
# several splits merged by the last split to arrive (one launch) instead of by a merge launch: off
# until the H200 measures it faster (scripts/bench_kernels.py times both)
FUSED_MERGE = False
# the e4m3 cache's 128 x 3 launch: keys and values in 2 column chunks (149 registers a thread instead of 216),
# capped at 128: four 4-warp programs per sm90 SM (the compiler's own 216 leave two). On the H200 (256
# sequences x 512 tokens): 103.4 us; 2 chunks uncapped 110.5, unchunked capped at 168 116.1, 4 chunks 128.3
E4M3_CHUNKS, E4M3_MAX_REGISTERS = 2, 128
WRITE_PARTS, WRITE_OUT, MERGE_IN_LAST = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # the split kernel's result


@triton.jit
def _split_tokens(context, num_splits, BLOCK_N: tl.constexpr):
    """Tokens of each split of a ``context``-token sequence: whole tiles, as few as cover it in
    ``num_splits`` splits (the split kernel slices by it, the merge counts active splits by it)."""
    return tl.cdiv(tl.cdiv(context, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(q_ptr, qr_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
                         counters_ptr, scale_log2, num_heads, group, head_blocks, q_stride0, q_stride1, qr_stride0,
                         qr_stride1,
                         k_stride0, k_stride1, k_stride2, v_stride0, v_stride1, v_stride2, table_stride,
                         out_stride0, out_stride1,
                         HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, V_IS_K_MAIN: tl.constexpr,
                         RESULT: tl.constexpr, BLOCK_S: tl.constexpr, SEPARATE_ROPE: tl.constexpr,
                         DOT_F16: tl.constexpr, CHUNKS: tl.constexpr):
    head_prog = tl.program_id(0)  # grid (head programs, batch, splits): a sequence's KV heads side by side
    seq = tl.program_id(1).to(tl.int64)
    kv_head = head_prog // head_blocks
    num_splits = tl.num_programs(2)
    split = tl.program_id(2)
    g = (head_prog % head_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < group
    heads = kv_head * group + g
    if SEPARATE_ROPE:  # q holds the main block's channels, qr the tail's (MLA: latent | rope, never concatenated)
        q_main, _ = load_q(q_ptr, seq * q_stride0 + heads * q_stride1, g_mask, BLOCK_D, BLOCK_D, 0)
        q_tail, _ = load_q(qr_ptr, seq * qr_stride0 + heads * qr_stride1, g_mask, HEAD_DIM - BLOCK_D, BLOCK_TAIL, 0)
    else:
        q_main, q_tail = load_q(q_ptr, seq * q_stride0 + heads * q_stride1, g_mask, HEAD_DIM, BLOCK_D, BLOCK_TAIL)
    if DOT_F16:  # dots in fp16, to which e4m3 keys and values upcast exactly; q saturates at fp16's range
        q_main = tl.clamp(q_main.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_tail = tl.clamp(q_tail.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    context = tl.load(lens_ptr + seq)
    split_tokens = _split_tokens(context, num_splits, BLOCK_N)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, context)
    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    # the value channels in CHUNKS column blocks, each its own accumulator (acc1-3 unused below 4 chunks)
    CHUNK_V: tl.constexpr = BLOCK_DV // CHUNKS
    acc0 = tl.zeros([BLOCK_G, CHUNK_V], tl.float32)
    acc1 = tl.zeros([BLOCK_G, CHUNK_V], tl.float32)
    acc2 = tl.zeros([BLOCK_G, CHUNK_V], tl.float32)
    acc3 = tl.zeros([BLOCK_G, CHUNK_V], tl.float32)
    q_rows = q_ptr + seq * q_stride0 + heads * q_stride1
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < end
        blocks = tl.load(tables_ptr + seq * table_stride + tokens // PAGE, mask=valid, other=0).to(tl.int64)
        k_rows = blocks * k_stride0 + (tokens % PAGE) * k_stride1 + kv_head * k_stride2
        v_rows = blocks * v_stride0 + (tokens % PAGE) * v_stride1 + kv_head * v_stride2
        if CHUNKS == 1:
            scores, k_main = scores_tile(q_main, q_tail, k_ptr, k_rows, valid, HEAD_DIM, BLOCK_D, BLOCK_TAIL)
            if V_IS_K_MAIN:
                v = k_main
            else:
                dv = tl.arange(0, BLOCK_DV)
                v = tl.load(v_ptr + v_rows[:, None] + dv[None, :], mask=valid[:, None] & (dv < V_DIM)[None, :],
                            other=0.0).to(q_main.dtype)  # an FP8 cache's values upcast as they load
            m, denom, acc0 = online_softmax_step(scores, valid[None, :], m, denom, acc0, v, scale_log2)
        else:  # keys and values in column chunks: fewer registers live, more programs per SM
            scores = _chunked_scores(q_rows, g_mask, k_ptr, k_rows, valid, q_main.dtype, BLOCK_G, BLOCK_N,
                                     BLOCK_D // CHUNKS, CHUNKS, DOT_F16)
            m, denom, p, alpha = online_softmax_weights(scores, valid[None, :], m, denom, scale_log2)
            acc0 = _value_chunk(acc0, p, alpha, v_ptr, v_rows, valid, 0, q_main.dtype, CHUNK_V)
            acc1 = _value_chunk(acc1, p, alpha, v_ptr, v_rows, valid, CHUNK_V, q_main.dtype, CHUNK_V)
            if CHUNKS == 4:
                acc2 = _value_chunk(acc2, p, alpha, v_ptr, v_rows, valid, 2 * CHUNK_V, q_main.dtype, CHUNK_V)
                acc3 = _value_chunk(acc3, p, alpha, v_ptr, v_rows, valid, 3 * CHUNK_V, q_main.dtype, CHUNK_V)

    denom_safe = tl.where(denom > 0, denom, 1.0)  # no token (context 0): acc is 0, the row is 0
    active = g_mask & (start < context)  # a split past the end of its context writes nothing
    rows = (seq * num_heads + heads) * num_splits + split  # flat index into [B, Hq, splits]
    _store_chunk(acc0, denom_safe, 0, seq, heads, g_mask, active, rows, part_out_ptr, out_ptr, out_stride0,
                 out_stride1, V_DIM, CHUNK_V, RESULT)
    if CHUNKS > 1:
        _store_chunk(acc1, denom_safe, CHUNK_V, seq, heads, g_mask, active, rows, part_out_ptr, out_ptr,
                     out_stride0, out_stride1, V_DIM, CHUNK_V, RESULT)
    if CHUNKS == 4:
        _store_chunk(acc2, denom_safe, 2 * CHUNK_V, seq, heads, g_mask, active, rows, part_out_ptr, out_ptr,
                     out_stride0, out_stride1, V_DIM, CHUNK_V, RESULT)
        _store_chunk(acc3, denom_safe, 3 * CHUNK_V, seq, heads, g_mask, active, rows, part_out_ptr, out_ptr,
                     out_stride0, out_stride1, V_DIM, CHUNK_V, RESULT)
    if RESULT != WRITE_OUT:
        tl.store(part_lse_ptr + rows, m + tl.log2(denom_safe), mask=active)
        if RESULT == MERGE_IN_LAST:
            if arrive_last(counters_ptr + seq * tl.num_programs(0) + head_prog, num_splits):
                first = kv_head * group + (head_prog % head_blocks) * BLOCK_G
                for head in range(first, first + tl.minimum(BLOCK_G, kv_head * group + group - first)):
                    _merge_splits(part_out_ptr, part_lse_ptr, seq, head, num_heads, context, num_splits,
                                  out_ptr + seq * out_stride0 + head * out_stride1, V_DIM, BLOCK_DV, BLOCK_S, BLOCK_N)


@triton.jit
def _chunked_scores(q_rows, g_mask, k_ptr, k_rows, valid, dot_dtype: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, DOT_F16: tl.constexpr):
    """``q @ k.T`` for one key tile ([BLOCK_G, BLOCK_N] fp32) as CHUNKS dots over CHUNK-column slices
    of the query rows (re-read each tile: L1) and the keys (upcast to ``dot_dtype`` as they load)."""
    d = tl.arange(0, CHUNK)
    scores = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    for c in tl.static_range(CHUNKS):
        q = tl.load(q_rows[:, None] + c * CHUNK + d[None, :], mask=g_mask[:, None], other=0.0)
        if DOT_F16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
        k = tl.load(k_ptr + k_rows[:, None] + c * CHUNK + d[None, :], mask=valid[:, None], other=0.0)
        scores += tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)))
    return scores


@triton.jit
def _value_chunk(acc, p, alpha, v_ptr, v_rows, valid, first, dot_dtype: tl.constexpr, CHUNK: tl.constexpr):
    """``acc`` (one column chunk of the output, from channel ``first``) rescaled by ``alpha`` plus
    ``p @ v[:, first:first + CHUNK]`` for the tile's value rows."""
    d = first + tl.arange(0, CHUNK)
    v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(dot_dtype)
    return acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v)


@triton.jit
def _store_chunk(acc, denom, first, seq, heads, g_mask, active, rows, part_out_ptr, out_ptr, out_stride0,
                 out_stride1, V_DIM: tl.constexpr, CHUNK: tl.constexpr, RESULT: tl.constexpr):
    """Columns ``first ..`` of the normalised result: the output itself (one split) or the split's part."""
    d = first + tl.arange(0, CHUNK)
    part = acc / denom[:, None]
    if RESULT == WRITE_OUT:
        tl.store(out_ptr + seq * out_stride0 + heads[:, None] * out_stride1 + d[None, :],
                 part.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (d < V_DIM)[None, :])
    else:
        tl.store(part_out_ptr + rows[:, None] * V_DIM + d[None, :], part, mask=active[:, None] & (d < V_DIM)[None, :])


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, seq, head, num_heads, context, num_splits, out_row_ptr,
                  V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge the active splits of one (sequence, head) (those the split kernel gave tokens: the
    same slicing of the context), BLOCK_S splits per vectorised step, into ``out_row_ptr``. Parts
    are read from L2 (``.cg``): in the one-launch merge other programs wrote them."""
    row = seq * num_heads + head
    num_active = tl.cdiv(context, tl.maximum(_split_tokens(context, num_splits, BLOCK_N), 1))
    dv = tl.arange(0, BLOCK_DV)
    s = tl.arange(0, BLOCK_S)
    m = tl.max(tl.full([BLOCK_S], NEG_BIG, tl.float32), axis=0)
    weight_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for chunk in range(0, num_active, BLOCK_S):
        splits = chunk + s
        ok = splits < num_active
        lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_out_ptr + (row * num_splits + splits)[:, None] * V_DIM + dv[None, :],
                       mask=ok[:, None] & (dv < V_DIM)[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        weight_sum = weight_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / tl.where(weight_sum > 0, weight_sum, 1.0)  # no split had a token: acc is 0, the row is 0
    tl.store(out_row_ptr + dv, out.to(out_row_ptr.dtype.element_ty), mask=dv < V_DIM)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, num_splits, out_stride0, out_stride1,
                         V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """The second launch: program (sequence, head) merges that head's splits."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    _merge_splits(part_out_ptr, part_lse_ptr, seq, head, tl.num_programs(1), tl.load(lens_ptr + seq), num_splits,
                  out_ptr + seq * out_stride0 + head * out_stride1, V_DIM, BLOCK_DV, BLOCK_S, BLOCK_N)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                           v_head_dim: int | None = None, q_rope: torch.Tensor | None = None,
                           num_splits: int | None = None, fused_merge: bool | None = None,
                           block_n: int | None = None, num_stages: int | None = None,
                           fp16_dots: bool | None = None, max_registers: int | None = None,
                           chunks: int | None = None) -> torch.Tensor:
    """See ``engine.model.kernels.paged_decode_attention``. ``num_splits`` (None = from the shapes and the
    SM count) sets how many slices of each sequence's context run in parallel; ``fused_merge``
    (None = ``FUSED_MERGE``) merges several splits in the split kernel's last program instead
    of a second launch. One split never needs a merge. ``block_n`` (a power of two >= 16) is the
    key tile a loop step loads and ``num_stages`` how many tiles the compiler keeps in flight;
    ``fp16_dots`` runs both dots in fp16, to which e4m3 upcasts in one instruction and exactly
    (bf16 takes several), the query saturated at fp16's +-65504 and rounded to 11 significant bits
    (bf16 keeps 8). ``max_registers`` caps the split kernel's registers per thread, trading spills
    for programs resident per SM (sm90: 65,536 registers, 128 threads a program). None picks what
    the H200 measured fastest at the offline throughput's 256 sequences (``scripts/bench_kernels.py
    --only decode_fp8``, 512 tokens of context): a bf16 cache 64 x 2, registers uncapped (141.7 us,
    3.8 TB/s; capped at 96 or 80 it took 161); an e4m3 cache of head dim 128 or less under a bf16
    query 128 x 3 with fp16 dots in ``E4M3_CHUNKS`` column chunks under ``E4M3_MAX_REGISTERS``
    (103.4 us, 2.6 TB/s; unchunked 131.3 uncapped, where the compiler took 216 registers: two
    programs per SM); any other (MLA's wide heads 32 x 2, not measured over
    e4m3) the bf16 cache's launch. ``chunks`` (1, 2 or 4; None: as above) splits the key and value
    channels into that many column blocks, a dot and an accumulator each, so fewer registers are
    live at once (the e4m3 128 x 3 launch: 216 at 1, 149 at 2, 110 at 4; sm90 ptxas); only where the head is
    one power-of-two block of at least 16 channels a chunk for keys and values (not MLA's). ``q_rope`` is
    read in place when ``q`` fills the head dim's main block exactly (MLA: 512 | 64), else
    concatenated first."""
    head_dim = k_cache.shape[3]
    block_d, block_tail = head_dim_blocks(head_dim)
    if q_rope is not None and (q.shape[2] != block_d or q_rope.stride(-1) != 1):
        q, q_rope = torch.cat([q, q_rope], dim=-1), None
    batch, num_heads, _ = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    v_dim = v_head_dim if v_cache is None else v_cache.shape[3]
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or (v_cache is not None and v_cache.stride(-1) != 1):
        raise ValueError("paged_decode_attention: q and caches need a contiguous last dim")
    values = k_cache if v_cache is None else v_cache
    group = num_heads // num_kv_heads
    block_dv = max(16, next_power_of_2(v_dim))
    wide = block_d + block_tail + block_dv > 512
    block_g = min(max(16, next_power_of_2(group)), 16 if wide else 64)
    if batch > 65535:  # the grid's y dimension
        raise ValueError(f"paged_decode_attention: at most 65,535 sequences a launch, got {batch}")
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    measured = e4m3 and block_d + block_tail <= 128  # the e4m3 launch measured (head dim 128; not MLA's 576)
    if fp16_dots is None:
        fp16_dots = measured and q.dtype == torch.bfloat16
    elif fp16_dots and not e4m3:
        raise ValueError("paged_decode_attention: fp16_dots needs an e4m3 cache (a bf16 one can overflow fp16)")
    if block_n is None:
        block_n = 32 if wide else 128 if measured else 64
    if num_stages is None:
        num_stages = 3 if measured else 2
    e4m3_launch = measured and fp16_dots and (block_n, num_stages) == (128, 3)
    def chunkable(n: int) -> bool:  # n column chunks of >= 16 channels of one power-of-two head, K and V
        return n in (1, 2, 4) and (n == 1 or (not block_tail and q_rope is None and v_cache is not None
                                              and v_dim == block_dv and block_d // n >= 16))
    if chunks is None:
        chunks = E4M3_CHUNKS if e4m3_launch and chunkable(E4M3_CHUNKS) else 1
    if max_registers is None and e4m3_launch and chunks == E4M3_CHUNKS:
        max_registers = E4M3_MAX_REGISTERS
    if not chunkable(chunks):
        raise ValueError(f"paged_decode_attention: chunks={chunks} needs 1, 2 or 4 column blocks of at least 16 "
                         "channels of one power-of-two head (keys and values), no separate rope")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_decode_attention: block_n must be a power of two >= 16, got {block_n}")
    head_blocks = cdiv(group, block_g)
    capacity = block_tables.shape[1] * page
    programs = batch * num_kv_heads * head_blocks
    if num_splits is None:
        num_splits = max(1, min(cdiv(2 * _num_sms(q.device), programs), cdiv(capacity, block_n)))
    fused = FUSED_MERGE if fused_merge is None else fused_merge
    result = (WRITE_OUT if num_splits == 1 else MERGE_IN_LAST if fused else WRITE_PARTS).value  # a plain int

    out = torch.empty(batch, num_heads, v_dim, dtype=q.dtype, device=q.device)
    part_out = part_lse = out  # unused with one split: any pointer serves
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    counters = zeroed_counters(q.device, programs) if result == MERGE_IN_LAST.value else context_lens
    block_s = max(1, min(next_power_of_2(num_splits), 4096 // block_dv))
    rope = q if q_rope is None else q_rope
    launch_kernel(_decode_split_kernel, (num_kv_heads * head_blocks, batch, num_splits),
        q, rope, k_cache, values, block_tables, context_lens, part_out, part_lse, out, counters,
        softmax_scale * _LOG2E, num_heads, group, head_blocks, q.stride(0), q.stride(1), rope.stride(0), rope.stride(1),
        *k_cache.stride()[:3],
        *values.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, V_DIM=v_dim, PAGE=page, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_TAIL=block_tail, BLOCK_DV=block_dv, V_IS_K_MAIN=v_cache is None and block_dv == block_d,
        RESULT=result, BLOCK_S=block_s, SEPARATE_ROPE=q_rope is not None,
        DOT_F16=fp16_dots, CHUNKS=chunks, num_warps=4, num_stages=num_stages, maxnreg=max_registers)
    if result == WRITE_PARTS.value:
        launch_kernel(_decode_merge_kernel, (batch, num_heads), part_out, part_lse, context_lens, out, num_splits,
                      out.stride(0), out.stride(1), V_DIM=v_dim, BLOCK_DV=block_dv, BLOCK_S=block_s, BLOCK_N=block_n)
    return out
