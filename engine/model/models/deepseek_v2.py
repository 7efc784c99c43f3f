"""DeepSeek-V2 / V2-Lite / V3 decoder: multi-head latent attention, dense first layers,
then mixture-of-experts layers (routed experts expert-parallel, shared experts TP)."""
from __future__ import annotations

from engine.distributed import TPGroup, get_tp_group
from engine.model.config import DeepseekConfig, ModelConfig
from engine.model.layers.mla import MultiHeadLatentAttention
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.layers.moe import DENSE_MAX_TOKENS, EXPERT_PARAMS, MoE, expert_group
from engine.model.models.decoder import CausalLM, DecoderLayer


class DeepseekV2DecoderLayer(DecoderLayer):
    """The shared pre-norm layer with multi-head latent attention; the MLP is dense for the
    first ``first_k_dense_replace`` layers, MoE after."""

    def __init__(self, config: ModelConfig, ds: DeepseekConfig, layer_idx: int, tp: TPGroup, ep: TPGroup):
        mlp = (MoE(config.hidden_size, ds, tp, ep) if ds.is_moe_layer(layer_idx)
               else SwiGLUMLP(config.hidden_size, config.intermediate_size, tp))
        super().__init__(MultiHeadLatentAttention(config, ds, tp), mlp, config)


class DeepseekV2ForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM.

    ``CausalLM``'s forward and compute_logits. Dense layers and attention split over
    ``tp``; routed experts over ``ep`` (default: the same ranks as ``tp``). Each MLA layer
    caches one latent entry per token (its ``kv_spec``, ``kv_cache.attention_layers``). Checkpoint gate/up
    tensors load into merged projections through ``packed_modules``, per-expert tensors
    ``experts.<e>.<name>.weight`` into the stacked expert weights through ``expert_params``.
    ``max_graph_batch``: CUDA graphs are captured only up to ``DENSE_MAX_TOKENS``, the batch
    sizes whose MoE paths never read the host; the grouped path beyond reads its group ends
    on the host wherever torch's grouped GEMM falls back to a loop (all but bf16 on sm90).
    A DeepSeek-V3 checkpoint's multi-token prediction layers (``num_nextn_predict_layers``, stored
    as layers ``num_hidden_layers`` on) are not this model's: skipped here, loaded by
    ``draft_heads.DeepseekMTPLayer`` for ``speculative="mtp"``.
    """

    max_graph_batch = DENSE_MAX_TOKENS
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_params = EXPERT_PARAMS

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, ep: TPGroup | None = None):
        tp = tp or get_tp_group()
        ep = ep or expert_group(tp)
        ds = DeepseekConfig.from_model_config(config)
        super().__init__(config, (DeepseekV2DecoderLayer(config, ds, i, tp, ep)
                                  for i in range(config.num_hidden_layers)), tp)
        self.deepseek = ds
        nextn = config.raw.get("num_nextn_predict_layers") or 0
        self.checkpoint_prefixes = {f"model.layers.{config.num_hidden_layers + i}.": None for i in range(nextn)}
