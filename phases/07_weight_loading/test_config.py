"""Models built from ModelConfig: the published shapes give the published parameter counts, in
their final dtype; config values reach every layer; what a config cannot build is refused (reading
config.json itself is phase 05's test_model_config.py)."""
import json

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.layers.moe import GatedSharedExpertMoE, MoE
from engine.model.models.registry import build_model
from phases.published_configs import (
    LLAMA3_1_8B,
    LLAMA3_2_1B,
    MISTRAL_7B_V01,
    MISTRAL_7B_V03,
    QWEN1_5_MOE_A2_7B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    transformers5,
)


def test_unknown_architecture_is_an_error_naming_it():
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        build_model(ModelConfig.from_dict(dict(QWEN3_8B, architectures=["GPTNeoXForCausalLM"])), "meta")


def test_model_is_built_in_its_final_dtype_without_a_float32_copy():
    """Every tensor created while building the full 8B shape (on meta: no memory) is
    bf16 but the small float32 RoPE table, and no parameter is converted afterwards
    (only the RoPE table, float64 -> float32, is under 0.1% of the parameters)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.float32_elements, self.converted_elements = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("_to_copy", "to"):
                self.converted_elements += out.numel()
            elif isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.float32_elements += out.numel()
            return out

    c = ModelConfig.from_dict(QWEN3_8B)
    with Created() as created:
        model = build_model(c, "meta", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(8.19e9, rel=0.01)
    assert created.converted_elements < 0.001 * total and created.float32_elements < 0.001 * total
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                  "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_tiny_config_values_reach_the_config_and_every_norm(tiny_checkpoint, arch):
    """FM-033: the tiny checkpoints' rms_norm_eps and rope_theta differ from every default, but float32
    logits cannot tell eps 1e-5 from 1e-6 (the change is far below the 1e-4 tolerance), so the values are
    compared directly: in ModelConfig, in every RMSNorm of the built model and in the rotary table."""
    from pathlib import Path

    from engine.model import kernels
    from engine.model.layers.norm import RMSNorm

    model_dir = tiny_checkpoint(arch)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))  # transformers-5 form
    config = ModelConfig.from_model_dir(model_dir)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta"):
        assert getattr(config, key) == raw[key], f"{key}: config has {getattr(config, key)}, config.json {raw[key]}"
    model = build_model(config, "cpu")
    norms = {name: m.eps for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert norms and all(eps == raw["rms_norm_eps"] for eps in norms.values()), \
        f"RMSNorm eps differs from config.json's {raw['rms_norm_eps']}: {norms}"
    rotary = model.model.layers[0].self_attn.rotary_emb
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    table, _ = kernels.get_cos_sin_cache(raw["max_position_embeddings"], head_dim, raw["rope_theta"],
                                         config.rope_scaling)
    assert rotary.cos_sin_cache is table, "the rotary table is not the one for config.json's rope_theta"


@pytest.mark.parametrize("published,params", [(LLAMA3_1_8B, 8.03e9), (LLAMA3_2_1B, 1.24e9)], ids=["3.1-8B", "3.2-1B"])
def test_published_llama3_configs(published, params):
    """Llama 3.x (its config values: phase 05's test_model_config.py) built on meta: the published
    parameter count, the tied 3.2 included."""
    model = build_model(ModelConfig.from_dict(published), "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


def test_published_qwen_moe_configs():
    """Qwen3-30B-A3B and Qwen1.5-MoE (their config values: phase 05's test_model_config.py) built on
    meta: every layer a plain MoE, or a MoE with the gated shared expert; the published sizes."""
    model = build_model(ModelConfig.from_dict(QWEN3_30B_A3B), "meta", torch.bfloat16)
    assert all(type(layer.mlp) is MoE for layer in model.model.layers)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(30.53e9, rel=0.01)

    model = build_model(ModelConfig.from_dict(QWEN1_5_MOE_A2_7B), "meta", torch.bfloat16)
    assert all(type(layer.mlp) is GatedSharedExpertMoE for layer in model.model.layers)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(14.32e9, rel=0.01)


@pytest.mark.parametrize("edit,message", [
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"num_experts": None}, "num_experts"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok = 200"),
    ({"decoder_sparse_step": -1}, "decoder_sparse_step"),
])
def test_bad_qwen_moe_configs_are_errors_naming_the_key(edit, message):
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig.from_dict({**QWEN3_30B_A3B, **edit}), "meta")


def test_qwen2_moe_without_its_shared_expert_size_is_an_error():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        build_model(ModelConfig.from_dict({**QWEN1_5_MOE_A2_7B, "shared_expert_intermediate_size": None}), "meta")


@pytest.mark.parametrize("published,window", [
    (MISTRAL_7B_V01, 4096),
    ({**QWEN1_5_MOE_A2_7B, "use_sliding_window": True, "sliding_window": 4096}, 4096),
    ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096}, 4096),
])
def test_a_sliding_window_that_can_bind_is_refused(published, window):
    """FM-053: attention here is full causal; a configured window shorter than the model's context
    is refused when the model is built (config reading keeps it), never run as if absent."""
    c = ModelConfig.from_dict(published)
    assert c.sliding_window == window
    with pytest.raises(ValueError, match=f"sliding_window = {window}.*not implemented"):
        build_model(c, "meta", torch.bfloat16)


@pytest.mark.parametrize("published", [
    MISTRAL_7B_V03,                                             # null
    {**MISTRAL_7B_V01, "sliding_window": 32768},                # covers max_position_embeddings: never binds
    {**QWEN3_8B, "use_sliding_window": False, "sliding_window": 4096},  # Qwen's flag off
    transformers5({**QWEN1_5_MOE_A2_7B, "sliding_window": 0}),  # transformers 5 writes 0 for "none"
], ids=["null", "covers-context", "qwen-flag-off", "zero"])
def test_a_window_that_never_binds_is_full_attention(published):
    c = ModelConfig.from_dict(published)
    assert c.sliding_window is None
    build_model(c, "meta", torch.bfloat16)
