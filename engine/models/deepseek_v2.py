"""DeepSeek-V2 / V2-Lite / V3 decoder: multi-head latent attention, dense first layers,
then mixture-of-experts layers (routed experts expert-parallel, shared experts TP)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.config import DeepseekConfig, ModelConfig
from engine.distributed import TPGroup, get_ep_group, get_tp_group
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.mla import MultiHeadLatentAttention
from engine.layers.moe import DENSE_MAX_TOKENS, MoE, SwiGLUMLP
from engine.layers.norm import RMSNorm


class DeepseekV2DecoderLayer(nn.Module):
    """(hidden, residual) -> (hidden, residual), the fused residual chain of the Qwen layers;
    the MLP is dense for the first ``first_k_dense_replace`` layers, MoE after."""

    def __init__(self, config: ModelConfig, ds: DeepseekConfig, layer_idx: int, tp: TPGroup, ep: TPGroup):
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config, ds, tp)
        self.mlp = (MoE(config.hidden_size, ds, tp, ep) if ds.is_moe_layer(layer_idx)
                    else SwiGLUMLP(config.hidden_size, config.intermediate_size, tp))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, config: ModelConfig, ds: DeepseekConfig, tp: TPGroup, ep: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, ds, i, tp, ep)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(nn.Module):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM.

    `forward(input_ids [T], positions [T]) -> hidden [T, H]`;
    `compute_logits(hidden [B, H]) -> [B, vocab]`. Dense layers and attention split over
    ``tp``; routed experts over ``ep`` (default: the same ranks as ``tp``). Each MLA layer
    caches one latent entry per token (``kv_cache.kv_cache_spec``). Checkpoint gate/up
    tensors load into merged projections through ``packed_modules``, per-expert tensors
    ``experts.<e>.<name>.weight`` into the stacked expert weights through ``expert_params``.
    ``max_graph_batch``: the MoE decode paths without a host read serve up to
    ``DENSE_MAX_TOKENS`` tokens, so CUDA graphs are captured only up to that batch size.
    """

    max_graph_batch = DENSE_MAX_TOKENS
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                     "down_proj": ("down_proj", 0)}

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, ep: TPGroup | None = None):
        super().__init__()
        tp = tp or get_tp_group()
        ep = ep or (get_ep_group() if tp == get_tp_group() else dataclasses.replace(tp, name="ep"))
        self.config = config
        self.deepseek = DeepseekConfig.from_model_config(config)
        self.model = DeepseekV2Model(config, self.deepseek, tp, ep)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
