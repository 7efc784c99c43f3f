"""The per-step attention context: how this step's flat token tensor maps onto
sequences and onto the paged KV cache.

The runner builds it once per forward (`prefill_context` / `decode_context`),
installs it with `set_context`, and clears it with `reset_context`; attention
layers read it with `get_context`, so model forwards stay
`forward(input_ids, positions)`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class AttentionContext:
    """``is_prefill`` False: every token is a decode row (one query per sequence, paged decode
    over ``block_tables`` / ``context_lens``). ``is_prefill`` True: the first
    ``num_decode_tokens`` tokens are such decode rows (a mixed step) and the rest are prefill
    chunks, laid out by ``cu_seqlens_q`` / ``cu_seqlens_k`` (offsets into the prefill tokens)."""

    is_prefill: bool
    slot_mapping: torch.Tensor                 # int64 [T]: flat cache slot of each token, -1 = padding
    cu_seqlens_q: torch.Tensor | None = None   # int32 [P+1], prefill: query tokens per prefill sequence
    cu_seqlens_k: torch.Tensor | None = None   # int32 [P+1], prefill: context tokens per prefill sequence
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefill_kv_slots: torch.Tensor | None = None  # int64 [Tk]: prefill reads K/V of every context token
                                                  # from these cache slots (set when a prefix is cached)
    block_tables: torch.Tensor | None = None   # int32 [D, max_blocks], decode rows
    context_lens: torch.Tensor | None = None   # int32 [D], decode rows: tokens in cache incl. this step's
    num_decode_tokens: int = 0                 # prefill steps: leading decode rows (a mixed step)


_current = threading.local()  # per thread: engines in several threads of one process each run their own steps


def set_context(ctx: AttentionContext) -> None:
    _current.ctx = ctx


def get_context() -> AttentionContext:
    ctx = getattr(_current, "ctx", None)
    if ctx is None:
        raise RuntimeError("no attention context is set: the runner must call set_context() before a forward")
    return ctx


def reset_context() -> None:
    _current.ctx = None


def _slots(block_table: torch.Tensor, block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Flat cache slots of token positions of one sequence (int64 CPU tensors)."""
    return block_table[positions // block_size] * block_size + positions % block_size


def prefill_context(seq_lens: Sequence[int], cached_lens: Sequence[int],
                    block_tables: Sequence[Sequence[int]], block_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [T] (int64) and the context for prefilling sequences of
    `seq_lens` tokens whose first `cached_lens` tokens are already in the cache.
    T = sum(seq_lens - cached_lens); the K/V of the new tokens go to their slots.
    Built on the host, then copied to `device` once per tensor.
    """
    positions, slots, kv_slots = [], [], []
    for n, cached, table in zip(seq_lens, cached_lens, block_tables, strict=True):
        if not 0 <= cached < n:
            raise ValueError(f"cached tokens ({cached}) must be in [0, {n}) for a sequence of {n} tokens")
        if len(table) * block_size < n:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
        table = torch.tensor(table, dtype=torch.int64)
        every = torch.arange(n)
        positions.append(every[cached:])
        kv_slots.append(_slots(table, block_size, every))
        slots.append(kv_slots[-1][cached:])
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    q_lens = seq_lens_t - torch.tensor(cached_lens, dtype=torch.int32)

    def cumsum(lens):
        return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])

    ctx = AttentionContext(
        is_prefill=True,
        slot_mapping=torch.cat(slots).to(device),
        cu_seqlens_q=cumsum(q_lens).to(device),
        cu_seqlens_k=cumsum(seq_lens_t).to(device),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(seq_lens_t.max()),
        prefill_kv_slots=torch.cat(kv_slots).to(device) if any(cached_lens) else None,
    )
    return torch.cat(positions).to(device), ctx


def decode_context(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str) -> tuple[torch.Tensor, AttentionContext]:
    """Positions [B] and the context for one decode token per sequence; the
    token of sequence i sits at position context_lens[i] - 1. Block tables are
    padded with block 0 to the widest (entries past a context are never read)."""
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    positions = lens - 1
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    ctx = AttentionContext(
        is_prefill=False,
        slot_mapping=slots.to(device),
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=lens.to(device=device, dtype=torch.int32),
    )
    return positions.to(device), ctx
