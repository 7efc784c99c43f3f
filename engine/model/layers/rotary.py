"""Rotary position embedding applied in place to q and k."""
from __future__ import annotations

import torch
from torch import nn

from engine.model import kernels


class RotaryEmbedding(nn.Module):
    """Rotates `query [T, Hq, D]` and `key [T, Hk, D]` in place by `positions [T]`.

    The cos/sin table comes from the module-level registry
    (`kernels.get_cos_sin_cache`), so layers with equal parameters share one
    table. `attn_scale` is the factor YaRN asks the softmax scale to take (1.0
    otherwise). `is_neox`: half-split pairs (Qwen) vs interleaved (DeepSeek).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None, is_neox: bool = True):
        super().__init__()
        self.head_size = head_size
        self.is_neox = is_neox
        self.cos_sin_cache, self.attn_scale = kernels.get_cos_sin_cache(
            max_position, rotary_dim, base, rope_scaling, dtype=torch.float32,
            device=torch.get_default_device())

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None) -> None:
        kernels.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox)
