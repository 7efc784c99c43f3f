"""The per-step attention context: how this step's flat token tensor maps onto sequences and onto
the paged KV cache.

The runner builds one per forward pass (token ``i`` of a sequence goes to cache slot
``cache_slots``: its block's id x block_size + its offset in the block) and sets it for that pass
with ``forward_context(ctx)``; attention layers read it with ``get_context()``, so model forwards
stay ``forward(input_ids, positions)``. A context is set for one pass at a time: setting one inside
another is an error, and none is left behind when the pass ends (or raises).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    """``has_prefill`` False: every token is a decode token (one query per sequence, paged decode
    over ``block_tables`` / ``context_lens``). ``has_prefill`` True: the first
    ``num_decode_tokens`` tokens are such decode tokens (a mixed step) and the rest are prefill
    chunks, laid out by ``cu_seqlens_q`` / ``cu_seqlens_k`` (offsets into the prefill tokens)."""

    has_prefill: bool
    slot_mapping: torch.Tensor                 # int64 [T]: flat cache slot of each token, -1 = padding
    cu_seqlens_q: torch.Tensor | None = None   # int32 [P+1], prefill: query tokens per prefill sequence
    cu_seqlens_k: torch.Tensor | None = None   # int32 [P+1], prefill: context tokens per prefill sequence
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefill_kv_slots: torch.Tensor | None = None  # int64 [Tk]: prefill reads K/V of every context token
                                                  # from these cache slots (set when a prefix is cached)
    block_tables: torch.Tensor | None = None   # int32 [D, max_blocks], decode tokens
    context_lens: torch.Tensor | None = None   # int32 [D], decode tokens: tokens in cache incl. this step's
    num_decode_tokens: int = 0                 # with prefill: leading decode tokens (a mixed step)


def cache_slots(block_tables: torch.Tensor, table_rows: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Flat KV cache slots (int64) of the tokens at ``positions`` of the sequences whose block
    tables are rows ``table_rows`` of ``block_tables``."""
    blocks = block_tables[table_rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


_current = threading.local()  # per thread: engines in several threads of one process each run their own steps


@contextmanager
def forward_context(ctx: AttentionContext) -> Iterator[AttentionContext]:
    """Set ``ctx`` for the forward pass run inside; a context already set is an error (passes
    never nest)."""
    if getattr(_current, "ctx", None) is not None:
        raise RuntimeError("an attention context is already set: forward passes do not nest")
    _current.ctx = ctx
    try:
        yield ctx
    finally:
        _current.ctx = None


def get_context() -> AttentionContext:
    ctx = getattr(_current, "ctx", None)
    if ctx is None:
        raise RuntimeError("no attention context is set: run the forward inside forward_context(ctx)")
    return ctx


def eager_region(fn: Callable[..., torch.Tensor], *args: torch.Tensor, out_shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """``fn(*args)``: the part of a forward that depends on this step's context beyond its slots
    (the attention of a step with prefill chunks), returning a tensor of ``out_shape`` and
    ``dtype`` whose rows (dim 0, as every arg's) are tokens. It simply runs, except while a
    piecewise CUDA-graph capture splits the forward (``splitting_at_eager_regions``): then the
    capture's ``split`` takes it and returns the buffer the rest of the forward reads."""
    split = getattr(_current, "split", None)
    return fn(*args) if split is None else split(fn, args, out_shape, dtype)


@contextmanager
def splitting_at_eager_regions(split: Callable) -> Iterator[None]:
    """While inside, ``eager_region(fn, *args, out_shape=..., dtype=...)`` returns
    ``split(fn, args, out_shape, dtype)`` on this thread (``engine.worker.piecewise_graphs``)."""
    _current.split = split
    try:
        yield
    finally:
        _current.split = None
