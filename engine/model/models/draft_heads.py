"""Draft heads that read the target model's hidden states: EAGLE-3 (a head trained per target and
published on its own) and DeepSeek-V3's multi-token prediction layer (MTP, shipped in the target's
checkpoint). Both are one decoder layer over a token's embedding and a hidden state; both run
on the target's paged KV pool (their own caches, the target's block ids; ``engine.worker.drafting``).

A head's contract (``engine.worker.drafting.ModelDrafter`` drives it):

- ``capture_layers``: what the target hands out per token (``DecoderModel.capture_layers``);
- ``project(features [T, F]) -> hidden [T, H]``: a target token's features as the head's hidden
  input (EAGLE-3: ``fc``; MTP: the features themselves);
- ``forward(positions [T], embeds [T, H], hidden [T, H]) -> (normed, prenorm)`` [T, H] each: at
  position ``t`` it takes the embedding of token ``t + 1`` and the hidden state of position ``t``
  (projected target features, or the head's own ``prenorm`` of the position before when it drafts
  on) and predicts token ``t + 2``; ``prenorm`` feeds its next draft step;
- ``draft_ids(normed, target) -> int64 [T]``: the greedy next token, in the target's vocabulary;
- ``hidden_size``: H.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import TPGroup, get_tp_group
from engine.model.config import DeepseekConfig, ModelConfig
from engine.model.layers.embedding import ParallelLMHead
from engine.model.layers.gqa_attention import GQAAttention
from engine.model.layers.linear import ReplicatedLinear
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.layers.moe import EXPERT_PARAMS, expert_group
from engine.model.layers.norm import RMSNorm
from engine.model.models.deepseek_v2 import DeepseekV2DecoderLayer
from engine.model.models.dense import PACKED_MODULES

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle3_capture_layers(config: ModelConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream an EAGLE-3 head reads: config.json's
    ``eagle_aux_hidden_state_layer_ids`` (top level, or in ``eagle_config``), else vLLM's and
    SGLang's default ``(2, L // 2, L - 3)`` of an ``L``-layer target. Raises ValueError for an id
    outside ``[0, L)``."""
    raw = config.raw
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or (2, target_layers // 2, target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
        raise ValueError(f"an EAGLE-3 head reads 3 target layers in [0, {target_layers}), got {list(ids)}")
    return ids


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: Llama-style attention over ``[input_layernorm(embeds) |
    hidden_norm(hidden)]`` (2H wide), the residual stream starting at ``hidden``, then the SwiGLU MLP."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GQAAttention(config, tp, input_size=2 * h)
        self.mlp = SwiGLUMLP(h, config.intermediate_size, tp)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, positions, embeds, hidden):
        x = torch.cat([self.input_layernorm(embeds)[0], self.hidden_norm(hidden)[0]], dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), hidden.clone())
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """An EAGLE-3 head in the layout SGLang and vLLM load (``LlamaForCausalLMEagle3``): ``fc`` (3 x
    the target's hidden size -> H), ``midlayer``, ``norm``, ``lm_head`` over a draft vocabulary of
    ``draft_vocab_size`` ids and ``d2t`` (draft id -> target id = draft id + ``d2t[draft id]``).
    The token embedding is the target's (a checkpoint's own ``embed_tokens`` copy is skipped, as
    is ``t2d``, the inverse map). ``target``: the target model (its config and layer count)."""

    packed_modules = PACKED_MODULES
    checkpoint_prefixes = {"t2d": None, "embed_tokens.": None, "model.embed_tokens.": None}

    def __init__(self, config: ModelConfig, target: nn.Module, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or get_tp_group()
        target_config = target.config
        if config.architecture not in EAGLE3_ARCHITECTURES:
            raise ValueError(f"an EAGLE-3 head's config.json names {config.architecture!r}, not one of "
                             f"{', '.join(EAGLE3_ARCHITECTURES)}")
        self.capture_layers = eagle3_capture_layers(config, target_config.num_hidden_layers)
        self.hidden_size = config.hidden_size
        target_hidden = config.raw.get("target_hidden_size") or target_config.hidden_size
        draft_vocab = config.raw.get("draft_vocab_size") or config.vocab_size
        self.fc = ReplicatedLinear(3 * target_hidden, config.hidden_size)
        self.midlayer = Eagle3Layer(config, tp)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(draft_vocab, config.hidden_size, tp=tp)
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.int64), requires_grad=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward(self, positions, embeds, hidden):
        out, residual = self.midlayer(positions, embeds, hidden)
        return self.norm(out, residual)

    def draft_ids(self, normed: torch.Tensor, target: nn.Module) -> torch.Tensor:
        ids = self.lm_head(normed).argmax(-1)
        return ids + self.d2t[ids]


class DeepseekMTPLayer(DeepseekV2DecoderLayer):
    """DeepSeek-V3's multi-token prediction layer (``num_nextn_predict_layers``; the checkpoint's
    ``model.layers.<L>.*`` of an ``L``-layer target): ``eh_proj([enorm(embeds) | hnorm(hidden)])``
    (2H -> H) into a decoder layer of the target's kind (MLA, MoE at that index), its output
    normed by ``shared_head.norm``; the target's embedding and LM head (``shared_head.head`` and
    the layer's ``embed_tokens`` are copies of them, skipped). ``hidden``: the target's final
    normed hidden state (``capture_layers``), or the layer's own output."""

    expert_params = EXPERT_PARAMS
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, target: nn.Module, tp: TPGroup | None = None):
        tp = tp or get_tp_group()
        num_layers = config.num_hidden_layers
        if not config.raw.get("num_nextn_predict_layers"):
            raise ValueError("speculative='mtp' needs a checkpoint with an MTP layer "
                             "(num_nextn_predict_layers in config.json)")
        super().__init__(config, DeepseekConfig.from_model_config(config), num_layers, tp, expert_group(tp))
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        self.capture_layers = (num_layers,)
        self.hidden_size = h
        mine = f"model.layers.{num_layers}."
        # dict order: the first matching prefix wins
        self.checkpoint_prefixes = {f"{mine}shared_head.head.": None, f"{mine}embed_tokens.": None, mine: "",
                                    "model.": None, "lm_head.": None}

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, positions, embeds, hidden):
        x = self.eh_proj(torch.cat([self.enorm(embeds)[0], self.hnorm(hidden)[0]], dim=-1))
        out, residual = super().forward(positions, x, None)
        return self.shared_head.norm(out, residual)

    def draft_ids(self, normed: torch.Tensor, target: nn.Module) -> torch.Tensor:
        return target.compute_logits(normed).argmax(-1)
