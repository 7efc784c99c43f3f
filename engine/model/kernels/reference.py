"""Torch reference backend: the readable definition of every op and the CPU path.

Plain vectorised torch in the input dtype, with float32 where the contract asks
for it. Only ``varlen_attention`` loops (over sequences, reading
``cu_seqlens`` on the host), which is fine on CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.kernels import FP8_DTYPE, FP8_MAX


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    x = input.float()
    out.copy_(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float())


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(input)
    rms_norm(input, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    gate, up = input.chunk(2, dim=-1)
    torch.mul(F.silu(gate), up, out=out)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2]
    for x in (query,) if key is None else (query, key):
        x = x.view(x.shape[0], -1, head_size)[..., :rotary_dim]
        if is_neox:
            x1, x2 = x[..., : rotary_dim // 2], x[..., rotary_dim // 2:]
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated1, rotated2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x1.copy_(rotated1)
        x2.copy_(rotated2)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pairs = [(key, k_cache)] if value is None else [(key, k_cache), (value, v_cache)]
    for src, cache in pairs:
        flat = cache.view(-1, *cache.shape[2:])
        rows = src.view(src.shape[0], *cache.shape[2:])[keep]
        flat[slots] = rows.float().clamp(-FP8_MAX, FP8_MAX).to(cache.dtype) if cache.dtype == FP8_DTYPE else rows


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool = True) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    masks: dict[tuple[int, int], torch.Tensor] = {}  # one per (q_len, k_len): sequences of a batch share them
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        if q1 == q0:
            continue
        # Bottom-right causal: query i sees keys 0 .. (k_len - q_len) + i.
        mask = None
        if causal and q1 - q0 != k1 - k0:
            mask = masks.get((q1 - q0, k1 - k0))
            if mask is None:
                mask = masks[q1 - q0, k1 - k0] = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool,
                                                            device=q.device).tril(k1 - k0 - (q1 - q0))
        attended = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=mask, is_causal=causal and mask is None, scale=softmax_scale, enable_gqa=True)
        out[q0:q1] = attended.transpose(0, 1)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                           v_head_dim: int | None = None, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    if q_rope is not None:
        q = torch.cat([q, q_rope], dim=-1)
    tables, rows, ranks, lens = _rows_by_table(block_tables, context_lens)
    num_tables, width = lens.shape
    if rows is None:
        queries = q[:, None]
    else:
        queries = q.new_zeros(num_tables, width, *q.shape[1:])
        queries[rows, ranks] = q

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [U, max_blocks * block_size, Hk, D], once per table
        blocks = cache.index_select(0, tables.clamp(min=0).flatten())
        return blocks.view(num_tables, -1, *cache.shape[2:]).float()

    keys = gather(k_cache)
    values = keys[..., :v_head_dim] if v_cache is None else gather(v_cache)
    within_context = torch.arange(keys.shape[1], device=q.device) < lens[..., None].long()  # [U, width, S]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2).float(), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=within_context[:, None],
                                         scale=softmax_scale, enable_gqa=True).transpose(1, 2)
    out = out.masked_fill((lens == 0)[..., None, None], 0.0)  # softmax over nothing: a zero row, never NaN
    out = out[:, 0] if rows is None else out[rows, ranks]
    return out.to(q.dtype)


def _rows_by_table(block_tables: torch.Tensor, context_lens: torch.Tensor):
    """The query rows of ``block_tables [B, W]`` grouped by table (a verify step's tokens, or a
    draft's catch-up, share their sequence's), so that each table's cache is gathered once: (the
    U distinct tables [U, W], each row's table [B], its rank among the rows of that table [B],
    the context lengths [U, width] of each table's rows in rank order, 0 past its count). Rows and
    ranks are None where no two rows share a table, and on a GPU (grouping reads sizes on the
    host, which a CUDA graph cannot capture)."""
    if block_tables.device.type == "cpu" and len(block_tables) > 1:
        tables, rows = torch.unique(block_tables, dim=0, return_inverse=True)
        if len(tables) == 1:  # one sequence's tokens (a B=1 verify step or catch-up)
            return tables, rows, torch.arange(len(rows)), context_lens[None]
        if len(tables) < len(block_tables):
            order = torch.argsort(rows, stable=True)
            counts = torch.bincount(rows, minlength=len(tables))
            ranks = torch.empty_like(rows)
            ranks[order] = torch.arange(len(rows)) - (counts.cumsum(0) - counts)[rows[order]]
            lens = context_lens.new_zeros(len(tables), int(counts.max()))
            lens[rows, ranks] = context_lens
            return tables, rows, ranks, lens
    return block_tables, None, None, context_lens[:, None]


def expert_gemv(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    out = torch.einsum("tjnk,tk->tjn", weights[expert_ids.clamp(min=0)].float(), x.float())
    return out.masked_fill_((expert_ids < 0)[..., None], 0.0).to(x.dtype)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None) -> torch.Tensor:
    if activation == "silu_mul":
        act = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        silu_and_mul(act, x)
        x = act
    dtype = torch.promote_types(x.dtype, weight.dtype)
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    if q_weight is not None:
        rms_norm(q, q, q_weight, eps)
        rms_norm(k, k, k_weight, eps)
    rotary_embedding(positions, q, k, q.shape[-1], cos_sin_cache, True)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
