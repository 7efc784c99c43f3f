"""The per-step attention context: how this step's flat token tensor maps onto
sequences and onto the paged KV cache.

The runner builds it once per forward (`prefill_context` / `decode_context`),
installs it with `set_context`, and clears it with `reset_context`; attention
layers read it with `get_context`, so model forwards stay
`forward(input_ids, positions)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class AttentionContext:
    is_prefill: bool
    slot_mapping: torch.Tensor                 # int64 [T]: flat cache slot of each token, -1 = padding
    cu_seqlens_q: torch.Tensor | None = None   # int32 [B+1], prefill: query tokens per sequence
    cu_seqlens_k: torch.Tensor | None = None   # int32 [B+1], prefill: context tokens per sequence
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefill_kv_slots: torch.Tensor | None = None  # int64 [Tk]: prefill reads K/V of every context token
                                                  # from these cache slots (set when a prefix is cached)
    block_tables: torch.Tensor | None = None   # int32 [B, max_blocks], decode
    context_lens: torch.Tensor | None = None   # int32 [B], decode: tokens in cache incl. this step's


_CONTEXT: AttentionContext | None = None


def set_context(ctx: AttentionContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> AttentionContext:
    if _CONTEXT is None:
        raise RuntimeError("no attention context is set: the runner must call set_context() before a forward")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None


def _slots(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def prefill_context(seq_lens: Sequence[int], cached_lens: Sequence[int],
                    block_tables: Sequence[Sequence[int]], block_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [T] (int64) and the context for prefilling sequences of
    `seq_lens` tokens whose first `cached_lens` tokens are already in the cache.
    T = sum(seq_lens - cached_lens); the K/V of the new tokens go to their slots.
    """
    positions, slots, cu_q, cu_k, kv_slots = [], [], [0], [0], []
    for n, cached, table in zip(seq_lens, cached_lens, block_tables, strict=True):
        if not 0 <= cached < n:
            raise ValueError(f"cached tokens ({cached}) must be in [0, {n}) for a sequence of {n} tokens")
        if len(table) * block_size < n:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
        positions.extend(range(cached, n))
        slots.extend(_slots(table, block_size, cached, n))
        kv_slots.extend(_slots(table, block_size, 0, n))
        cu_q.append(cu_q[-1] + n - cached)
        cu_k.append(cu_k[-1] + n)
    as_tensor = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=device)
    ctx = AttentionContext(
        is_prefill=True,
        slot_mapping=as_tensor(slots, torch.int64),
        cu_seqlens_q=as_tensor(cu_q, torch.int32),
        cu_seqlens_k=as_tensor(cu_k, torch.int32),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max_seqlen_k=max(seq_lens),
        prefill_kv_slots=as_tensor(kv_slots, torch.int64) if any(cached_lens) else None,
    )
    return as_tensor(positions, torch.int64), ctx


def decode_context(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [B] and the context for one decode token per sequence; the
    token of sequence i sits at position context_lens[i] - 1."""
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    positions = [n - 1 for n in context_lens]
    slots = [_slots(t, block_size, p, p + 1)[0] for t, p in zip(block_tables, positions, strict=True)]
    ctx = AttentionContext(
        is_prefill=False,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), ctx
