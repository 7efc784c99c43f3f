"""Paged attention over a KV cache owned by the engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model import kernels
from engine.model.attention_context import eager_region, get_context


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token on this rank: ``num_heads x head_dim`` for K,
    and as much again for V when ``separate_v`` (MLA: one latent head, no V cache)."""

    num_heads: int
    head_dim: int
    separate_v: bool = True

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 if self.separate_v else 1) * self.num_heads * self.head_dim * elem


class Attention(nn.Module):
    """`forward(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) -> [T, Hq, D]`.

    Stores this step's K/V in the cache bound by `engine.worker.kv_cache`, then
    attends: prefill through `varlen_attention` (on this step's K/V, or on
    every context token read back from the cache when a prefix is cached),
    decode through `paged_decode_attention` (one token per sequence); a mixed
    step's leading decode rows go to the latter, its prefill chunks to the former.
    `Hq`, `Hk` are this rank's heads. The layer never allocates cache memory.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_spec = KVCacheSpec(num_kv_heads, head_dim)  # what engine.worker.kv_cache binds for this layer
        self.k_cache = self.v_cache = None  # [num_blocks, block_size, Hk, D], bound by kv_cache.bind_kv_cache

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound (k_cache, v_cache); a clear error when none is bound."""
        if self.k_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; call engine.worker.kv_cache.bind_kv_cache first")
        return self.k_cache, self.v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
        """``kv_stored``: the caller already wrote this step's K/V to ``caches()`` (a fused prologue).
        A step with prefill chunks attends in an ``eager_region`` (between two pieces when it
        replays piecewise graphs)."""
        ctx = get_context()
        k_cache, v_cache = self.caches()
        if not kv_stored:
            kernels.store_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        if not ctx.has_prefill:
            return self._decode(q, ctx)
        return eager_region(self._attend_with_prefill, q, k, v, out_shape=(q.shape[0], self.num_heads, v.shape[-1]),
                            dtype=q.dtype)

    def _attend_with_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A step's leading decode rows through paged decode, its prefill chunks through varlen
        attention (on this step's K/V, or every context token's from the cache)."""
        ctx = get_context()
        d = ctx.num_decode_tokens
        if ctx.prefill_kv_slots is not None:  # every context token's K/V from the cache (in q's dtype)
            k = self.k_cache.flatten(0, 1).index_select(0, ctx.prefill_kv_slots).to(q.dtype)
            v = self.v_cache.flatten(0, 1).index_select(0, ctx.prefill_kv_slots).to(q.dtype)
        else:
            k, v = k[d:], v[d:]
        prefill = kernels.varlen_attention(q[d:], k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                           ctx.max_seqlen_q, ctx.max_seqlen_k, self.scale, causal=True)
        return torch.cat([self._decode(q[:d], ctx), prefill]) if d else prefill

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables,
                                              ctx.context_lens, self.scale)
