"""ModelConfig reads every dimension from config.json, in both the published
and the transformers-5 form."""
import json

import pytest
import torch

from engine.model.config import ModelConfig, QwenMoeConfig
from engine.model.layers.moe import GatedSharedExpertMoE, MoE
from engine.model.models.registry import build_model

# The published Qwen3-8B config.json (external data, not produced by our code).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
}


def test_published_qwen3_8b_config():
    c = ModelConfig.from_dict(QWEN3_8B)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (4096, 12288, 32, 8)
    assert (c.num_hidden_layers, c.head_dim, c.vocab_size, c.max_position_embeddings) == (36, 128, 151936, 40960)
    assert (c.rope_theta, c.rms_norm_eps, c.torch_dtype) == (1e6, 1e-6, torch.bfloat16)
    assert c.qk_norm and not c.qkv_bias and not c.tie_word_embeddings and c.rope_scaling is None
    assert c.eos_token_ids == (151645,)


def test_transformers5_form_reads_the_same():
    new = {k: v for k, v in QWEN3_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new.update(rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, dtype="bfloat16")
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(QWEN3_8B)


def test_yarn_rope_parameters_become_rope_scaling():
    new = dict(QWEN3_8B, rope_parameters={"rope_theta": 10000, "rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 4096})
    del new["rope_theta"], new["rope_scaling"]
    c = ModelConfig.from_dict(new)
    assert c.rope_theta == 10000 and c.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 4096}


def test_head_dim_falls_back_to_hidden_over_heads_and_qwen2_has_qkv_bias():
    qwen2 = {k: v for k, v in QWEN3_8B.items() if k not in ("head_dim", "attention_bias")}
    qwen2.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, num_attention_heads=28)
    c = ModelConfig.from_dict(qwen2)
    assert c.head_dim == 128 and c.qkv_bias and not c.qk_norm


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"])
def test_missing_dimension_is_an_error_naming_it(key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict({k: v for k, v in QWEN3_8B.items() if k != key})


def test_bad_model_dirs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN3_8B.items() if k != "architectures"}))
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_model_dir(tmp_path)


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


# Published config.json files (external data): Llama 3.1 8B, Llama 3.2 1B (tied), Mistral 7B v0.1
# (a sliding window) and v0.3 (none), Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B (Qwen2-MoE).
LLAMA3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA3_2_1B = {
    **LLAMA3_1_8B, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA3_1_8B["rope_scaling"], "factor": 32.0},
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
MISTRAL_7B_V03 = {**MISTRAL_7B_V01, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}


def transformers5(cfg: dict, **renames) -> dict:
    """The same config as transformers 5 writes it: rope_parameters (with rope_theta), dtype, and
    ``renames`` (old key -> new key, e.g. Qwen3-MoE's num_experts -> num_local_experts)."""
    out = {renames.get(k, k): v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    out["rope_parameters"] = {**(cfg.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": cfg["rope_theta"]}
    out["dtype"] = cfg["torch_dtype"]
    return out


@pytest.mark.parametrize("published,params", [(LLAMA3_1_8B, 8.03e9), (LLAMA3_2_1B, 1.24e9)], ids=["3.1-8B", "3.2-1B"])
def test_published_llama3_configs(published, params):
    """Llama 3.x: llama3 rope scaling read as such, head_dim from config.json or hidden / heads, no
    QKV bias, no q/k norm, no window; the model built (on meta) has the published parameter count."""
    c = ModelConfig.from_dict(published)
    assert c.rope_scaling == published["rope_scaling"] and c.rope_theta == 500000.0
    assert c.head_dim == published.get("head_dim", 128) and c.rms_norm_eps == 1e-5
    assert not (c.qkv_bias or c.qk_norm) and c.sliding_window is None
    assert c.tie_word_embeddings == published["tie_word_embeddings"]
    model = build_model(c, "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize("published,renames", [(LLAMA3_1_8B, {}), (MISTRAL_7B_V03, {}),
                                               (QWEN3_30B_A3B, {"num_experts": "num_local_experts"}),
                                               (QWEN1_5_MOE_A2_7B, {})], ids=["llama", "mistral", "qwen3-moe",
                                                                               "qwen2-moe"])
def test_new_architectures_read_the_same_in_the_transformers5_form(published, renames):
    a, b = ModelConfig.from_dict(published), ModelConfig.from_dict(transformers5(published, **renames))
    assert a == b
    if "num_experts" in published:
        assert QwenMoeConfig.from_model_config(a) == QwenMoeConfig.from_model_config(b)


def test_published_qwen_moe_configs():
    """Qwen3-30B-A3B: 128 experts top-8 renormalised, every layer MoE, q/k norm, no shared expert;
    Qwen1.5-MoE: 60 experts top-4 not renormalised, a 5632-wide gated shared expert, QKV bias, and
    its sliding_window 32768 unused (use_sliding_window false). Built on meta: the published sizes."""
    q3 = ModelConfig.from_dict(QWEN3_30B_A3B)
    moe = QwenMoeConfig.from_model_config(q3)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.shared_expert_intermediate_size == 0
    assert (moe.scoring_func, moe.topk_method, moe.routed_scaling_factor) == ("softmax", "greedy", 1.0)
    assert q3.qk_norm and not q3.qkv_bias and q3.sliding_window is None
    model = build_model(q3, "meta", torch.bfloat16)
    assert all(type(layer.mlp) is MoE for layer in model.model.layers)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(30.53e9, rel=0.01)

    q2 = ModelConfig.from_dict(QWEN1_5_MOE_A2_7B)
    moe = QwenMoeConfig.from_model_config(q2)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size) == (60, 4, 5632)
    assert not moe.norm_topk_prob and q2.qkv_bias and not q2.qk_norm and q2.sliding_window is None
    model = build_model(q2, "meta", torch.bfloat16)
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
