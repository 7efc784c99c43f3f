"""KV cache sizing and allocation: one paged cache per attention layer, shaped by the layer's spec.

Each cache-owning layer declares what it stores per token (its ``kv_spec``, a ``KVCacheSpec``,
``engine.model.layers.attention``):
K and V of ``num_heads x head_dim`` each (``Attention``), or one entry with no
separate V (MLA's latent: ``kv_lora_rank + qk_rope_head_dim`` channels shared
by every head, stored once). The pool is sized from the workload
(`max_num_seqs x max_model_len` tokens, rounded up to blocks) and capped by a
memory budget: a fraction of the memory free after loading (the device's on
CUDA, the host's on CPU: ``free_memory_bytes``), or a budget given outright —
never blindly to the model's maximum context. The caches are allocated once and
bound to the layers; layers never allocate cache memory themselves.
"""
from __future__ import annotations

import math
import os

import torch
from torch import nn

from engine.model.layers.attention import KVCacheSpec


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that own a KV cache, in module order: every layer that declares a ``kv_spec``
    (``Attention``: K/V of its local KV heads; MLA: its latent)."""
    return [m for m in model.modules() if isinstance(getattr(m, "kv_spec", None), KVCacheSpec)]


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes one token takes on this rank, over all layers (K and V, or MLA's one latent)."""
    return sum(layer.kv_spec.bytes_per_token(dtype) for layer in attention_layers(model))


def free_memory_bytes(device: torch.device) -> int:
    """Bytes of memory free for the KV cache on ``device``: the CUDA device's free memory, else the
    host's available memory (``MemAvailable`` of /proc/meminfo; free physical pages elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_blocks(bytes_per_token: int, block_size: int, max_num_seqs: int, max_model_len: int,
                    free_bytes: int | None = None, memory_utilization: float = 0.9) -> int:
    """Blocks for the workload, capped by `memory_utilization * free_bytes`
    when a free-memory figure is given. Raises, naming the flags that size it, if not even one
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
                f"{free_bytes * memory_utilization / 2**30:.2f} GiB is available for it; lower --max-model-len, "
                f"or raise --mem-utilization or --kv-cache-memory (GiB)")
        num_blocks = min(num_blocks, affordable)
    return num_blocks


def bind_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> list[torch.Tensor]:
    """Allocate each cache-owning layer's cache from its spec and bind it: K/V layers get
    ``[2, num_blocks, block_size, Hk, D]`` (``k_cache`` / ``v_cache`` its halves), MLA layers
    ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` as ``k_cache`` with ``v_cache``
    None. Returns the caches (layer order)."""
    caches = []
    for layer in attention_layers(model):
        spec = layer.kv_spec
        shape = (num_blocks, block_size, spec.num_heads, spec.head_dim)
        if spec.separate_v:
            cache = torch.zeros(2, *shape, dtype=dtype, device=device)
            layer.k_cache, layer.v_cache = cache[0], cache[1]
        else:
            cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.k_cache, layer.v_cache = cache, None
        caches.append(cache)
    return caches
