"""Qwen3-MoE and Qwen2-MoE: Qwen's attention (Qwen3: per-head q/k norm; Qwen2: QKV bias) over
sparse MoE blocks (softmax top-k routing; Qwen2-MoE adds a sigmoid-gated shared expert), with
the layers ``mlp_only_layers`` / ``decoder_sparse_step`` name as dense SwiGLU MLPs."""
from __future__ import annotations

from engine.distributed import TPGroup, get_tp_group
from engine.model.config import ModelConfig, QwenMoeConfig
from engine.model.layers.gqa_attention import GQAAttention
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.layers.moe import DENSE_MAX_TOKENS, EXPERT_PARAMS, GatedSharedExpertMoE, MoE, expert_group
from engine.model.models.decoder import CausalLM, DecoderLayer
from engine.model.models.dense import PACKED_MODULES


class QwenMoeDecoderLayer(DecoderLayer):
    """The shared pre-norm layer with Qwen's attention; the MLP is a dense SwiGLU MLP where
    ``mlp_only_layers`` / ``decoder_sparse_step`` say so, else routed experts (Qwen2-MoE: plus
    the gated shared expert)."""

    def __init__(self, config: ModelConfig, moe: QwenMoeConfig, layer_idx: int, tp: TPGroup, ep: TPGroup):
        if not moe.is_moe_layer(layer_idx):
            mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, tp)
        elif moe.shared_expert_intermediate_size:
            mlp = GatedSharedExpertMoE(config.hidden_size, moe, tp, ep)
        else:
            mlp = MoE(config.hidden_size, moe, tp, ep)
        super().__init__(GQAAttention(config, tp), mlp, config)


class QwenMoeForCausalLM(CausalLM):
    """Qwen3MoeForCausalLM / Qwen2MoeForCausalLM (``CausalLM``'s forward and compute_logits).

    Attention and dense layers split over ``tp``, routed experts over ``ep`` (default: the same
    ranks), as DeepSeek's. Checkpoint q/k/v and gate/up tensors load into merged projections
    through ``packed_modules``, ``experts.<e>.<proj>.weight`` into the stacked expert weights
    through ``expert_params``. ``max_graph_batch``: CUDA graphs up to ``DENSE_MAX_TOKENS``, as DeepSeek's.
    """

    max_graph_batch = DENSE_MAX_TOKENS
    packed_modules = PACKED_MODULES
    expert_params = EXPERT_PARAMS

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, ep: TPGroup | None = None):
        tp = tp or get_tp_group()
        ep = ep or expert_group(tp)
        moe = QwenMoeConfig.from_model_config(config)
        super().__init__(config, (QwenMoeDecoderLayer(config, moe, i, tp, ep) for i in range(config.num_hidden_layers)),
                         tp)
        self.moe = moe
