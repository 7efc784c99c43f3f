"""KV cache sizing and allocation: one paged cache per attention layer.

The pool is sized from the workload (`max_num_seqs x max_model_len` tokens,
rounded up to blocks) and capped by a fraction of the free device memory —
never blindly to the model's maximum context. The caches are allocated once
and bound to the layers; layers never allocate cache memory themselves.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.attention import Attention


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes one token takes on this rank, over all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * a.num_kv_heads * a.head_dim * elem for a in attention_layers(model))


def plan_num_blocks(bytes_per_token: int, block_size: int, max_num_seqs: int, max_model_len: int,
                    free_bytes: int | None = None, memory_utilization: float = 0.9) -> int:
    """Blocks for the workload, capped by `memory_utilization * free_bytes`
    when a free-memory figure is given (CUDA). Raises if not even one
    `max_model_len` sequence fits."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = max_num_seqs * blocks_per_seq
    if free_bytes is not None:
        affordable = int(free_bytes * memory_utilization) // (bytes_per_token * block_size)
        if affordable < blocks_per_seq:
            raise ValueError(
                f"KV cache does not fit: one sequence of max_model_len={max_model_len} needs "
                f"{blocks_per_seq * block_size * bytes_per_token / 2**30:.2f} GiB, but only "
                f"{free_bytes * memory_utilization / 2**30:.2f} GiB is available; lower max_model_len "
                f"or raise memory_utilization")
        num_blocks = min(num_blocks, affordable)
    return num_blocks


def bind_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> list[torch.Tensor]:
    """Allocate `[2, num_blocks, block_size, Hk, D]` per attention layer and bind
    its K and V halves to the layer. Returns the caches (layer order)."""
    caches = []
    for layer in attention_layers(model):
        cache = torch.zeros(2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim,
                            dtype=dtype, device=device)
        layer.k_cache, layer.v_cache = cache[0], cache[1]
        caches.append(cache)
    return caches
