"""The skeleton both model families share: pre-norm decoder layers with the fused residual
chain between an embedding and a final norm, and a vocab-parallel LM head. A family supplies
its attention and MLP modules; parameter names follow the checkpoints
(``model.embed_tokens``, ``model.layers.<i>.{self_attn, mlp, input_layernorm,
post_attention_layernorm}``, ``model.norm``, ``lm_head``)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed import TPGroup
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """``(positions [T], hidden [T, H], residual [T, H] | None) -> (hidden, residual)``: the
    first layer's residual is None; later layers add it in ``input_layernorm``
    (``fused_add_rms_norm``), each norm with this layer's own weights. ``self_attn(positions,
    hidden)`` and ``mlp(hidden)`` are the family's modules."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: ModelConfig):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """``(input_ids [T], positions [T]) -> hidden [T, H]``: embedding, the layers, final norm."""

    def __init__(self, config: ModelConfig, layers: Iterable[DecoderLayer], tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden
    [B, H]) -> [B, vocab]`` (pass each sequence's last token), the LM head tied to the
    embedding when the config says so."""

    def __init__(self, config: ModelConfig, layers: Iterable[DecoderLayer], tp: TPGroup):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layers, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
