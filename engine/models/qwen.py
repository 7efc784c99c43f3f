"""Qwen2 / Qwen3 dense decoder (GQA attention, SwiGLU MLP, RMSNorm, neox RoPE)."""
from __future__ import annotations

import torch
from torch import nn

from engine import kernels
from engine.attention_context import get_context
from engine.config import ModelConfig
from engine.distributed import TPGroup, get_tp_group
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


class QwenAttention(nn.Module):
    """hidden [T, H] -> [T, H]: one QKV GEMM; (Qwen3) per-head q/k RMSNorm, neox RoPE and the
    K/V cache write in one op (``kernels.qk_norm_rope_store``); paged attention; o_proj with
    one all-reduce."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
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


class QwenMLP(nn.Module):
    """SwiGLU: one gate-up GEMM, silu_and_mul, down_proj with one all-reduce."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = torch.empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        kernels.silu_and_mul(act, gate_up)
        return self.down_proj(act)


class QwenDecoderLayer(nn.Module):
    """(hidden, residual) -> (hidden, residual) with the fused residual chain:
    the first layer's residual is None, later layers add in `fused_add_rms_norm`,
    each norm with this layer's own weights."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.self_attn = QwenAttention(config, tp)
        self.mlp = QwenMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class QwenModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(QwenDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class QwenForCausalLM(nn.Module):
    """Qwen2ForCausalLM / Qwen3ForCausalLM.

    `forward(input_ids [T], positions [T]) -> hidden [T, H]`;
    `compute_logits(hidden [B, H]) -> [B, vocab]` (pass the last token of each
    sequence). Checkpoint q/k/v and gate/up tensors load into the merged
    projections through `packed_modules`.
    """

    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or get_tp_group()
        self.config = config
        self.model = QwenModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class QwenVLTextForCausalLM(QwenForCausalLM):
    """The language model of Qwen2-VL / Qwen2.5-VL, text only: the vision tower's tensors are
    skipped, and a checkpoint's ``model.language_model.*`` names (transformers 5) load like
    ``model.*``. With text-only input all three M-RoPE position ids are equal, so M-RoPE is
    plain RoPE."""

    checkpoint_prefixes = {"visual.": None, "model.visual.": None, "model.language_model.": "model."}
