"""The skeleton both model families share: pre-norm decoder layers with the fused residual
chain between an embedding and a final norm, and a vocab-parallel LM head. A family supplies
its attention and MLP modules; parameter names follow the checkpoints
(``model.embed_tokens``, ``model.layers.<i>.{self_attn, mlp, input_layernorm,
post_attention_layernorm}``, ``model.norm``, ``lm_head``)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model.config import ModelConfig
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """``(positions [T], hidden [T, H], residual [T, H] | None, keep_rows [R] | None) -> (hidden,
    residual)``: the first layer's residual is None; later layers add it in ``input_layernorm``
    (``fused_add_rms_norm``), each norm with this layer's own weights. ``self_attn(positions,
    hidden)`` and ``mlp(hidden)`` are the family's modules. With ``keep_rows`` (int64 row indices)
    the rows after attention are only those, in that order, hidden and residual alike (one
    ``index_select`` of each by the same indices): [R, H] out (the last layer, whose other rows
    nothing reads)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: ModelConfig):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, keep_rows=None):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if keep_rows is not None:
            hidden, residual = hidden.index_select(0, keep_rows), residual.index_select(0, keep_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """``(input_ids [T], positions [T], keep_rows [R] | None) -> hidden [T or R, H]``: embedding, the
    layers, final norm. ``keep_rows``: only these rows' hidden states are wanted (a prefill step's
    logits rows), so the last layer runs its MLP, and the final norm runs, on them alone; every
    layer's attention still sees (and caches) every row.

    ``capture_layers`` (set by a drafter; empty by default): after each forward, ``features``
    [T, len(capture_layers) x H] holds, for every token, the residual stream entering each listed
    layer (``i``: hidden + residual before layer ``i``, the embedding for 0; transformers'
    ``output_hidden_states[i]``), concatenated in the listed order; ``len(layers)`` names the final
    norm's output (for it the last layer and the norm run on every row, and ``keep_rows`` is
    applied after them). None when nothing is captured."""

    def __init__(self, config: ModelConfig, layers: Iterable[DecoderLayer], tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.capture_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        captured = {}
        final = len(self.layers) in self.capture_layers
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                captured[i] = hidden.clone() if residual is None else hidden + residual  # the norms add in place
            hidden, residual = layer(positions, hidden, residual, keep_rows if i == last and not final else None)
        hidden, _ = self.norm(hidden, residual)
        if final:
            captured[len(self.layers)] = hidden
            if keep_rows is not None:
                hidden = hidden.index_select(0, keep_rows)
        self.features = torch.cat([captured[i] for i in self.capture_layers], -1) if captured else None
        return hidden


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], keep_rows [R] | None) -> hidden [T or R, H]``
    (``DecoderModel``); ``compute_logits(hidden
    [B, H]) -> [B, vocab]`` (pass each sequence's last token), the LM head tied to the
    embedding when the config says so."""

    def __init__(self, config: ModelConfig, layers: Iterable[DecoderLayer], tp: TPGroup):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layers, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
