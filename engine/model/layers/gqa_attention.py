"""Grouped-query attention, the dense family's (Qwen2, Qwen3, Llama, Mistral; Qwen MoE's too):
one QKV GEMM, Qwen3's per-head q/k norms, neox RoPE, the paged K/V cache and o_proj."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model import kernels
from engine.model.attention_context import get_context
from engine.model.config import ModelConfig
from engine.model.layers.attention import Attention
from engine.model.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding


class GQAAttention(nn.Module):
    """hidden [T, H] -> [T, H]: one QKV GEMM; (Qwen3) per-head q/k RMSNorm (eps
    ``config.rms_norm_eps``, as transformers'), neox RoPE and the
    K/V cache write in one op (``kernels.qk_norm_rope_store``); paged attention; o_proj with
    one all-reduce. ``input_size``: the width of ``hidden`` (default ``config.hidden_size``; an
    EAGLE-3 head's layer reads its embedding and hidden state side by side, twice that).
    Attention is full causal: a checkpoint with a sliding window that can bind
    (``config.sliding_window``) is refused here, never run as if it had none."""

    def __init__(self, config: ModelConfig, tp: TPGroup, input_size: int | None = None):
        super().__init__()
        if config.sliding_window is not None:
            raise ValueError(f"sliding_window = {config.sliding_window} in config.json ({config.architecture}): "
                             "sliding-window attention is not implemented (attention here is full causal, which "
                             f"differs once a context exceeds {config.sliding_window} tokens); use --backend hf")
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=False, tp=tp)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = RotaryEmbedding(d, d, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling, is_neox=True)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale=d ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        d = self.attn.head_dim
        q = q.reshape(-1, self.num_heads, d)
        k = k.reshape(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        k_cache, v_cache = self.attn.caches()
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        kernels.qk_norm_rope_store(positions, q, k, v, *norms, self.rotary_emb.cos_sin_cache, k_cache, v_cache,
                                   get_context().slot_mapping)
        out = self.attn(q, k, v, kv_stored=True)
        return self.o_proj(out.flatten(1))
