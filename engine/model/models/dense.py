"""The dense decoder family: Qwen2, Qwen3, Llama 3.x and Mistral are one model — grouped-query
attention (QKV bias for Qwen2, per-head q/k norm for Qwen3, neither for Llama and Mistral:
config.json says which), neox RoPE (Llama 3.1's scaling in the shared cos/sin table), RMSNorm and
a SwiGLU MLP; Qwen2-VL's language model is it too, text only."""
from __future__ import annotations

from engine.distributed import TPGroup, get_tp_group
from engine.model.config import ModelConfig
from engine.model.layers.gqa_attention import GQAAttention
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.models.decoder import CausalLM, DecoderLayer

# checkpoint projection -> (merged parameter, shard): q/k/v into GQAAttention's QKV GEMM, gate/up into SwiGLU's
PACKED_MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DenseDecoderLayer(DecoderLayer):
    """The shared pre-norm layer with grouped-query attention and a SwiGLU MLP."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__(GQAAttention(config, tp), SwiGLUMLP(config.hidden_size, config.intermediate_size, tp), config)


class DenseForCausalLM(CausalLM):
    """Qwen2ForCausalLM / Qwen3ForCausalLM, LlamaForCausalLM / MistralForCausalLM
    (``CausalLM``'s forward and compute_logits).
    Checkpoint q/k/v and gate/up tensors load into the merged projections through
    ``packed_modules``.
    """

    packed_modules = PACKED_MODULES

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        tp = tp or get_tp_group()
        super().__init__(config, (DenseDecoderLayer(config, tp) for _ in range(config.num_hidden_layers)), tp)
